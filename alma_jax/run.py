"""The stream loop (Algorithm 1): wait, replay, grow, train, evaluate, log.

A run is a population of S learners walking one stream loop: S = 1 is an
ordinary run; `config.num_seeds = S > 1` trains the seeds `seed`, ...,
`seed + S - 1` of one config together, stacked on a leading axis, each with
what a separate run of that seed would have (stream partition, training
subset, initialisation, data order, early stopping).

A run writes `config.json`, `log.jsonl` (one record per time step),
`architecture.jsonl`, `checkpoints/` (orbax, see `config.checkpoint`),
TensorBoard event files (`config.log.tensorboard`) and, at the end,
`summary.json` and `error.png` into its workdir; with S > 1 each seed's
`config.json`, `log.jsonl` and `summary.json` go to `seed_<seed>/` and the
top-level `summary.json` holds each metric's mean and standard deviation over
the seeds. Running the same command again resumes from the last complete
checkpoint; every random choice is seeded by (seed, t), so a resumed run
writes the same records and summary as an uninterrupted one (wall-clock
times aside). Checkpoints are written asynchronously (orbax) while the loop
goes on; the next checkpoint, the summary, an interruption and the end of
the run (before the workdir lock is released) first wait for the one being
written, so `io_s` holds only the part that did not overlap training.
Signals and the kill-point test hook: `alma_jax.interrupts`. Fields left to
be chosen (the convolution gradient, the ensemble strategy, the steps per
call) are decided by `alma_jax.autotune` before the loop starts.

In a multi-process run (`alma_jax.multihost`) every process walks the same
loop on a global mesh; process 0 alone writes config.json, the logs and the
summaries, and all processes write and restore the checkpoints together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from alma_jax import autotune
from alma_jax import checkpoint as ckpt_lib
from alma_jax import cpu_fusion
from alma_jax import interrupts
from alma_jax import io_utils
from alma_jax import methods
from alma_jax import multihost
from alma_jax import plots
from alma_jax import population
from alma_jax import schedule
from alma_jax import sharding
from alma_jax import stage_checkpoint
from alma_jax import tensorboard
from alma_jax import timing
from alma_jax import train
from alma_jax import validation
from alma_jax import workdir as wd
from alma_jax import workdir_lock
from alma_jax.data import stream as stream_lib
from alma_jax.interrupts import RunInterrupted, kill_point
from alma_jax.metrics import Log, Record
from alma_jax import optim
from alma_jax.steps import Steps
from alma_jax import tasks

__all__ = ["run", "RunInterrupted"]
VGG_SEEDS_WARNING = ("config.num_seeds=%d with config.model.name=%r on CPU: vmapped convolutions "
                     "run as grouped convolutions, many times slower than separate runs "
                     "(benchmarks/ensemble_strategy.py); separate runs are faster here")


def _stage_sizes(stream, config) -> list[int]:
  s = config.stream
  sizes = []
  for t in schedule.training_times(stream.num_megabatches, s.wait):
    new = sum(len(stream.train[i - 1]) for i in range(t - s.wait + 1, t + 1))
    past = sum(len(stream.train[i - 1]) for i in range(1, t - s.wait + 1))
    sizes.append(new + int(round(s.replay * past)))
  return sizes


def _should_checkpoint(config, t: int, trained: bool, last: int) -> bool:
  return t in (0, last) or (trained and (t // config.stream.wait) % config.checkpoint.every == 0)


def run(config, workdir: str, *, overwrite: bool = False,
        startup_s: float | None = None) -> dict[str, Any]:
  """Runs (or resumes) one ALMA stream; writes config.json, log.jsonl, summary.json.

  Args:
    config: the experiment config.
    workdir: output directory; a run found there is resumed when its config
      is the same (a different config is an error unless `overwrite`).
    overwrite: discard the outputs of a previous run in `workdir` first.
    startup_s: seconds the process spent before this call (interpreter and
      imports), reported in the summary's timing breakdown.

  Returns:
    The summary (with S > 1: the mean and standard deviation over the seeds).

  Raises:
    ValueError: invalid config, data, workdir or checkpoints (nothing is
      written then), or another run holds `workdir`.
    DivergenceError: non-finite training loss (the checkpoints stay intact).
    RunInterrupted: SIGINT, SIGTERM or SIGHUP.
  """
  config = validation.validate(config)
  wd.check_writable(workdir)
  with workdir_lock.hold(workdir, primary=multihost.is_primary()):
    if not overwrite:
      wd.check_resume(workdir, config)
    wd.check_outputs(workdir, config, overwrite)
    multihost.sync("alma_jax: workdir checked")  # before process 0 writes to it
    with interrupts.Signals() as signals:
      loop = _Loop(config, workdir, signals, startup_s)
      try:
        return loop.run(overwrite)
      finally:
        loop.close()


class _Loop:
  """One run's stream loop; each method is one step of Algorithm 1."""

  def __init__(self, config, workdir: str, signals: interrupts.Signals, startup_s):
    self.config, self.workdir, self.signals, self.startup_s = config, workdir, signals, startup_s
    self.primary = multihost.is_primary()  # writes the outputs (checkpoints: every process)
    self.t_start, self.timer = time.monotonic(), timing.Breakdown()
    self.seeds = [int(config.seed) + i for i in range(int(config.num_seeds))]
    self.out_dirs = ([workdir] if len(self.seeds) == 1
                     else [wd.seed_dir(workdir, sd) for sd in self.seeds])
    self.ckpt = None
    self.stage_store: stage_checkpoint.Store | None = None
    self.arch_lines: list[dict] = []  # architecture.jsonl's lines (kept in the checkpoints too)
    self._pending_save: int | None = None  # the step whose checkpoint is being written
    self.tb: list[tensorboard.Writer] = []  # process 0, config.log.tensorboard: one per seed
    self.elapsed_before, self.compiled_before = 0.0, set()
    self._flop_cache: dict = {}
    with self.timer("data_s"):
      self._setup()

  # -- data, streams, method, compiled steps --------------------------------------------------
  def _setup(self) -> None:
    c, s = self.config, self.config.stream
    self.mesh = sharding.mesh_from_config(c)
    self.task = task = tasks.for_config(c)
    ds, self.subsets = task.load(c, self.seeds)
    n_train = len(ds.train_y) if self.subsets[0] is None else len(self.subsets[0])
    self.streams = [stream_lib.make_stream(n_train, s.num_megabatches, s.val_fraction, sd)
                    for sd in self.seeds]
    validation.validate_data(c, n_train, self.streams[0])
    shape, data = ds.train_x.shape[1:], task.device_data(ds)
    self.inputs = _fingerprint(data)

    built: dict[tuple, Steps] = {}  # a measured candidate's programs serve the run

    def build(cfg) -> Steps:  # the compiled steps of the method `cfg` makes
      key = autotune.signature(cfg)
      if key not in built:
        built[key] = Steps.from_config(cfg, methods.make(cfg, shape, ds.num_classes), task,
                                       optim.from_config(cfg), data, self.mesh)
      return built[key]

    mine = os.path.join(self.workdir, autotune.FILE)
    self.choices = autotune.choose(c, shape, build, mode=c.train.autotune, workdir_file=mine,
                                   given=cpu_fusion.measured_with_flags())
    fusion = cpu_fusion.decision(c, shape)  # made by alma_jax.main before JAX started
    if fusion is not None:
      if jax.process_count() == 1:
        autotune.remember(mine, *fusion)
      self.choices[cpu_fusion.FIELD] = fusion[1]
    self.steps = build(autotune.with_choices(c, self.choices))
    self.method = self.steps.method
    self.keys = population.keys(self.seeds)
    self.num_t = s.num_megabatches
    logging.info("data %s: %d train / %d test examples, B=%d mega-batches of ~%d, wait=%d, "
                 "replay=%.2f, seeds %s; mesh %s", c.data.name, n_train, len(ds.test_y),
                 self.num_t, len(self.streams[0].train[0]) + len(self.streams[0].val[0]), s.wait,
                 s.replay, self.seeds, dict(self.mesh.shape))
    if (len(self.seeds) > 1 and jax.default_backend() == "cpu"
        and c.model.name in ("vgg",)):
      logging.warning(VGG_SEEDS_WARNING, len(self.seeds), c.model.name)

  def _to_train_split(self, i: int, idx: np.ndarray) -> np.ndarray:
    sub = self.subsets[i]
    return idx if sub is None else sub[idx].astype(np.int32)

  def close(self) -> None:
    """Waits for a checkpoint still being written (before the workdir lock is released),
    then closes the checkpointer."""
    if self.ckpt is not None:
      try:
        if self._pending_save is not None:
          self._finish_save(critical=False)
      finally:
        self.ckpt.close()
    if self.stage_store is not None:
      self.stage_store.close()

  def elapsed(self) -> float:
    return self.elapsed_before + time.monotonic() - self.t_start

  # -- outputs: start afresh or resume ---------------------------------------------------------
  def _target_builder(self):
    """(structure, has_opt_state) -> the abstract stacked checkpoint state, with the shardings
    of the steps (the key replicated)."""
    method, tx, keys, steps = self.method, self.steps.tx, self.keys, self.steps

    def build(structure, has_opt_state):
      learner = jax.eval_shape(jax.vmap(lambda k: method.init(k, structure)), keys)
      if learner.structure != structure:
        raise ckpt_lib.IncompatibleCheckpointError(
            f"method {method.name!r} rebuilds structure {learner.structure!r} from the "
            f"checkpoint's structure {structure!r}")
      tree = {"params": learner.params, "model_state": learner.model_state,
              "key": jax.eval_shape(jax.vmap(jax.random.key_data), keys)}
      if has_opt_state:
        tree["opt_state"] = jax.eval_shape(
            jax.vmap(lambda k: tx.init(method.partition(method.init(k, structure))[0])), keys)
      shardings = {k: steps.replicated(v) if k == "key" else steps.shardings(v, name=k)
                   for k, v in tree.items()}
      return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          tree, shardings)

    return build

  def _check_saved_config(self, extra: dict) -> None:
    current = wd.config_dict(self.config)
    diffs = wd.config_diff(extra.get("config", current), current)
    if diffs:
      raise ckpt_lib.IncompatibleCheckpointError(
          f"the checkpoints were written by a different config: {'; '.join(diffs)}; pass "
          "--overwrite to discard them")
    if extra.get("inputs", self.inputs) != self.inputs:
      d = self.config.data
      what = f"config.data.text_file={d.text_file!r}" if d.get("text_file") else (
          f"the data set {d.name!r}")
      raise ckpt_lib.IncompatibleCheckpointError(
          f"the checkpoints were written from other input data than {what} holds now "
          f"(fingerprint {extra['inputs'][:12]} then, {self.inputs[:12]} now); restore the "
          "original inputs to resume, or pass --overwrite to discard the checkpoints")

  def _restore(self):
    """The latest readable checkpoint (None: start afresh) and each seed's records in it."""
    c = self.config
    if not c.checkpoint.enabled:
      return None, [[] for _ in self.seeds]
    self.stage_store = stage_checkpoint.Store(
        os.path.join(self.workdir, wd.STAGE_DIR), every_s=c.checkpoint.every_s,
        every_epochs=c.checkpoint.stage_every_epochs,
        identity={"config": wd.config_dict(c), "inputs": self.inputs},
        stopping=lambda: self.signals.pending is not None,
        facts=lambda: {"compiled": sorted(self._compiled_names())},
        quarantine_dir=os.path.join(self.workdir, wd.CORRUPT_DIR))
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(self.workdir, wd.CHECKPOINT_DIR),
                                      c.checkpoint.max_to_keep)
    snap = self.ckpt.restore_latest(self._target_builder(),
                                    quarantine_dir=os.path.join(self.workdir, wd.CORRUPT_DIR),
                                    check_extra=self._check_saved_config)
    if snap is None:
      return None, [[] for _ in self.seeds]
    if len(snap.records) != snap.t + 1:
      raise ckpt_lib.CheckpointError(f"checkpoint step {snap.t} holds {len(snap.records)} time "
                                     f"steps; expected {snap.t + 1}")
    return snap, [[Record.from_dict(r["seeds"][i]) for r in snap.records]
                  for i in range(len(self.seeds))]

  def _open_outputs(self, overwrite: bool):
    """Restores (or starts) the run and rewrites its outputs to match; returns the snapshot."""
    with self.signals.critical():
      if overwrite and self.primary:
        wd.clear_outputs(self.workdir)
      multihost.sync("alma_jax: outputs cleared")
      snap, records = self._restore()
      if self.primary:
        self._rewrite_outputs(snap, records)
      last_t = len(records[0]) - 1
      saved = None if snap is None else snap.extra.get("architecture")
      if saved is not None:
        self.arch_lines = [a for a in saved if a["t"] <= last_t]
      elif self.primary:
        self.arch_lines = io_utils.read_jsonl(os.path.join(self.workdir, wd.ARCH_FILE))
    self.logs = [Log.from_records(r) for r in records]
    return snap

  def _rewrite_outputs(self, snap, records) -> None:
    """config.json, the logs up to the restored step, no summary unless the run is over."""
    io_utils.write_json_atomic(os.path.join(self.workdir, wd.CONFIG_FILE),
                               wd.config_dict(self.config))
    for out, sd, recs in zip(self.out_dirs, self.seeds, records):
      os.makedirs(out, exist_ok=True)
      if out != self.workdir:
        io_utils.write_json_atomic(os.path.join(out, wd.CONFIG_FILE),
                                   wd.config_dict(_seed_config(self.config, sd)))
      io_utils.write_jsonl_atomic(os.path.join(out, wd.LOG_FILE), [r.to_dict() for r in recs])
    if self.config.log.tensorboard:
      self.tb = [tensorboard.Writer(out, [r.to_dict() for r in recs])
                 for out, recs in zip(self.out_dirs, records)]
    wd.sync_architecture_log(self.workdir, len(records[0]) - 1,
                             None if snap is None else snap.extra.get("architecture"))
    if snap is None or snap.t < self.num_t:
      for path in {self.workdir, *self.out_dirs}:
        if os.path.exists(os.path.join(path, wd.SUMMARY_FILE)):
          os.unlink(os.path.join(path, wd.SUMMARY_FILE))

  def _start(self, snap):
    """(learner, optimizer state, last test errors) to continue from."""
    if snap is None:
      learner = self.steps.place(population.stack([self.method.init(jax.random.fold_in(k, 0))
                                                   for k in self.keys]))
      if jax.default_backend() == "cpu":
        with self.timer("train_s"):  # compiles the train step the first stage will use
          self._log_estimate(learner)
      return learner, None, None
    self.compiled_before = set(snap.extra.get("compiled", []))
    self.elapsed_before = float(snap.extra.get("elapsed_s", 0.0))
    self.timer.add(snap.extra.get("timings", {}))
    self.signals.last_checkpoint = snap.t
    logging.info("resuming %s after t=%d/%d (its last complete checkpoint)", self.workdir, snap.t,
                 self.num_t)
    opt_state = snap.opt_state if self.config.train.keep_optimizer_state else None
    return snap.learner, opt_state, np.asarray([log.records[-1].test_error for log in self.logs])

  def _log_estimate(self, learner) -> None:
    """Logs an upper bound on the training time (all epochs, no early stop)."""
    b, fixed = self.config.train.batch_size, optim.stage_steps(self.config)
    sizes = _stage_sizes(self.streams[0], self.config)
    total = (len(sizes) * fixed if fixed
             else sum(-(-m // b) for m in sizes) * self.config.train.epochs)
    if total < 5000:  # a short run: measuring would cost a noticeable part of it
      return
    per_step = self.steps.seconds_per_step(learner)
    est = per_step * total
    logging.info("estimated training time: at most %.0f s (%.1f h) for %d steps at %.4f s/step "
                 "(growing models get slower; early stopping shortens it)", est, est / 3600,
                 total, per_step)

  # -- the stream ---------------------------------------------------------------------------------
  def run(self, overwrite: bool) -> dict[str, Any]:
    snap = self._open_outputs(overwrite)
    try:
      with self.signals.deferred():  # a signal stops the loop at the next step boundary
        return self._stream(snap)
    except RunInterrupted as e:
      # The checkpoint being written completes first, so the message names it.
      if self._pending_save is not None:
        self._finish_save(critical=False)
        raise RunInterrupted(e.signum, self.signals.last_checkpoint) from None
      raise

  def _stream(self, snap) -> dict[str, Any]:
    learner, opt_state, errors = self._start(snap)
    # Each member's mean test NLL (the task's record fields are computed from it).
    nll = None if errors is None else np.asarray(
        [log.records[-1].extra.get("test_nll", np.nan) for log in self.logs])
    for t in range(len(self.logs[0].records), self.num_t + 1):
      self.signals.check()
      t_step = time.monotonic()
      trained = t > 0 and schedule.is_training_time(t, self.config.stream.wait)
      spent, stats = {}, None
      if trained:
        learner, opt_state, stats, spent = self._stage(t, learner, opt_state)
      if errors is None or trained:  # an unchanged model is not re-evaluated
        with self.timer("eval_s"):
          acc, nll = self.steps.evaluate(learner, "test",
                                         np.arange(self.steps.data.size("test"), dtype=np.int32))
          errors = 1.0 - acc
      self._record(t, learner, errors, nll, spent, trained, time.monotonic() - t_step)
      self._save(t, learner, opt_state, trained)
      if trained:
        self._report(t, stats, errors, learner)
    return self._summarise()

  def _contexts(self, t: int) -> list[methods.StageContext]:
    s = self.config.stream
    stage = t // s.wait
    out = []
    for i, sd in enumerate(self.seeds):
      data = schedule.stage_data(self.streams[i], t, s.wait, s.replay, sd)
      out.append(methods.StageContext(
          t=t, stage=stage, is_first=stage == 1, train_idx=self._to_train_split(i, data.train),
          val_idx=self._to_train_split(i, data.val), reduce=self.steps.reduce,
          scan=self.steps.scan, eval_aux=self.steps.eval_aux))
    return out

  def _each(self, fn, learner, keys, contexts):
    """Applies `fn(learner_i, key_i, ctx_i)` to every member and restacks the population."""
    return population.stack([fn(l, keys[i], contexts[i])
                             for i, l in enumerate(population.members(learner))])

  def _stage(self, t: int, learner, opt_state):
    """Growth, one training stage and growth after it.

    Returns (learner, opt_state, stats, the compute spent per member: Record fields).
    """
    c, method = self.config, self.method
    contexts = self._contexts(t)
    passes_before = self.steps.pass_flops
    skeys = population.fold(self.keys, t)
    if c.stream.init_from_scratch:
      learner = self._each(lambda l, k, _: method.reinit(l, k), learner,
                           population.fold(skeys, 1), contexts)
      opt_state = None
    learner = self._each(method.before_stage, learner, population.fold(skeys, 2), contexts)
    if not c.train.keep_optimizer_state:
      opt_state = None
    kill_point("stage", t)
    self.signals.check()

    def progress(msg):
      logging.info(msg)
      kill_point("epoch", t)

    store = None if self.stage_store is None else self.stage_store.begin(t, learner.structure)
    try:
      learner, opt_state, stats = train.fit_stage(
          self.steps, learner, np.stack([x.train_idx for x in contexts]),
          np.stack([x.val_idx for x in contexts]), population.fold(skeys, 3), t=t,
          opt_state=opt_state, progress=progress, labels=self.seeds, check=self.signals.check,
          on_epoch=lambda *a: self._epoch_scalars(t, *a), checkpoints=store)
      if store is not None:  # what the part of the stage before its save compiled
        self.compiled_before |= set(store.restored_facts.get("compiled", []))
    except RunInterrupted:
      if store is not None and store.saved is not None and store.saved[0] == t:
        logging.warning("stage t=%d was saved at epoch %d, call %d: the same command continues "
                        "it there", *store.saved)
      raise
    if stats.diverged.any():
      logging.warning("stage t=%d diverged; continuing with its best epoch (%s)", t,
                      ", ".join(str(e) for e in stats.best_epoch))
    self.timer.add({"train_s": stats.train_s, "eval_s": stats.eval_s})
    flops = self._flops(population.unstack(learner, 0))  # of the structure that trained
    examples = stats.examples_run
    spent = {"train_flops": flops["train_step"] * stats.steps_run,
             "train_flops_forward": flops["train_step_forward"] * stats.steps_run,
             "train_macs": flops["train_macs_per_example"] * examples}
    learner = self.steps.place(self._each(method.after_stage, learner, population.fold(skeys, 4),
                                          contexts))
    spent["growth_flops"] = np.full(len(self.seeds), (self.steps.pass_flops - passes_before)
                                    / len(self.seeds))
    return learner, opt_state, stats, spent

  def _epoch_scalars(self, t, epoch, loss, val_accuracy, ran) -> None:
    del epoch  # the event files count epochs over the whole run
    with self.timer("io_s"), self.signals.critical():
      for i, writer in enumerate(self.tb):
        if ran[i]:
          writer.epoch(t, {"train_loss": loss[i], "val_accuracy": val_accuracy[i]})

  # -- evaluate, log, checkpoint --------------------------------------------------------------------
  def _record(self, t, learner, errors, nll, spent, trained, wall_s) -> None:
    first = population.unstack(learner, 0)
    flops = self._flops(first)
    num_params = self.method.num_params(first)
    fields = ("train_flops", "train_flops_forward", "train_macs", "growth_flops")
    extra = getattr(self.task, "record_metrics", None)  # fields of the task's own
    records = [Record(t=t, test_error=float(errors[i]), num_params=num_params,
                      **{f: float(spent[f][i]) if f in spent else 0.0 for f in fields},
                      inference_flops_per_example=flops["inference_per_example"],
                      trained=trained, wall_s=wall_s,
                      extra={} if extra is None else extra(float(nll[i]), flops))
               for i in range(len(self.seeds))]
    self.logs = [log.append(r) for log, r in zip(self.logs, records)]
    with self.timer("io_s"), self.signals.critical():
      for out, r in zip(self.out_dirs if self.primary else (), records):
        io_utils.append_record(os.path.join(out, wd.LOG_FILE), r.to_dict())
      for writer, r in zip(self.tb, records):
        writer.step(r.to_dict())
      if trained:
        self.arch_lines.append({"t": t, **self.method.describe(first)})
        if self.primary:
          io_utils.append_jsonl(os.path.join(self.workdir, wd.ARCH_FILE), self.arch_lines[-1])
      kill_point("log", t)

  def _flops(self, learner) -> dict[str, float]:
    if learner.structure not in self._flop_cache:
      self._flop_cache[learner.structure] = self.steps.flops(learner)
    return self._flop_cache[learner.structure]

  def _compiled_names(self) -> set[str]:
    return self.compiled_before | {json.dumps(ckpt_lib.structure_to_json(k))
                                   for k in self.steps.compiled}

  def _save(self, t: int, learner, opt_state, trained: bool) -> None:
    if self.ckpt is None or not _should_checkpoint(self.config, t, trained, self.num_t):
      return
    with self.timer("io_s"), self.signals.critical():
      self._finish_save(critical=False)  # the previous checkpoint (mostly written by now)
      extra = {"compiled": sorted(self._compiled_names()), "elapsed_s": self.elapsed(),
               "timings": self.timer.as_dict(), "config": wd.config_dict(self.config),
               "inputs": self.inputs, "architecture": self.arch_lines}
      # The optimizer state is part of the state only when stages share it.
      kept = opt_state if self.config.train.keep_optimizer_state else None
      records = [{"t": j, "seeds": [log.records[j].to_dict() for log in self.logs]}
                 for j in range(t + 1)]
      self.ckpt.start_save(t, learner, kept,
                           jax.random.key_data(population.fold(self.keys, t)), records, extra)
      self._pending_save = t
      kill_point("checkpoint", t)
      if self.signals.pending is not None:  # stopping: finish this checkpoint first
        self._finish_save(critical=False)

  def _finish_save(self, critical: bool = True) -> None:
    """Waits until the checkpoint being written (asynchronously, by orbax, while the loop
    goes on) is complete; the run's last checkpoint is then that one."""
    if self._pending_save is None:
      return
    t, self._pending_save = self._pending_save, None
    with self.timer("io_s"), (self.signals.critical() if critical else contextlib.nullcontext()):
      self.ckpt.wait()
      self.signals.last_checkpoint = t
      if self.stage_store is not None:
        self.stage_store.discard_through(t)
      kill_point("saved", t)

  def _report(self, t: int, stats, errors, learner) -> None:
    arch = json.dumps(self.method.describe(population.unstack(learner, 0)))
    task_fields = self.task.progress([log.records[-1] for log in self.logs])
    if task_fields:
      arch = f"{task_fields} {arch}"
    if len(self.seeds) == 1:
      logging.info("t=%d/%d epochs=%d best_val_acc=%.4f test_error=%.4f %s elapsed=%.1fs", t,
                   self.num_t, stats.epochs_run[0], stats.best_val_accuracy[0], errors[0], arch,
                   self.elapsed())
    else:
      logging.info("t=%d/%d seeds=%d epochs=%s test_error=%.4f±%.4f %s elapsed=%.1fs", t,
                   self.num_t, len(self.seeds), stats.epochs_run.tolist(), float(np.mean(errors)),
                   float(np.std(errors)), arch, self.elapsed())

  # -- summary -----------------------------------------------------------------------------------
  def _summarise(self) -> dict[str, Any]:
    self._finish_save()  # the last checkpoint is complete before the summary exists
    wall_s = self.elapsed()
    per_seed = [dict(log.summary(), **self.task.summary(log.records), wall_s=wall_s)
                for log in self.logs]
    extra = {"timings": self.timer.report(wall_s, self.startup_s),
             "num_compilations": len(self._compiled_names()), "choices": self.choices}
    if len(self.seeds) == 1:
      top = dict(per_seed[0], **extra)
    else:
      top = dict(population.mean_summary(per_seed), seeds=self.seeds, num_seeds=len(self.seeds),
                 per_seed=per_seed, wall_s=wall_s, **extra)
      top.pop("wall_s_std")
    kill_point("summary")
    self.signals.check()
    with self.signals.critical():
      if self.primary:
        if len(self.seeds) > 1:
          for out, summary in zip(self.out_dirs, per_seed):
            io_utils.write_json_atomic(os.path.join(out, wd.SUMMARY_FILE), summary)
        io_utils.write_json_atomic(os.path.join(self.workdir, wd.SUMMARY_FILE), top)
    if self.primary:
      self._plot_errors()
    logging.info("done: %d seed(s), CER=%.4f mean_error=%.4f final_error=%.4f Mem=%d Comp=%.3e "
                 "wall=%.1fs", len(self.seeds), top["cer"], top["mean_error"], top["final_error"],
                 top["mem"], top["comp"], wall_s)
    task_line = self.task.summary_line(top)
    if task_line:
      logging.info(task_line)
    return top

  def _plot_errors(self) -> None:
    """error.png in the workdir (drawn by a child process); a failure only warns."""
    path = os.path.join(self.workdir, wd.ERROR_PNG)
    c = self.config
    why = plots.run_error_png_in_child(
        path, [(f"seed {sd}", [r.t for r in log.records], [r.test_error for r in log.records])
               for sd, log in zip(self.seeds, self.logs)],
        f"{c.data.name} {c.method.name} width={c.model.width} wait={c.stream.wait}")
    if why is not None:
      logging.warning("could not draw %s (%s); the run's other outputs are complete", path, why)


def _fingerprint(data) -> str:
  """SHA-256 of the arrays of the data a run trains and tests on (any change of an input
  file or data set that reaches the run changes it)."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(data):
    a = np.ascontiguousarray(np.asarray(leaf))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(a).cast("B"))
  return h.hexdigest()


def _seed_config(config, seed: int):
  """The config of a separate run of `seed` (what its seed directory records)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.seed = seed
    c.num_seeds = 1
  return c
