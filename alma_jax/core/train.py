"""One training stage of a population: epochs, best-validation epoch, patience, divergence.

`fit_stage` trains S learners stacked on a leading axis (S = 1: an ordinary
run; S > 1: several seeds) on their own stage data. Each member keeps its own
data order, best epoch and early stopping: a member that stops early stops
counting steps (its best epoch is kept) while the others go on. The data
stays on the device; a compiled call receives index arrays only (a partial
last batch is padded and masked, never recompiled).

A stage can be saved between two train calls and continued from there
(`StageCheckpoints`): its position is the epoch, the next call, each
member's data-order generator as it was before the epoch's orders were
drawn, the epoch's losses so far and the early-stopping state; with the
train state and the best parameters that is all it needs to continue to
exactly the result of an uninterrupted stage.

With `whole` (`train.stage_program`, see `whole_stage`) the epochs run as one
compiled program (`Programs.stage_call`: a `lax.while_loop` over epochs of
train calls, the validation evaluation and the best-epoch rule); the host
draws the epochs' data orders first, as the per-epoch loop would, and then
goes through the program's per-epoch losses and validation counts to give
the same messages, divergence handling and `on_epoch` calls, so both paths
give the same results. The best-epoch comparison is made on exact counts of
correct examples (`improvement_thresholds`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np
from absl import logging

from alma_jax import models
from alma_jax.configuration import fields as F
from alma_jax.core import population
from alma_jax.core import timing
from alma_jax.core.meter import Meter
from alma_jax.core.programs import Batch, TrainState, call_counter
from alma_jax.core.steps import Steps
from alma_jax.errors import ConfigError, divergence_error
from alma_jax.methods.base import Learner, Method
from alma_jax.tasks import base as tasks_base


@dataclasses.dataclass(frozen=True)
class StageStats:
  """Per-member facts of one stage (arrays of length S) and its time."""

  epochs_run: np.ndarray
  best_epoch: np.ndarray
  best_val_accuracy: np.ndarray
  steps_run: np.ndarray
  diverged: np.ndarray
  train_s: float
  eval_s: float
  examples_run: np.ndarray | None = None  # training examples processed (not padding)


def padded_orders(rng: np.random.Generator, idx: np.ndarray, num_orders: int, batch: int,
                  steps_per_call: int, num_steps: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
  """Per-order shuffles of `idx`, padded to whole calls: (calls*K, D, b) arrays and the step count.

  The padding slots hold real examples (the order repeated from its start)
  with mask False: the loss ignores them, while BatchNorm computes its batch
  statistics over the whole batch of real images. (Masked BatchNorm
  statistics are avoided on purpose: on XLA:CPU, jax 0.10.2, their jitted
  gradient inside `jax.vmap` is wrong, see tests/methods/test_ensemble.py.)
  """
  if num_steps:
    return fixed_orders(rng, idx, num_orders, batch, steps_per_call, num_steps)
  n = len(idx)
  steps = -(-n // batch)
  total_steps = -(-steps // steps_per_call) * steps_per_call
  out = np.zeros((num_orders, total_steps * batch), np.int32)
  mask = np.zeros((num_orders, total_steps * batch), bool)
  for d in range(num_orders):
    order = idx[rng.permutation(n)]
    out[d, :n] = order
    out[d, n:] = np.resize(order, total_steps * batch - n)
    mask[d, :n] = True
  shape = (num_orders, total_steps, batch)
  return (out.reshape(shape).transpose(1, 0, 2), mask.reshape(shape).transpose(1, 0, 2), steps)


def fixed_orders(rng: np.random.Generator, idx: np.ndarray, num_orders: int, batch: int,
                 steps_per_call: int, num_steps: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Exactly `num_steps` full batches per order, drawn from successive shuffles of `idx`
  (an epoch of a fixed number of steps); padded to whole calls with masked steps."""
  n, need = len(idx), num_steps * batch
  total_steps = -(-num_steps // steps_per_call) * steps_per_call
  out = np.zeros((num_orders, total_steps * batch), np.int32)
  mask = np.zeros((num_orders, total_steps * batch), bool)
  for d in range(num_orders):
    order = np.concatenate([idx[rng.permutation(n)] for _ in range(-(-need // n))])
    out[d, :need] = order[:need]
    mask[d, :need] = True
  shape = (num_orders, total_steps, batch)
  return (out.reshape(shape).transpose(1, 0, 2), mask.reshape(shape).transpose(1, 0, 2), num_steps)


def whole_stage(config, task, method) -> bool:
  """Whether `config.train.stage_program` runs a stage as one program (`_fit_whole`).

  `auto`: on a CPU, for a backbone that is not convolution-heavy and a method that does not
  grow, where a step is short and the calls from the host are a large part of a stage (an
  MLP: about twice as fast); convolution-heavy steps leave nothing to gain, and a growing
  model would compile the larger stage program once per structure. The program counts
  correct validation examples exactly, so it needs a task whose examples are right or
  wrong (not text).
  """
  choice = F.get(config.train, "train.stage_program")
  exact = type(task).per_example is tasks_base.Task.per_example
  if choice == "whole" and not exact:
    raise ConfigError(f"config.train.stage_program='whole' needs a task whose examples are "
                      f"right or wrong; for task {type(task).__name__} valid: "
                      "['per_epoch', 'auto']")
  if choice != "auto":
    return choice == "whole"
  grows = any(getattr(type(method), hook) is not getattr(Method, hook)
              for hook in ("before_stage", "after_stage"))
  return (exact and not grows and jax.default_backend() == "cpu"
          and not models.spec(config.model.name).conv_heavy)


@dataclasses.dataclass
class _Progress:
  """The running state of a stage's early stopping, per member (and selection unit)."""

  best: Learner
  best_acc: np.ndarray  # (S, U): each selection unit's best validation accuracy
  best_epoch: np.ndarray
  since_best: np.ndarray
  epochs_run: np.ndarray
  steps_run: np.ndarray
  active: np.ndarray
  diverged: np.ndarray


class StageCheckpoints(Protocol):
  """Saves a stage in progress and hands back the last save (`alma_jax.outputs.stage_checkpoint`)."""

  def load(self, template: dict) -> tuple[dict, dict] | None:
    """(arrays shaped like `template`, position) of the stage's last save, or None."""

  def due(self, epoch_end: bool, epoch: int) -> bool:
    """Whether to save now (after a train call; `epoch_end`: it ended epoch `epoch`)."""

  def save(self, arrays: dict, position: dict) -> None:
    """Writes the stage's arrays and position (complete on return)."""


@dataclasses.dataclass
class _Resume:
  """Where a saved stage continues: the epoch, its next call, its losses so far."""

  epoch: int
  next_call: int
  losses: list[np.ndarray]
  finite: np.ndarray | None


def _epoch(steps: Steps, state: TrainState, structure, rngs, train_idx, keys, epoch: int,
           check: Callable[[], None], resume: _Resume | None = None,
           save: Callable[[TrainState, int, list, Any, bool], None] | None = None,
           meter: Meter | None = None):
  """One epoch of every member; returns (state, losses (S, steps), finite (S,), steps).

  `check()` runs after every compiled call (it raises to stop the stage there);
  before it, `save(state, next call, losses so far, finite, epoch ended)`. With
  a full `meter`, each call is waited for once the next one is dispatched, and
  the meter is told of it then (it may say a running line). `resume` continues
  an epoch saved part-way.
  """
  d = steps.method.num_data_orders(structure)
  k = steps.steps_per_call
  fixed = int(F.get(steps.method.config.train, "train.steps_per_epoch"))
  orders = [padded_orders(rng, train_idx[i], d, steps.batch_size, k, fixed)
            for i, rng in enumerate(rngs)]
  idx, mask = np.stack([o[0] for o in orders]), np.stack([o[1] for o in orders])
  losses, finite = (list(resume.losses), resume.finite) if resume else ([], None)
  calls = idx.shape[1] // k
  pending = None  # (steps done in the epoch, steps) of the call in flight, for the meter
  first = resume.next_call if resume else 0
  for c in range(first, calls):
    sl = slice(c * k, (c + 1) * k)
    batch = Batch(steps.put_batch(idx[:, sl]), steps.put_batch(mask[:, sl]))
    state, loss, finite = steps.train_call(structure, state, batch, keys, call_counter(epoch, c))
    losses.append(loss)
    if meter is not None and meter.full:
      if pending is not None:  # the previous call: the count of steps done is exact
        jax.block_until_ready(losses[-2])
        meter.trained(epoch, *pending)
      done = min((c + 1) * k, orders[0][2])
      pending = (done, done - min(c * k, orders[0][2]))
    if save is not None:
      save(state, c + 1, losses, finite, c + 1 == calls)
    check()
  n_steps = orders[0][2]
  losses = np.concatenate([np.asarray(l) for l in losses], axis=1)[:, :n_steps]
  if pending is not None:
    meter.trained(epoch, *pending, last=True)
  elif meter is not None and calls > first:  # the epoch's steps, done (the losses are here)
    meter.trained(epoch, n_steps, n_steps - min(first * k, n_steps), last=True)
  return state, losses, np.asarray(finite), n_steps


def _stop_diverged(p: _Progress, bad: np.ndarray, t: int, epoch: int, labels, policy: str):
  """Raises for a diverged member, or (rollback) ends its stage at its best epoch."""
  where = "" if len(labels) == 1 else f" (seeds {[labels[i] for i in np.flatnonzero(bad)]})"
  if policy != "rollback":
    raise divergence_error(t, epoch, where)
  if len(labels) == 1:
    logging.warning("stage t=%d epoch %d: non-finite loss or parameters; rolling back to the "
                    "best epoch (%d) and ending the stage", t, epoch, int(p.best_epoch[0]))
  else:
    logging.warning("stage t=%d epoch %d: non-finite loss or parameters%s; they roll back to "
                    "their best epoch and end the stage", t, epoch, where)
  p.diverged |= bad
  p.active &= ~bad


def fit_stage(steps: Steps, learner: Learner, train_idx: np.ndarray, val_idx: np.ndarray,
              keys: jax.Array, *, t: int = 0, opt_state=None,
              progress: Callable[[str], None] | None = None, labels: Sequence[int] | None = None,
              check: Callable[[], None] = lambda: None,
              on_epoch: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None] | None = None,
              checkpoints: StageCheckpoints | None = None, meter: Meter | None = None,
              whole: bool = False):
  """Trains a stacked population on one stage's data; keeps each member's best epoch.

  Args:
    steps: the run's compiled steps.
    learner: the learners before the stage, stacked (S, ...) (not modified).
    train_idx, val_idx: (S, n) and (S, m) indices into the training split.
    keys: (S,) PRNG keys of the stage (data order, augmentation).
    t: time step, for messages.
    opt_state: stacked optimizer state to continue from (None = fresh).
    progress: called with a one-line message at most every few seconds.
    labels: the members' names in messages (their seeds).
    check: called after every compiled train call, every epoch and every call of the
      whole-stage program, each time after the stage was saved if a save was due; raising
      there stops the stage (a signal handler's flag,
      `alma_jax.outputs.interrupts.Signals.check`).
    on_epoch: called after every epoch with (epoch, mean training loss (S,), validation
      accuracy (S,), which members trained in it (S,)); it must not raise for a signal
      (`check` does, once the stage is saved).
    checkpoints: saves the stage between train calls when it says so, and continues the
      stage from its last save, if it has one.
    meter: told where the stage is after every train call and epoch
      (`alma_jax.core.meter.Meter`: running lines with speed and ETAs); the epoch's
      `progress` line goes through it.
    whole: run the epochs as one compiled program (`_fit_whole`) rather than one train call
      per chunk of steps and one evaluation per epoch; the same results. A stage saved in
      the middle of an epoch continues per call.

  Returns:
    (best learners, final optimizer state (None after a rollback), StageStats).
  """
  cfg = steps.method.config.train
  num = int(keys.shape[0])
  labels = list(labels) if labels is not None else list(range(num))
  if train_idx.shape[-1] < 1 or val_idx.shape[-1] < 1:
    raise ValueError(f"stage t={t} has {train_idx.shape[-1]} training and {val_idx.shape[-1]} "
                     "validation examples; both must be >= 1")
  structure, method = learner.structure, steps.method
  state = steps.init_state(learner, opt_state)
  rngs = [population.numpy_rng(keys[i]) for i in range(num)]
  zeros = lambda: np.zeros(num, int)  # pylint: disable=unnecessary-lambda-assignment
  units = method.num_units(structure)
  p = _Progress(learner, np.full((num, units), -1.0), zeros(), zeros(), zeros(), zeros(),
                np.ones(num, bool), np.zeros(num, bool))
  delta = float(cfg.patience_delta)
  timer, last_report = timing.Breakdown(), time.monotonic()
  resume = None
  if checkpoints is not None:
    state, resume = _restore_position(checkpoints, state, p, rngs, timer)
  save = None if checkpoints is None else _saver(checkpoints, p, rngs, timer)
  if meter is not None:
    fixed = int(F.get(cfg, "train.steps_per_epoch"))
    meter.stage_start(t, int(cfg.epochs), fixed or -(-train_idx.shape[-1] // steps.batch_size))
  if whole and (resume is None or resume.next_call == 0):
    state = _fit_whole(steps, learner, state, p, rngs, train_idx, val_idx, keys,
                       resume.epoch if resume else 1, timer, save, check,
                       int(getattr(checkpoints, "every_epochs", 0) or 0), t=t, labels=labels,
                       on_epoch=on_epoch, progress=progress, meter=meter)
    _warn_unimproved(t, p, labels, delta)
    return _end(steps, p, state, train_idx, val_idx, timer, save, check)
  for epoch in range(resume.epoch if resume else 1, int(cfg.epochs) + 1):
    ran = p.active.copy()
    if save is not None:
      save.epoch_start(epoch)
    with timer("train_s"):
      state, losses, finite, n_steps = _epoch(steps, state, structure, rngs, train_idx, keys, epoch,
                                              check, resume, save, meter)
      resume = None
      p.steps_run += n_steps * p.active
      p.epochs_run[p.active] = epoch
    bad = p.active & ~(np.all(np.isfinite(losses), axis=1) & finite)
    if bad.any():
      _stop_diverged(p, bad, t, epoch, labels, F.get(cfg, "train.on_divergence"))
      if not p.active.any():
        break
    current = Learner(params=jax.vmap(method.combine)(learner, state.trainable),
                      model_state=state.model_state, structure=structure)
    with timer("eval_s"):
      acc, _, unit_acc = steps.evaluate_units(current, "train", val_idx)
    _keep_best(p, method, current, unit_acc, epoch, delta, int(cfg.patience))
    saved = (save is not None and p.active.any() and epoch < int(cfg.epochs)
             and save.between_epochs(state, epoch))  # e.g. a signal during the evaluation
    if on_epoch is not None:
      on_epoch(epoch, np.mean(losses, axis=1), np.asarray(acc), ran)
    last_report = _tell_epoch(cfg, last_report, t, epoch, losses, acc, p, meter, progress)
    if saved:
      check()  # the stage is saved: a signal that asked for the save stops it here
    if not p.active.any():
      break
  _warn_unimproved(t, p, labels, delta)
  return _end(steps, p, state, train_idx, val_idx, timer, save, check)


def _end(steps: Steps, p: _Progress, state: TrainState, train_idx, val_idx, timer, save,
         check: Callable[[], None]):
  """The stage is trained: when a signal asks the run to stop, saves the finished stage and
  stops here (its training is kept, and the stop does not wait for what follows it); else the
  stage's results (`_finish`)."""
  if save is not None:
    save.stage_end(state, int(steps.method.config.train.epochs))
  check()
  return _finish(steps, p, state, train_idx, val_idx, timer)


def _warn_unimproved(t: int, p: _Progress, labels, delta: float) -> None:
  """Warns of the members whose stage ends on the parameters it started with: no epoch
  improved on the starting point (their divergence, if any, has a warning of its own)."""
  kept = (p.best_epoch == 0) & (p.epochs_run > 0) & ~p.diverged
  if kept.any():
    names = [str(labels[i]) for i in np.flatnonzero(kept)]
    logging.warning("stage t=%d: no epoch improved the validation accuracy (by more than "
                    "config.train.patience_delta=%g) for %s %s; the stage keeps the parameters "
                    "it started with", t, delta, "member" if len(names) == 1 else "members",
                    ", ".join(names))


def _tell_epoch(cfg, last_report: float, t: int, epoch: int, losses, acc, p: _Progress,
                meter: Meter | None, progress: Callable[[str], None] | None) -> float:
  """Tells the meter an epoch ended, with the epoch's progress line when one is due (at most
  every `train.progress_every_s`); returns when the last line was said."""
  line = None
  if time.monotonic() - last_report >= F.get(cfg, "train.progress_every_s"):
    last_report, line = time.monotonic(), _progress_line(t, epoch, cfg.epochs, losses, acc, p)
  if meter is not None:
    meter.epoch_end(line)
  if progress is not None and line is not None:
    progress(line)
  return last_report


def _finish(steps: Steps, p: _Progress, state: TrainState, train_idx: np.ndarray,
            val_idx: np.ndarray, timer: timing.Breakdown):
  """(best learners, final optimizer state (None after a rollback), StageStats) of a stage."""
  cfg = steps.method.config.train
  best_acc = p.best_acc[:, 0]
  if steps.method.units_are_parts:  # the selected members together
    with timer("eval_s"):
      best_acc, _ = steps.evaluate(p.best, "train", val_idx)
  spent = timer.as_dict()
  if F.get(cfg, "train.steps_per_epoch"):  # fixed steps: full batches
    examples = p.steps_run * steps.batch_size
  else:  # passes over each member's stage data
    examples = train_idx.shape[-1] * p.epochs_run
  stats = StageStats(p.epochs_run, p.best_epoch, np.maximum(best_acc, 0.0), p.steps_run,
                     p.diverged, spent["train_s"], spent["eval_s"], examples)
  return p.best, (None if p.diverged.any() else state.opt_state), stats


def _bucket(n: int) -> int:
  """`n` rounded up to a power of two: sizes that vary from stage to stage share a program."""
  return 1 << max(0, int(n) - 1).bit_length()


def improvement_thresholds(m: int, delta: float) -> np.ndarray:
  """For a validation set of `m` examples, the least number of correct ones that improves on a
  best of b correct (entry b + 1; entry 0: no best yet, accuracy -1): the host's
  `acc > best_acc + delta` in float64, tabulated once, so that a program decides it exactly."""
  acc = np.arange(m + 1) / m
  best = np.concatenate([[-1.0], acc])
  table = np.searchsorted(acc, best + delta, side="right").astype(np.int32)
  return np.pad(table, (0, _bucket(m + 2) - (m + 2)), constant_values=m + 1)


def _segment_orders(steps: Steps, structure, rngs, train_idx, first: int, end: int, slots: int):
  """The index and mask arrays (slots, C, S, K, D, b) of epochs `first`..`end - 1`, drawn in
  order as `_epoch` draws them (C: the calls of an epoch rounded up by `_bucket`; later
  slots and calls are padding that never runs); returns (Batch, calls, steps per epoch)."""
  d = steps.method.num_data_orders(structure)
  k = steps.steps_per_call
  fixed = int(F.get(steps.method.config.train, "train.steps_per_epoch"))
  idx_all, mask_all, calls, n_steps = None, None, 0, 0
  for j in range(end - first):
    orders = [padded_orders(rng, train_idx[i], d, steps.batch_size, k, fixed)
              for i, rng in enumerate(rngs)]
    idx, mask = np.stack([o[0] for o in orders]), np.stack([o[1] for o in orders])
    n_steps, calls = orders[0][2], idx.shape[1] // k
    if idx_all is None:
      shape = (slots, _bucket(calls), len(rngs), k) + idx.shape[2:]
      idx_all, mask_all = np.zeros(shape, np.int32), np.zeros(shape, bool)
    split = lambda a: np.moveaxis(a.reshape(a.shape[0], calls, k, *a.shape[2:]), 1, 0)  # pylint: disable=unnecessary-lambda-assignment,cell-var-from-loop
    idx_all[j, :calls], mask_all[j, :calls] = split(idx), split(mask)
  return Batch(idx_all, mask_all), calls, n_steps


def _val_batches(steps: Steps, val_idx: np.ndarray) -> tuple[Batch, int]:
  """The validation batches (V, S, b) of `Passes.evaluate_units` (V rounded up by `_bucket`)
  and how many of them are real."""
  idx = steps.task.global_index(steps.data, "train", val_idx)
  batches = list(steps.passes.eval_batches(idx))
  slots = _bucket(len(batches))
  idx_all = np.zeros((slots,) + batches[0].idx.shape, np.int32)
  mask_all = np.zeros(idx_all.shape, bool)
  for v, b in enumerate(batches):
    idx_all[v], mask_all[v] = b.idx, b.mask
  return Batch(idx_all, mask_all), len(batches)


def _fit_whole(steps: Steps, learner: Learner, state: TrainState, p: _Progress, rngs,
               train_idx: np.ndarray, val_idx: np.ndarray, keys: jax.Array, first: int,
               timer: timing.Breakdown, save: "_saver | None", check: Callable[[], None],
               every_epochs: int, *, t: int, labels, on_epoch, progress,
               meter: Meter | None = None) -> TrainState:
  """The epochs from `first` on as one compiled program per segment (all epochs, or
  `every_epochs` of them when the stage is saved after every so many): the program trains,
  evaluates and keeps the best epoch; the host then goes through its per-epoch outputs as
  `fit_stage` would (messages, divergence, `on_epoch`), and saves and checks for a signal
  between segments. Updates `p`; returns the final train state."""
  cfg, method, structure = steps.method.config.train, steps.method, learner.structure
  epochs, m = int(cfg.epochs), val_idx.shape[-1]
  slots = min(every_epochs, epochs) if every_epochs > 0 else epochs
  delta, patience = float(cfg.patience_delta), int(cfg.patience)
  policy = F.get(cfg, "train.on_divergence")
  thresholds = improvement_thresholds(m, delta)
  val, num_val = _val_batches(steps, val_idx)
  last_report = time.monotonic()
  pace = _Pace(steps, train_idx.shape[-1])
  while first <= epochs and p.active.any():
    end = min(first + pace.epochs(slots, save), epochs + 1)
    began = time.monotonic()
    with timer("train_s"):  # training and the validation inside it
      orders, calls, n_steps = _segment_orders(steps, structure, rngs, train_idx, first, end, slots)
      counts = np.where(p.best_acc < 0, -1, np.round(p.best_acc * m)).astype(np.int32)
      prog = {"best_count": counts, "best_epoch": p.best_epoch.astype(np.int32),
              "since_best": p.since_best.astype(np.int32),
              "epochs_run": p.epochs_run.astype(np.int32),
              "steps_run": p.steps_run.astype(np.int32), "active": p.active.copy(),
              "diverged": p.diverged.copy()}
      state, best, prog, out, stop = steps.programs.stage_call(
          structure, state, learner, p.best, prog, orders, val, keys, first, end, calls, n_steps,
          num_val, thresholds, patience=patience,
          divergence_stops_all=policy != "rollback")
      out = jax.tree.map(np.asarray, out)
      stop = int(stop)
    pace.ran(stop - first, time.monotonic() - began)
    if meter is not None and stop > first:  # the segment's steps, in one measurement
      meter.trained(stop - 1, n_steps, n_steps * (stop - first), last=True)
    for epoch in range(first, stop):
      j, ran = epoch - first, p.active.copy()
      losses = out["losses"][j][:, :n_steps]
      p.steps_run += n_steps * p.active
      p.epochs_run[p.active] = epoch
      bad = p.active & ~(np.all(np.isfinite(losses), axis=1) & out["finite"][j])
      if bad.any():
        _stop_diverged(p, bad, t, epoch, labels, policy)
        if not p.active.any():
          break
      acc = out["correct"][j].astype(np.float64) / m
      _keep_best(p, method, None, out["units"][j].astype(np.float64) / m, epoch, delta, patience)
      if on_epoch is not None:
        on_epoch(epoch, np.mean(losses, axis=1), acc, ran)
      last_report = _tell_epoch(cfg, last_report, t, epoch, losses, acc, p, meter, progress)
    for name in _PROGRESS_ARRAYS[1:]:  # the program and the host took the same decisions
      if not np.array_equal(np.asarray(prog[name]), getattr(p, name)):
        raise RuntimeError(f"stage t={t}: the stage program and the host disagree on {name}")
    p.best = Learner(params=best.params, model_state=best.model_state, structure=structure)
    first = stop
    if first <= epochs and p.active.any():  # a segment ended with the stage going on
      if save is not None:
        save.segment_end(state, first - 1)
      check()
  return state


# Seconds of training that one call of the whole-stage program may take at most: a signal waits
# for the call in flight (a compiled program cannot be stopped), so this bounds how long a stop
# takes. The calls are at most as long as the time left to the next timed stage save
# (`checkpoint.every_s`), so that save is not late by more than an epoch either.
SEGMENT_S = 10.0


class _Pace:
  """How many epochs the next call of the whole-stage program runs: as many as fit in
  `SEGMENT_S` and in the time left to the next timed save, by the seconds per training example
  of the epochs run so far in this run (`Steps.stage_pace`; the run's first call: one epoch).
  Where the calls end changes no result: each epoch's orders are drawn on the host in the same
  sequence, and the program's carry holds the rest."""

  def __init__(self, steps: Steps, examples: int):
    self.steps, self.examples = steps, max(1, examples)

  def epochs(self, slots: int, save: "_saver | None") -> int:
    per = self.steps.stage_pace
    if jax.process_count() > 1:  # every process must make the same calls: no clock decides
      return slots
    if per is None:
      return 1
    left = None if save is None else save.seconds_to_save()
    bound = SEGMENT_S if left is None else min(SEGMENT_S, left)
    return max(1, min(slots, int(bound // (per * self.examples))))

  def ran(self, epochs: int, seconds: float) -> None:
    if epochs > 0:
      self.steps.stage_pace = seconds / (epochs * self.examples)


def _keep_best(p: _Progress, method, current: Learner | None, unit_acc: np.ndarray, epoch: int,
               delta: float, patience: int) -> None:
  """Keeps each unit's best epoch; a member's patience restarts when any of its units improves.
  (`current` None: the best parameters are kept elsewhere, only the counts here.)"""
  improved = p.active[:, None] & (unit_acc > p.best_acc + delta)
  if current is not None:
    p.best = population.select_units(method, improved, current, p.best)
  p.best_acc = np.where(improved, unit_acc, p.best_acc)
  any_improved = improved.any(axis=1)
  p.best_epoch = np.where(any_improved, epoch, p.best_epoch)
  p.since_best = np.where(any_improved, 0, p.since_best + p.active)
  p.active &= p.since_best < patience


_PROGRESS_ARRAYS = ("best_acc", "best_epoch", "since_best", "epochs_run", "steps_run", "active",
                    "diverged")


def _arrays(state: TrainState, best: Learner) -> dict:
  return {"state": {"trainable": state.trainable, "frozen": state.frozen,
                    "model_state": state.model_state, "opt_state": state.opt_state},
          "best": {"params": best.params, "model_state": best.model_state}}


def _restore_position(checkpoints: StageCheckpoints, state: TrainState, p: _Progress, rngs,
                      timer: timing.Breakdown):
  """(train state, `_Resume`) of the stage's last save, applied to `p`, `rngs` and `timer`;
  (`state`, None) when there is none."""
  saved = checkpoints.load(_arrays(state, p.best))
  if saved is None:
    return state, None
  arrays, pos = saved
  for name in _PROGRESS_ARRAYS:
    old = getattr(p, name)
    setattr(p, name, np.asarray(pos["progress"][name], old.dtype).reshape(old.shape))
  p.best = Learner(params=arrays["best"]["params"], model_state=arrays["best"]["model_state"],
                   structure=p.best.structure)
  for rng, st in zip(rngs, pos["rng_states"]):
    rng.bit_generator.state = st
  timer.add(pos["timings"])
  a = arrays["state"]
  state = TrainState(a["trainable"], a["frozen"], a["model_state"], a["opt_state"])
  losses = [np.asarray(l, np.float32) for l in pos["losses"]]
  finite = None if pos["finite"] is None else np.asarray(pos["finite"], bool)
  return state, _Resume(int(pos["epoch"]), int(pos["next_call"]), losses, finite)


class _saver:  # pylint: disable=invalid-name  (used as a function)
  """`save(state, next_call, losses, finite, epoch_end)` for `_epoch`: writes the stage's
  position when `checkpoints` says it is due."""

  def __init__(self, checkpoints: StageCheckpoints, p: _Progress, rngs, timer: timing.Breakdown):
    self.checkpoints, self.p, self.rngs, self.timer = checkpoints, p, rngs, timer
    self.epoch, self.rng_states = 0, []

  def epoch_start(self, epoch: int) -> None:
    """Notes each member's data-order generator before the epoch draws its orders."""
    self.epoch = epoch
    self.rng_states = [rng.bit_generator.state for rng in self.rngs]

  def __call__(self, state: TrainState, next_call: int, losses: list, finite, epoch_end: bool):
    if self.checkpoints.due(epoch_end, self.epoch):
      self._save(state, self.epoch, next_call, self.rng_states, losses, finite)

  def seconds_to_save(self) -> float | None:
    """Seconds to the next timed save (None: no timed saves)."""
    left = getattr(self.checkpoints, "seconds_to_save", None)
    return None if left is None else left()

  def stage_end(self, state: TrainState, epochs: int) -> None:
    """After the stage's last epoch, when a signal asks the run to stop: saves the finished
    stage (continuing after epoch `epochs`, i.e. with nothing left to train), so that the stop
    keeps its training."""
    if getattr(self.checkpoints, "stopping", lambda: False)():
      self._save(state, epochs + 1, 0, [rng.bit_generator.state for rng in self.rngs], [], None)

  def segment_end(self, state: TrainState, epoch: int) -> None:
    """After a whole-stage segment that ended with epoch `epoch` (the data-order generators
    have drawn exactly its epochs): saves the stage to continue at the next epoch, when due."""
    if self.checkpoints.due(True, epoch):
      self._save(state, epoch + 1, 0, [rng.bit_generator.state for rng in self.rngs], [], None)

  def between_epochs(self, state: TrainState, epoch: int) -> bool:
    """After epoch `epoch` is evaluated and early stopping updated: saves the stage to
    continue at the next epoch, when due (a signal that arrived during the evaluation);
    returns whether it saved."""
    if not self.checkpoints.due(False, epoch):
      return False
    self._save(state, epoch + 1, 0, [rng.bit_generator.state for rng in self.rngs], [], None)
    return True

  def _save(self, state, epoch, next_call, rng_states, losses, finite) -> None:
    p = self.p
    position = {
        "epoch": epoch, "next_call": next_call, "rng_states": rng_states,
        "losses": [np.asarray(l, np.float32).tolist() for l in losses],
        "finite": None if finite is None else np.asarray(finite).tolist(),
        "progress": {name: np.asarray(getattr(p, name)).tolist() for name in _PROGRESS_ARRAYS},
        "timings": self.timer.as_dict()}
    self.checkpoints.save(_arrays(state, p.best), position)


def _progress_line(t, epoch, epochs, losses, acc, p: _Progress) -> str:
  if len(acc) == 1:
    return (f"  t={t} epoch {epoch}/{epochs} loss={np.mean(losses):.4f} val_acc={acc[0]:.4f} "
            f"best={np.max(p.best_acc[0]):.4f}@{p.best_epoch[0]}")
  return (f"  t={t} epoch {epoch}/{epochs} loss={np.mean(losses):.4f} val_acc={np.mean(acc):.4f} "
          f"(mean of {len(acc)} seeds, {int(p.active.sum())} training)")


def fit_one(steps: Steps, learner: Learner, train_idx: np.ndarray, val_idx: np.ndarray,
            key: jax.Array, **kwargs):
  """`fit_stage` for a single (unstacked) learner; returns (best, opt_state, StageStats)."""
  best, opt_state, stats = fit_stage(steps, population.stack([learner]), np.asarray(train_idx)[None],
                                     np.asarray(val_idx)[None], population.stack_keys([key]),
                                     **kwargs)
  if opt_state is not None:
    opt_state = population.unstack(opt_state, 0)
  return population.unstack(best, 0), opt_state, stats
