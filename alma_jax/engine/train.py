"""One training stage of a population: epochs, best-validation epoch, patience, divergence.

`fit_stage` trains S learners stacked on a leading axis (S = 1: an ordinary
run; S > 1: several seeds) on their own stage data. Each member keeps its own
data order, best epoch and early stopping: a member that stops early stops
counting steps (its best epoch is kept) while the others go on.

An epoch is written once (`alma_jax.engine.epoch`) and run in one of two ways:
driven from the host (a compiled call per chunk of steps, the evaluation
program over the validation batches, then the compiled rule
`epoch.end_epoch`), or with `whole` (`train.stage_program`, see
`alma_jax.tuning.autotune.stage_program_rule`) as one compiled program per segment of epochs
(`Programs.stage_call`: `epoch.epoch` in a `lax.while_loop`). Either way the
host then goes through each epoch's outputs once (`_after_epoch`: divergence
messages, the reported best accuracies, `on_epoch`, the progress line), so
both give the same results. A stage can be saved between two train calls and
continued from there (`alma_jax.engine.stage_save`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from alma_jax.engine import orders as orders_lib
from alma_jax.engine import population
from alma_jax.engine import timing
from alma_jax.engine.epoch import Rule, diverged, epoch_ok, warn_unimproved
from alma_jax.engine.meter import Meter, epoch_line
from alma_jax.engine.programs import Batch, step_counter
from alma_jax.engine.stage_save import Progress, Resume, Saver, StageCheckpoints, restore
from alma_jax.engine.steps import Steps
from alma_jax.state import Learner, StageStats, StopState, TrainState


@dataclasses.dataclass(frozen=True)
class StageData:
  """A stage's data: (S, n) training and (S, m) validation indices into the training split,
  (S,) PRNG keys (data order, augmentation), the time step (for messages), and the stacked
  parameters the loss's `train.l2_init` term pulls toward (None: the run's loss has none)."""

  train_idx: np.ndarray
  val_idx: np.ndarray
  keys: jax.Array
  t: int = 0
  anchor: Learner | None = None


@dataclasses.dataclass(frozen=True)
class StageHooks:
  """What a stage tells and asks the rest of the run.

  Attributes:
    labels: the members' names in messages (their seeds; default 0 .. S - 1).
    check: called after every compiled train call, every epoch and every call of the
      whole-stage program, each time after the stage was saved if a save was due; raising
      there stops the stage (`alma_jax.outputs.interrupts.Signals.check`).
    on_epoch: called after every epoch with (epoch, mean training loss (S,), validation
      accuracy (S,), which members trained in it (S,)); it must not raise for a signal.
    on_resumed: called with the epoch at which the stage continues from its save (its
      earlier epochs were told to `on_epoch` before the run stopped), before it trains.
    checkpoints: saves the stage between train calls when it says so, and continues the
      stage from its last save, if it has one.
    meter: told where the stage is after every train call and epoch
      (`alma_jax.engine.meter.Meter`); the epoch's progress line goes through it.
  """

  labels: Sequence[int] | None = None
  check: Callable[[], None] = lambda: None
  on_epoch: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None] | None = None
  on_resumed: Callable[[int], None] | None = None
  checkpoints: StageCheckpoints | None = None
  meter: Meter | None = None


@dataclasses.dataclass(frozen=True)
class _Stage:
  """What stays fixed while a stage trains."""

  steps: Steps
  learner: Learner  # the learners before the stage (the base of `Method.combine`)
  data: StageData
  hooks: StageHooks
  rule: Rule
  rngs: list
  timer: timing.Breakdown
  save: Saver | None
  labels: list

  def calls(self) -> dict:
    """The arguments of `orders_lib.draw` after the generators and indices."""
    s = self.steps
    return {"num_orders": s.method.num_data_orders(self.learner.structure),
            "batch": s.batch_size, "steps_per_call": s.steps_per_call,
            "fixed_steps": s.stage.steps_per_epoch}


def fit_stage(steps: Steps, learner: Learner, data: StageData, opt_state=None,
              hooks: StageHooks = StageHooks(), whole: bool | None = None):
  """Trains a stacked population on one stage's data; keeps each member's best epoch.

  `learner` (S, ...) is not modified; `opt_state` is a stacked optimizer state to continue
  from (None: fresh). With `whole` (None: `train.stage_program` is "whole") the epochs run
  as one compiled program (`_fit_whole`) rather than a train call per chunk of steps and an
  evaluation per epoch, with the same results; a stage saved in the middle of an epoch
  continues per call.

  Returns:
    (best learners, final optimizer state (None after a rollback), StageStats).
  """
  o, n, m = steps.stage, data.train_idx.shape[-1], data.val_idx.shape[-1]
  whole = o.stage_program == "whole" if whole is None else whole
  num = int(data.keys.shape[0])
  if n < 1 or m < 1:
    raise ValueError(f"stage t={data.t} has {n} training and {m} validation examples; both "
                     "must be >= 1")
  units = steps.method.num_units(learner.structure)
  rule = Rule(o.patience, float(o.patience_delta), m, type(steps.task).right_or_wrong(),
              o.on_divergence != "rollback")
  if whole and not rule.exact:  # the program decides on exact counts (`epoch.Rule`)
    raise ValueError(f"a whole-stage program needs a task whose examples are right or wrong; "
                     f"task {type(steps.task).__name__} trains per epoch")
  state = steps.init_state(learner, opt_state, data.anchor)
  # Placed once: every call of the stage takes them as they are (`sharding.put_args`).
  data = dataclasses.replace(data, keys=steps.place_replicated(data.keys))
  rngs = population.numpy_rngs(data.keys)
  p = Progress(StopState.start(num, units), learner, np.full((num, units), -1.0))
  timer, resume = timing.Breakdown(), None
  if hooks.checkpoints is not None:
    state, p, resume = restore(hooks.checkpoints, state, p, rngs, timer)
    if resume is not None and hooks.on_resumed is not None:
      hooks.on_resumed(resume.epoch)
  save = None if hooks.checkpoints is None else Saver(hooks.checkpoints, rngs, timer)
  labels = list(hooks.labels) if hooks.labels is not None else list(range(num))
  s = _Stage(steps, learner, data, hooks, rule, rngs, timer, save, labels)
  if hooks.meter is not None:
    hooks.meter.stage_start(data.t, o.epochs, o.steps_per_epoch or -(-n // steps.batch_size))
  if whole and (resume is None or resume.next_call == 0):
    state, p = _fit_whole(s, state, p, resume.epoch if resume else 1)
  else:
    state, p = _fit_per_epoch(s, state, p, resume)
  warn_unimproved(s.rule, data.t, labels, p.stop)
  if save is not None:  # a signal asks the run to stop: the finished stage is kept
    save.stage_end(p, state, o.epochs)
  hooks.check()
  return _finish(s, p, state)


def _train_epoch(s: _Stage, state: TrainState, p: Progress, epoch: int, resume: Resume | None):
  """The train calls of one epoch; returns (state, losses (S, steps), finite (S,), steps).

  `check()` runs after every compiled call, after the stage was saved there if due. With a
  full meter, each call is waited for once the next one is dispatched, and the meter is told
  of it then (it may say a running line). `resume` continues an epoch saved part-way.
  """
  steps, meter, k = s.steps, s.hooks.meter, s.steps.steps_per_call
  idx, mask, n_steps = orders_lib.draw(s.rngs, s.data.train_idx, **s.calls())
  losses, finite = (list(resume.losses), resume.finite) if resume else ([], None)
  calls = idx.shape[1] // k
  pending = None  # (steps done in the epoch, steps) of the call in flight, for the meter
  first = resume.next_call if resume else 0
  for c in range(first, calls):
    sl = slice(c * k, (c + 1) * k)
    batch = Batch(idx[:, sl], mask[:, sl])  # host arrays: the program places them
    state, loss, finite = steps.train_call(s.learner.structure, state, batch, s.data.keys,
                                           step_counter(epoch, c * k))
    losses.append(loss)
    if meter is not None and meter.full:
      if pending is not None:  # the previous call: the count of steps done is exact
        jax.block_until_ready(losses[-2])
        meter.trained(epoch, *pending)
      done = min((c + 1) * k, n_steps)
      pending = (done, done - min(c * k, n_steps))
    if s.save is not None:
      s.save.after_call(p, state, c + 1, losses, finite, c + 1 == calls)
    s.hooks.check()
  losses = np.concatenate([np.asarray(l) for l in losses], axis=1)[:, :n_steps]
  if pending is not None:
    meter.trained(epoch, *pending, last=True)
  elif meter is not None and calls > first:  # the epoch's steps, done (the losses are here)
    meter.trained(epoch, n_steps, n_steps - min(first * k, n_steps), last=True)
  return state, losses, np.asarray(finite), n_steps


def _fit_per_epoch(s: _Stage, state: TrainState, p: Progress, resume: Resume | None):
  """The epochs driven from the host; returns (final train state, progress)."""
  steps, structure, epochs = s.steps, s.learner.structure, s.steps.stage.epochs
  thresholds, m = s.rule.thresholds(), s.data.val_idx.shape[-1]
  for epoch in range(resume.epoch if resume else 1, epochs + 1):
    ran = p.stop.active.copy()
    if s.save is not None:
      s.save.epoch_start(epoch)
    with s.timer("train_s"):
      state, losses, finite, n_steps = _train_epoch(s, state, p, epoch, resume)
      resume = None
    current = Learner(params=steps.programs.combine(s.learner, state.trainable),
                      model_state=state.model_state, structure=structure)
    with s.timer("eval_s"):
      acc, _, unit_acc = steps.evaluate_units(current, "train", s.data.val_idx)
    stop, best, facts = steps.programs.end_epoch_call(
        s.rule, p.stop, p.best, current, epoch_ok(losses, finite), unit_acc * m, epoch, n_steps,
        thresholds)
    out = dict(jax.device_get(facts), losses=losses, stop=stop.to_host())
    p, go_on = _after_epoch(s, p, Progress(out["stop"], best, p.best_acc), epoch, out, ran,
                            np.asarray(acc), unit_acc, state)
    if not go_on:
      break
  return state, p


def _fit_whole(s: _Stage, state: TrainState, p: Progress, first: int):
  """The epochs from `first` on as one compiled program per segment (`orders.Pace` says how many
  epochs a call runs; at most `every_epochs` of them when the stage is saved after every so
  many); between segments the stage is saved when due and `check()` runs. Returns (final
  train state, progress)."""
  steps, epochs, m = s.steps, s.steps.stage.epochs, s.data.val_idx.shape[-1]
  every = s.save.every_epochs if s.save is not None else 0
  slots = min(every, epochs) if every > 0 else epochs
  thresholds = s.rule.thresholds()
  idx = steps.task.global_index(steps.data, "train", s.data.val_idx)
  val, num_val = orders_lib.validation(list(steps.passes.eval_batches(idx)))
  pace = orders_lib.Pace(steps, s.data.train_idx.shape[-1])
  while first <= epochs and p.stop.active.any():
    end = min(first + pace.epochs(slots, s.save), epochs + 1)
    began = time.monotonic()
    with s.timer("train_s"):  # training and the validation inside it
      orders, calls, n_steps = orders_lib.segment(s.rngs, s.data.train_idx, **s.calls(),
                                                  epochs=end - first, slots=slots)
      state, best, _, outs, stop_at = steps.programs.stage_call(
          s.rule, state, s.learner, p.best, p.stop, orders, val, s.data.keys, first, end, calls,
          n_steps, num_val, thresholds)
      outs, stop_at = jax.device_get(outs), int(stop_at)
    pace.ran(stop_at - first, time.monotonic() - began)
    if s.hooks.meter is not None and stop_at > first:  # the segment's steps, in one measurement
      s.hooks.meter.trained(stop_at - 1, n_steps, n_steps * (stop_at - first), last=True)
    for epoch in range(first, stop_at):
      out = jax.tree.map(lambda a, j=epoch - first: np.asarray(a[j]), outs)
      out["losses"] = out["losses"][:, :n_steps]
      ran = p.stop.active.copy()
      p, go_on = _after_epoch(s, p, Progress(out["stop"], best, p.best_acc), epoch, out, ran,
                              out["correct"].astype(np.float64) / m,
                              out["units"].astype(np.float64) / m, None)
      if not go_on:
        break
    first = stop_at
    if first <= epochs and p.stop.active.any():  # a segment ended with the stage going on
      if s.save is not None:
        s.save.between_epochs(p, state, first - 1, segment=True)
      s.hooks.check()
  return state, p


def _after_epoch(s: _Stage, before: Progress, after: Progress, epoch: int, out: dict,
                 ran: np.ndarray, acc: np.ndarray, unit_acc: np.ndarray,
                 state: TrainState | None):
  """The host's part of an epoch, the same for both paths: divergence (raise, or a warning
  and the stage ends when no member is left), the best accuracies as reported, a save when
  one is due between epochs (driven per epoch, `state` given: e.g. a signal during the
  evaluation), `on_epoch` and the progress line. Returns (progress, whether the stage goes
  on)."""
  if out["bad"].any() and diverged(s.rule, s.data.t, epoch, s.labels, out["bad"], ran,
                                   before.stop.best_epoch):
    return after, False
  p = dataclasses.replace(after, best_acc=np.where(out["improved"], unit_acc, before.best_acc))
  saved = (s.save is not None and state is not None and p.stop.active.any()
           and epoch < s.steps.stage.epochs and s.save.between_epochs(p, state, epoch))
  if s.hooks.on_epoch is not None:
    s.hooks.on_epoch(epoch, np.mean(out["losses"], axis=1), acc, ran)
  if s.hooks.meter is not None:
    s.hooks.meter.epoch_end(lambda: epoch_line(s.data.t, epoch, s.steps.stage.epochs,
                                               out["losses"], acc, p.best_acc, p.stop))
  if saved:
    s.hooks.check()  # the stage is saved: a signal that asked for the save stops it here
  return p, bool(p.stop.active.any())


def _finish(s: _Stage, p: Progress, state: TrainState):
  """(best learners, final optimizer state (None after a rollback), StageStats) of a stage."""
  stop, steps = p.stop, s.steps
  best_acc = p.best_acc[:, 0]
  if steps.method.units_are_parts:  # the selected members together
    with s.timer("eval_s"):
      best_acc, _ = steps.evaluate(p.best, "train", s.data.val_idx)
  spent = s.timer.as_dict()
  ints = lambda a: np.asarray(a, np.int64)  # pylint: disable=unnecessary-lambda-assignment
  if steps.stage.steps_per_epoch:  # fixed steps: full batches
    examples = ints(stop.steps_run) * steps.batch_size
  else:  # passes over each member's stage data
    examples = s.data.train_idx.shape[-1] * ints(stop.epochs_run)
  stats = StageStats(ints(stop.epochs_run), ints(stop.best_epoch), np.maximum(best_acc, 0.0),
                     ints(stop.steps_run), np.asarray(stop.diverged, bool), spent["train_s"],
                     spent["eval_s"], examples)
  return p.best, (None if stop.diverged.any() else state.opt_state), stats


def fit_one(steps: Steps, learner: Learner, train_idx: np.ndarray, val_idx: np.ndarray,
            key: jax.Array, *, t: int = 0, **kwargs):
  """`fit_stage` for a single (unstacked) learner (`kwargs`: `opt_state`, `whole` and the
  fields of `StageHooks`); returns (best, opt_state, StageStats)."""
  opt_state, whole = kwargs.pop("opt_state", None), kwargs.pop("whole", False)
  data = StageData(np.asarray(train_idx)[None], np.asarray(val_idx)[None],
                   population.stack_keys([key]), t)
  best, opt_state, stats = fit_stage(steps, population.stack([learner]), data, opt_state,
                                     StageHooks(**kwargs), whole)
  if opt_state is not None:
    opt_state = population.unstack(opt_state, 0)
  return population.unstack(best, 0), opt_state, stats
