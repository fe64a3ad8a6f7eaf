"""The data orders of a stage's epochs and its validation batches, as index arrays; how many
epochs a call of the whole-stage program runs (`Pace`).

The host draws each member's order of an epoch from the member's own numpy
generator (`draw`), in the same sequence whether the epoch then runs call by
call or inside the whole-stage program (`segment` stacks the orders of
several epochs for it). The data stays on the device; a compiled call
receives index arrays only (a partial last batch is padded and masked, never
recompiled).
"""

from __future__ import annotations

import jax
import numpy as np

from alma_jax.engine.programs import Batch
from alma_jax.models.slots import next_power_of_two


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


def draw(rngs, train_idx: np.ndarray, num_orders: int, batch: int, steps_per_call: int,
         fixed_steps: int) -> tuple[np.ndarray, np.ndarray, int]:
  """One epoch's orders of every member (its own generator, its own data): index and mask
  arrays (S, calls * K, D, b) and the epoch's number of steps."""
  orders = [padded_orders(rng, train_idx[i], num_orders, batch, steps_per_call, fixed_steps)
            for i, rng in enumerate(rngs)]
  return np.stack([o[0] for o in orders]), np.stack([o[1] for o in orders]), orders[0][2]


def segment(rngs, train_idx: np.ndarray, num_orders: int, batch: int, steps_per_call: int,
            fixed_steps: int, epochs: int, slots: int) -> tuple[Batch, int, int]:
  """The orders of `epochs` successive epochs (`draw`, in order) as one Batch (slots, C, S, K,
  D, b) for the whole-stage program (C: the calls of an epoch rounded up to a power of two; later
  slots and calls are padding that never runs); returns (Batch, calls, steps per epoch)."""
  k = steps_per_call
  idx_all = mask_all = None
  calls = n_steps = 0
  for j in range(epochs):
    idx, mask, n_steps = draw(rngs, train_idx, num_orders, batch, k, fixed_steps)
    calls = idx.shape[1] // k
    if idx_all is None:
      shape = (slots, next_power_of_two(calls), len(rngs), k) + idx.shape[2:]
      idx_all, mask_all = np.zeros(shape, np.int32), np.zeros(shape, bool)

    def split(a):
      return np.moveaxis(a.reshape(a.shape[0], calls, k, *a.shape[2:]), 1, 0)

    idx_all[j, :calls], mask_all[j, :calls] = split(idx), split(mask)
  return Batch(idx_all, mask_all), calls, n_steps


def validation(batches: list[Batch]) -> tuple[Batch, int]:
  """The validation batches (each (S, b)) stacked (V, S, b), V rounded up to a power of two, and how
  many of them are real."""
  slots = next_power_of_two(len(batches))
  idx_all = np.zeros((slots,) + batches[0].idx.shape, np.int32)
  mask_all = np.zeros(idx_all.shape, bool)
  for v, b in enumerate(batches):
    idx_all[v], mask_all[v] = b.idx, b.mask
  return Batch(idx_all, mask_all), len(batches)


# Seconds of training that one call of the whole-stage program may take at most: a signal waits
# for the call in flight (a compiled program cannot be stopped), so this bounds how long a stop
# takes. The calls are at most as long as the time left to the next timed stage save
# (`checkpoint.every_s`), so that save is not late by more than an epoch either.
SEGMENT_S = 10.0


class Pace:
  """How many epochs the next call of the whole-stage program runs: as many as fit in
  `SEGMENT_S` and in the time left to the next timed save, by the seconds per training example
  of the epochs run so far in this run (`Steps.stage_pace`; the run's first call: one epoch).
  Where the calls end changes no result: each epoch's orders are drawn on the host in the same
  sequence, and the program's carry holds the rest."""

  def __init__(self, steps, examples: int):
    self.steps, self.examples = steps, max(1, examples)

  def epochs(self, slots: int, save) -> int:
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
