"""The stream loop (Algorithm 1): wait, replay, grow, train, evaluate, log.

A run is a population of S learners walking one stream loop: S = 1 is an
ordinary run; `config.num_seeds = S > 1` trains the seeds `seed`, ...,
`seed + S - 1` of one config together, stacked on a leading axis, each with
what a separate run of that seed would have (stream partition, training
subset, initialisation, data order, early stopping).

`run` sets the run up (`alma_jax.stream.run_setup`: data, streams, method, compiled
steps, policies), restores its last checkpoint, and walks `stream`, which is
Algorithm 1 over an explicit `RunState`: at every time step the waiting
policy says whether the learner trains; a stage starts as the stage policy
says (`alma_jax.policies`, growth included) and trains (`alma_jax.engine.train`);
the learner is evaluated unless unchanged; the step's records go to the observers
(`alma_jax.observers`), which write the outputs:
`config.json`, `log.jsonl` (one record per time step), `architecture.jsonl`,
`checkpoints/` (orbax, see `config.checkpoint`), TensorBoard event files
(`config.log.tensorboard`) and, at the end, `summary.json` and `error.png`;
with S > 1 each seed's `config.json`, `log.jsonl` and `summary.json` go to
`seed_<seed>/` and the top-level `summary.json` holds each metric's mean and
sample standard deviation (ddof=1) over the seeds. Running the same command again resumes
from the last complete checkpoint; every random choice is seeded by (seed,
t), so a resumed run writes the same records and summary as an uninterrupted
one (wall-clock times aside). Signals and the kill-point test hook:
`alma_jax.outputs.interrupts`.

In a multi-process run (`alma_jax.runtime.multihost`) every process walks the same
loop on a global mesh; process 0 alone writes config.json, the logs and the
summaries, and all processes write and restore the checkpoints together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from alma_jax.configuration import fields as F
from alma_jax.engine import meter as meter_lib
from alma_jax.engine import population
from alma_jax.engine import timing
from alma_jax.engine import train
from alma_jax.engine.metrics import Log, Record
from alma_jax.observers import architecture
from alma_jax.observers import checkpoints as ckpt_obs
from alma_jax.observers import events
from alma_jax.observers import progress
from alma_jax.observers import records
from alma_jax.observers import summary
from alma_jax.observers.base import Observer, Observers
from alma_jax.observers.clock import Clock
from alma_jax.outputs import interrupts
from alma_jax.outputs import workdir as wd
from alma_jax.outputs import workdir_lock
from alma_jax.outputs.interrupts import RunInterrupted
from alma_jax.runtime import caches
from alma_jax.runtime import executables
from alma_jax.runtime import multihost
from alma_jax.state import RunState
from alma_jax.stream import run_setup
from alma_jax.stream import validation
from alma_jax.stream.run_setup import Setup
from alma_jax.tuning import tune

__all__ = ["run", "RunInterrupted", "RunState", "stream"]


def run(config, workdir: str, *, overwrite: bool = False, startup_s: float | None = None,
        observers: Sequence[Observer] = (), keep_programs: bool = False) -> dict[str, Any]:
  """Runs (or resumes) one ALMA stream; writes config.json, log.jsonl, summary.json.

  Args:
    config: the experiment config.
    workdir: output directory; a run found there is resumed when its config
      is the same (a different config is an error unless `overwrite`).
    overwrite: discard the outputs of a previous run in `workdir` first.
    startup_s: seconds the process spent before this call (interpreter and
      imports), reported in the summary's timing breakdown.
    observers: more observers of the loop (`alma_jax.observers.base.Observer`), told
      after the run's own outputs.
    keep_programs: keep the run's compiled programs and FLOP counts beside the persistent
      compilation cache (`caches.kept_programs_dir`), and load those of an earlier process
      of the same config, data and code without tracing them (`alma_jax.runtime.executables`).
      Without it, where `executables.keep_in_memory` allows, they are kept in this
      process's memory for its later runs.

  Returns:
    The summary (with S > 1: the mean and standard deviation over the seeds).

  Raises:
    ValueError: invalid config, data, workdir or checkpoints (nothing is
      written then), or another run holds `workdir`.
    DivergenceError: non-finite training loss (the checkpoints stay intact).
    RunInterrupted: SIGINT or SIGTERM.
  """
  config = validation.validate(config)
  wd.check_writable(workdir)
  with workdir_lock.hold(workdir, primary=multihost.is_primary()):
    if not overwrite:
      resumed = tune.resumed(config, workdir)
      if resumed is not config:  # values it ran with, checked as this code checks them
        config = validation.validate(resumed)
      wd.check_resume(workdir, config)
    wd.check_outputs(workdir, config, overwrite)
    multihost.sync("alma_jax: workdir checked")  # before process 0 writes to it
    meter = meter_lib.Meter(F.get(config.log, "log.progress"),
                            every_s=F.get(config.train, "train.progress_every_s"),
                            primary=multihost.is_primary())
    vote = multihost.Vote() if jax.process_count() > 1 else None
    with interrupts.Signals(vote, compiling=meter.is_compiling) as signals, \
        contextlib.closing(meter.start()):
      t_start, timer = time.monotonic(), timing.Breakdown()
      meter.doing("loading the data and setting the run up (with any speed choices left to "
                  "measure)")
      with timer("data_s"):
        setup = run_setup.build(config, workdir)
      setup.steps.programs.listener = meter
      meter.plan = setup.progress_plan()
      clock = Clock(setup.steps, timer, t_start, startup_s)
      told, checkpoints = _outputs(setup, signals, clock, meter, observers)
      try:
        with executables.keeping(caches.kept_programs_dir() if keep_programs
                                 else executables.memory_folder(), setup.program_context()):
          return _walk(setup, told, checkpoints, signals, clock, meter, overwrite)
      finally:
        told.close()


def _outputs(setup: Setup, signals: interrupts.Signals, clock: Clock, meter: meter_lib.Meter,
             extra: Sequence[Observer]) -> tuple[Observers, ckpt_obs.Checkpoints]:
  """The run's observers, in the order they are told (the checkpoints among them): a step's
  checkpoint starts before its progress line, and the last one is complete before the
  summary is written."""
  arch = architecture.ArchitectureLog(setup)
  checkpoints = ckpt_obs.Checkpoints(setup, signals, clock, arch)
  told = [clock, records.RecordLog(setup), events.EventFiles(setup), events.WandbRuns(setup),
          arch, checkpoints,
          progress.Progress(setup, clock, meter), summary.Summary(setup, signals, clock), *extra]
  return Observers(told, signals, clock.timer), checkpoints


def _walk(setup: Setup, observers: Observers, checkpoints: ckpt_obs.Checkpoints,
          signals: interrupts.Signals, clock: Clock, meter: meter_lib.Meter,
          overwrite: bool) -> dict[str, Any]:
  """Restores the run, then walks its stream; returns the summary."""
  meter.doing("restoring the last checkpoint")
  state, snapshot = _open(setup, observers, checkpoints, signals, overwrite)
  try:
    with signals.deferred():  # a signal stops the loop at the next step boundary
      signals.check()  # (a multi-process run's first chance to stop, after its set-up)
      meter.doing("starting the stream")
      state = _begin(setup, state, snapshot, clock, meter)
      return stream(setup, state, observers, checkpoints, signals, clock, meter)
  except RunInterrupted as e:
    if observers.interrupt():  # the checkpoint being written completed first: name it
      raise RunInterrupted(e.signum, signals.last_checkpoint) from None
    raise


def _open(setup: Setup, observers: Observers, checkpoints: ckpt_obs.Checkpoints,
          signals: interrupts.Signals, overwrite: bool):
  """Restores (or starts) the run and makes its outputs match; returns (state, snapshot)."""
  with signals.critical():
    if overwrite and setup.primary:
      wd.clear_outputs(setup.workdir)
    multihost.sync("alma_jax: outputs cleared")
    snapshot, recs = checkpoints.restore()
    if setup.primary:  # the checkpoints fit this run: the workdir is its own
      tune.remember_in_workdir(setup.workdir, setup.choice_records)
    state = RunState(logs=[Log.from_records(r) for r in recs])
    observers.start(state, snapshot)
  return state, snapshot


def _begin(setup: Setup, state: RunState, snapshot, clock: Clock,
           meter: meter_lib.Meter) -> RunState:
  """The state the stream continues from: untrained learners, or the checkpoint's (with their
  last test errors)."""
  if snapshot is None:
    # The initialisation program (a large model's random draws: seconds to compile on a GPU)
    # is announced like a step, so that a signal during its compile ends the process promptly.
    meter.compiling("the initial parameters", "first use")
    t0 = time.monotonic()
    state = dataclasses.replace(state, learner=setup.initial_learner())
    meter.compiled("the initial parameters", time.monotonic() - t0)
    setup.count_ahead(state.learner)  # while the first programs compile
    if jax.default_backend() == "cpu":
      with clock.timer("train_s"):  # compiles the train step the first stage will use
        setup.log_estimate(state.learner)
    return state
  memo = snapshot.extra.get(ckpt_obs.POLICY_MEMO)
  setup.count_ahead(snapshot.learner)
  return dataclasses.replace(
      state, learner=snapshot.learner, policy_memo=None if memo is None else tuple(memo),
      opt_state=snapshot.opt_state if setup.config.train.keep_optimizer_state else None,
      errors=np.asarray([log.records[-1].test_error for log in state.logs]),
      nll=np.asarray([log.records[-1].extra.get("test_nll", np.nan) for log in state.logs]))


# -- Algorithm 1 -----------------------------------------------------------------------------------
def stream(setup: Setup, state: RunState, observers: Observers,
           checkpoints: ckpt_obs.Checkpoints, signals: interrupts.Signals,
           clock: Clock, meter: meter_lib.Meter | None = None) -> dict[str, Any]:
  """Algorithm 1 from the time step after `state.t` to B; returns the summary.

  At every time step t the mega-batch t arrives. When the waiting policy says
  so (`WaitPolicy.decide`, which may evaluate the learner on the new data and
  adds its record fields), the learner trains on what arrived since its last
  stage (with replay, a fraction of the earlier data too): the stage policy
  starts the stage (the method grows before it). The learner is then
  evaluated on the test set (an unchanged one is not re-evaluated), and the
  observers get the step's records (one per seed) and the end of the step;
  `meter` says the progress.
  """
  meter = meter or meter_lib.Meter("off")
  for t in range(state.t + 1, setup.num_t + 1):
    signals.check()
    meter.at(t)
    t_step = time.monotonic()
    state, spent, decided = dataclasses.replace(state, stats=None), {}, []
    started = [{} for _ in setup.seeds]
    if t > 0:
      with clock.timer("eval_s"):  # a policy may evaluate the learner on the new data
        decision = setup.wait_policy.decide(t, state, setup.probe)
      if decision.train:
        state, spent, started = _stage(setup, state, t, observers, checkpoints, signals, clock,
                                       meter)
      decided = setup.wait_policy.stage_fields(decision, state)
    decided = [{**d, **f} for d, f in zip(decided or [{} for _ in setup.seeds], started)]
    if state.errors is None or state.trained:  # an unchanged model is not re-evaluated
      meter.doing(f"evaluating the test set at t={t}")
      with clock.timer("eval_s"):
        acc, nll = setup.steps.evaluate(state.learner, "test", setup.test_idx())
        state = dataclasses.replace(state, errors=1.0 - acc, nll=nll)
    diagnostics = setup.diagnostics()
    if diagnostics is not None:
      meter.doing(f"measuring the plasticity diagnostics at t={t}")
      with clock.timer("eval_s"):
        measured = diagnostics.fields(state.learner, state.trained)
      decided = [{**d, **m} for d, m in zip(decided, measured)]
    step = _records(setup, state, t, spent, time.monotonic() - t_step, decided)
    state = dataclasses.replace(state, logs=[log.append(r) for log, r in zip(state.logs, step)])
    meter.doing(f"writing the outputs of t={t}")
    observers.record(state, step)
    observers.step(state)
  meter.doing("writing the summary")
  return observers.end(state)


def _records(setup: Setup, state: RunState, t: int, spent: dict, wall_s: float,
             decided: list[dict]) -> list[Record]:
  """Each seed's record of time step `t`: test error, Mem, the compute `spent` on it, and the
  fields of the policies and diagnostics (`decided`: one dict per seed, or none)."""
  flops = setup.seed_flops(state.learner)
  with timing.counting():  # Mem is counted from shapes: a trace that builds no program
    num_params = setup.method.num_params(population.abstract_member(state.learner))
  fields = ("train_flops", "train_flops_forward", "train_macs", "growth_flops", "growth_macs")
  extra = getattr(setup.task, "record_metrics", None)  # fields of the task's own
  return [Record(t=t, test_error=float(state.errors[i]), num_params=num_params,
                 **{f: float(spent[f][i]) if f in spent else 0.0 for f in fields},
                 inference_flops_per_example=flops["inference_per_example"],
                 trained=state.trained, wall_s=wall_s,
                 extra={**({} if extra is None else extra(float(state.nll[i]), flops)),
                        **(decided[i] if decided else {})})
          for i in range(len(setup.seeds))]


# -- a training stage ------------------------------------------------------------------------------
def _stage(setup: Setup, state: RunState, t: int, observers: Observers,
           checkpoints: ckpt_obs.Checkpoints, signals: interrupts.Signals,
           clock: Clock, meter: meter_lib.Meter
           ) -> tuple[RunState, dict[str, np.ndarray], list[dict]]:
  """The stage at time step `t`: the stage policy starts it (growth included), then it trains.
  Returns (the state with the stage's learner, optimizer state, stats and policy memory, the
  compute spent per seed (Record fields), the stage policy's record fields per seed)."""
  method, steps = setup.method, setup.steps
  contexts = setup.contexts(t, state.num_stages + 1, state.last_stage_t)
  passes_before, pass_macs_before = steps.pass_flops, steps.pass_macs
  skeys = population.fold(setup.keys, t)
  meter.doing(f"starting the stage at t={t} ({setup.stage_policy.name}, growth before it)")
  # The policy sees the optimizer state only when the stage may keep it.
  keep = setup.config.train.keep_optimizer_state
  learner, opt_state, memo, started = _start_stage(setup, state.learner, skeys, contexts,
                                                   state.opt_state if keep else None,
                                                   state.policy_memo)
  if not keep:
    opt_state = None
  setup.count_ahead(learner)  # the trained structure's FLOPs, counted while it trains
  signals.check()

  store = checkpoints.stage(t, learner.structure)
  try:
    learner, opt_state, stats = train.fit_stage(
        steps, learner, train.StageData(np.stack([x.train_idx for x in contexts]),
                                        np.stack([x.val_idx for x in contexts]),
                                        population.fold(skeys, 3), t,
                                        setup.anchor(learner) if steps.programs.l2_init else None),
        opt_state,
        train.StageHooks(labels=setup.seeds, check=signals.check,
                         on_epoch=lambda *a: observers.epoch(t, *a),
                         on_resumed=lambda epoch: observers.stage_resumed(t, epoch),
                         checkpoints=store,
                         meter=meter))
  except RunInterrupted:
    checkpoints.stage_interrupted(t)
    raise
  checkpoints.stage_done()
  meter.stage_end(float(np.max(stats.epochs_run)))
  if stats.diverged.any():
    logging.warning("stage t=%d diverged; continuing with its best epoch (%s)", t,
                    ", ".join(str(e) for e in stats.best_epoch))
  clock.timer.add({"train_s": stats.train_s, "eval_s": stats.eval_s})
  flops = setup.seed_flops(learner)  # of the structure that trained
  spent = {"train_flops": flops["train_step"] * stats.steps_run,
           "train_flops_forward": flops["train_step_forward"] * stats.steps_run,
           "train_macs": flops["train_macs_per_example"] * stats.examples_run}
  state = dataclasses.replace(state, learner=steps.place(learner), opt_state=opt_state,
                              stats=stats, policy_memo=memo)
  spent["growth_flops"] = np.full(len(setup.seeds), (steps.pass_flops - passes_before)
                                  / len(setup.seeds))
  spent["growth_macs"] = np.full(len(setup.seeds), (steps.pass_macs - pass_macs_before)
                                 / len(setup.seeds))
  return state, spent, started


def _start_stage(setup: Setup, learner, keys, contexts, opt_state, memo):
  """The stage policy's `start` for every learner of the population (its one hook):
  (learner, optimizer state) stacked, each learner's policy memory (None: none), and each
  one's record fields."""
  members = population.members(learner)
  opts = ([None] * len(members) if opt_state is None
          else [population.unstack(opt_state, i) for i in range(len(members))])
  memos = [None] * len(members) if memo is None else list(memo)
  member_keys = population.member_keys(keys)
  started = [setup.stage_policy.start(setup.method, l, member_keys[i], contexts[i], opts[i],
                                      memos[i]) for i, l in enumerate(members)]
  learner = population.stack([s.learner for s in started], setup.steps.place)
  memo = (None if all(s.memo is None for s in started)
          else tuple(s.memo for s in started))
  fields = [dict(s.fields) for s in started]
  opts = [s.opt_state for s in started]
  if all(o is None for o in opts):
    return learner, None, memo, fields
  if any(o is None for o in opts):
    raise ValueError(f"stage policy {setup.stage_policy.name!r} kept the optimizer state of "
                     "some learners of the population and not of others")
  return learner, population.stack_trees(*opts), memo, fields


