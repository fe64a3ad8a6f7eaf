"""One epoch of a training stage, written once: train calls, validation, divergence, best epoch.

An epoch is a pure transition of the stage's carry (the train state, the best
parameters so far and `StopState`, the per-member early-stopping state):

  epoch(carry, orders, val) -> (carry, out)

`alma_jax.engine.train` runs it in two ways. Driven from the host, the epoch's
train calls are compiled chunks (`Programs.train_call`, so a stage can be
saved and stopped between them), the validation runs through the evaluation
program, and `end_epoch` (the divergence and best-epoch rule) is a small
compiled program of its own. As one program (`train.stage_program=whole`),
`Programs.stage_call` runs `epoch` in a `lax.while_loop`. Both go through
the same chunk, evaluation and `end_epoch` functions, so they take the same
decisions by construction.

The best-epoch comparison is made on scores: for a task whose examples are
right or wrong (`Rule.exact`), the number of correct validation examples of
each selection unit, compared with `improvement_thresholds` (the host's
float64 `accuracy > best + delta`, tabulated, so that a program decides it
exactly); for other tasks (text: token accuracies), the summed accuracies in
float32, `score > best + delta * m`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from alma_jax.errors import divergence_error
from alma_jax.models import slots
from alma_jax.state import Learner, StopState

@dataclasses.dataclass(frozen=True)
class StageOptions:
  """The `config.train` fields a stage reads (`Steps.from_config` builds them once)."""

  epochs: int = 100
  patience: int = 25
  patience_delta: float = 0.0
  on_divergence: str = "raise"  # or "rollback"
  steps_per_epoch: int = 0  # 0: an epoch is a pass over the stage's data
  progress_every_s: float = 10.0
  stage_program: str = "per_epoch"  # or "whole": the epochs as one compiled program


@dataclasses.dataclass(frozen=True)
class Rule:
  """The static facts of a stage's divergence and best-epoch rule (a program's key)."""

  patience: int
  delta: float  # an improvement must exceed the best accuracy by more than this
  num_val: int  # m, the validation examples of each member
  exact: bool  # scores are counts of correct examples (else summed accuracies)
  stop_all_on_divergence: bool  # any divergence ends the stage (the run then raises)

  def program_rule(self) -> "Rule":
    """The rule with only what a program uses: an exact rule takes its sizes from its
    thresholds (an input), so stages of other sizes share its program."""
    return dataclasses.replace(self, delta=0.0, num_val=0) if self.exact else self

  def thresholds(self) -> np.ndarray:
    """The improvement table of an exact rule (`improvement_thresholds`); one entry else."""
    if not self.exact:
      return np.zeros(1, np.int32)
    return improvement_thresholds(self.num_val, self.delta)


def improvement_thresholds(m: int, delta: float) -> np.ndarray:
  """For a validation set of `m` examples, the least number of correct ones that improves on a
  best of b correct (entry b + 1; entry 0: no best yet, accuracy -1): the host's
  `acc > best_acc + delta` in float64, tabulated once, so that a program decides it exactly."""
  acc = np.arange(m + 1) / m
  best = np.concatenate([[-1.0], acc])
  table = np.searchsorted(acc, best + delta, side="right").astype(np.int32)
  # (rounded up to a power of two: validation sets of other sizes share a program)
  return np.pad(table, (0, slots.next_power_of_two(m + 2) - (m + 2)), constant_values=m + 1)


def diverged(rule: Rule, t: int, epoch: int, labels, bad: np.ndarray, ran: np.ndarray,
             best_epoch: np.ndarray) -> bool:
  """The host's part of a divergence in `epoch` (`bad` (S,): the members whose loss or
  parameters are not finite): raises `DivergenceError` when the rule stops the run; else
  warns (they roll back to their best epoch and end the stage) and returns whether no member
  that `ran` is left."""
  where = "" if len(labels) == 1 else f" (seeds {[labels[i] for i in np.flatnonzero(bad)]})"
  if rule.stop_all_on_divergence:
    raise divergence_error(t, epoch, where)
  if len(labels) == 1:
    logging.warning("stage t=%d epoch %d: non-finite loss or parameters; rolling back to the "
                    "best epoch (%d) and ending the stage", t, epoch, int(best_epoch[0]))
  else:
    logging.warning("stage t=%d epoch %d: non-finite loss or parameters%s; they roll back to "
                    "their best epoch and end the stage", t, epoch, where)
  return not (ran & ~bad).any()


def warn_unimproved(rule: Rule, t: int, labels, stop: StopState) -> None:
  """Warns of the members whose stage ends on the parameters it started with: no epoch
  improved on the starting point (their divergence, if any, has a warning of its own)."""
  kept = (stop.best_epoch == 0) & (stop.epochs_run > 0) & ~stop.diverged
  if kept.any():
    names = [str(labels[i]) for i in np.flatnonzero(kept)]
    logging.warning("stage t=%d: no epoch improved the validation accuracy (by more than "
                    "config.train.patience_delta=%g) for %s %s; the stage keeps the parameters "
                    "it started with", t, rule.delta, "member" if len(names) == 1 else "members",
                    ", ".join(names))


def epoch_ok(losses, finite) -> jax.Array:
  """Per member: every loss of the epoch (S, steps) and the trained parameters are finite (in
  numpy for host arrays: no program of its own)."""
  xp = np if isinstance(losses, np.ndarray) else jnp
  return xp.all(xp.isfinite(losses), axis=1) & finite


def end_epoch(rule: Rule, select: Callable, stop: StopState, best: Learner, current: Learner,
              ok, scores, epoch, n_steps, thresholds) -> tuple[StopState, Learner, dict]:
  """The rule after epoch `epoch` of `n_steps` steps: counts the steps of the members that
  trained, stops the diverged ones (`ok` false), then keeps each unit's best epoch
  (`select(take (S, U), new, old)` takes the improved units of `current` into `best`); a
  member's patience restarts when any of its units improves. Returns (stop, best, facts of
  the epoch: `bad` (S,), the members that diverged in it, and `improved` (S, U))."""
  chex.assert_equal_shape([scores, stop.best_score])
  active = stop.active
  steps_run = stop.steps_run + n_steps * active.astype(jnp.int32)
  epochs_run = jnp.where(active, epoch, stop.epochs_run)
  bad = active & ~ok
  if rule.stop_all_on_divergence:
    active = jnp.where(jnp.any(bad), False, active)
  else:
    active = active & ~bad
  if rule.exact:  # the table's entry 0 is for no best yet (NO_BEST)
    counts = jnp.round(scores).astype(jnp.int32)
    beats = counts >= thresholds[stop.best_score.astype(jnp.int32) + 1]
  else:  # no best yet: an accuracy of -1, as in the table
    floor = jnp.where(stop.best_score < 0, -float(rule.num_val), stop.best_score)
    beats = scores > floor + jnp.float32(rule.delta * rule.num_val)
  improved = active[:, None] & beats
  best = select(improved, current, best)
  any_improved = jnp.any(improved, axis=1)
  since_best = jnp.where(any_improved, 0, stop.since_best + active.astype(jnp.int32))
  stop = StopState(jnp.where(improved, scores.astype(jnp.float32), stop.best_score),
                   jnp.where(any_improved, epoch, stop.best_epoch), since_best, epochs_run,
                   steps_run, active & (since_best < rule.patience), stop.diverged | bad)
  return stop, best, {"bad": bad, "improved": improved}


@dataclasses.dataclass(frozen=True)
class EpochFns:
  """The functions of one stacked population's epoch, for one program structure: `chunk`
  (state, data, Batch, keys, counter) -> (state, losses (S, K), finite (S,)) (a train call);
  `evaluate` (params, model_state, data, Batch) -> (correct (S,), NLL, unit correct (S, U),
  aux) (an evaluation batch); `combine` (base learner, trainable) -> params; `select` (take,
  new, old) -> learner."""

  chunk: Callable
  evaluate: Callable
  combine: Callable
  select: Callable


def epoch(fns: EpochFns, rule: Rule, carry: dict, orders, val, data, keys, *, base: Learner,
          num_calls, n_steps, num_val, thresholds, counter0) -> tuple[dict, dict]:
  """One epoch as a transition of `carry` {"epoch", "state", "best", "stop"}: the train calls
  `0 .. num_calls - 1` over `orders` (Batch (C, S, K, D, b); call c's first step has PRNG
  counter `counter0 + c * K`), the validation batches `0 .. num_val - 1` of `val` (Batch
  (V, S, b)), then `end_epoch`. Returns (carry, out): the epoch's losses (S, C * K; padding
  steps 0), `finite`, the summed `correct` (S,) and `units` (S, U), and `end_epoch`'s facts."""
  structure = carry["best"].structure
  e, num = carry["epoch"], orders.idx.shape[1]
  width = orders.idx.shape[0] * orders.idx.shape[2]
  k = orders.idx.shape[2]

  def call(c, inner):
    state, losses, _ = inner
    batch = type(orders)(orders.idx[c], orders.mask[c])
    state, loss, finite = fns.chunk(state, data, batch, keys,
                                    counter0 + c.astype(jnp.uint32) * jnp.uint32(k))
    return state, jax.lax.dynamic_update_slice(losses, loss, (0, c * k)), finite

  state, losses, finite = jax.lax.fori_loop(
      0, num_calls, call, (carry["state"], jnp.zeros((num, width), jnp.float32),
                           jnp.ones((num,), bool)))
  current = Learner(params=fns.combine(base, state.trainable), model_state=state.model_state,
                    structure=structure)
  units = carry["stop"].best_score.shape[1]

  def val_batch(v, sums):
    r = fns.evaluate(current.params, current.model_state, data,
                     type(val)(val.idx[v], val.mask[v]))
    return sums[0] + r[0], sums[1] + r[2]

  correct, unit_correct = jax.lax.fori_loop(
      0, num_val, val_batch, (jnp.zeros((num,), jnp.float32), jnp.zeros((num, units), jnp.float32)))
  stop, best, facts = end_epoch(rule, fns.select, carry["stop"], carry["best"], current,
                                epoch_ok(losses, finite), unit_correct, e, n_steps, thresholds)
  out = dict(facts, losses=losses, finite=finite, correct=correct, units=unit_correct, stop=stop)
  return {"epoch": e + 1, "state": state, "best": best, "stop": stop}, out
