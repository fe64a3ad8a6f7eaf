"""When to train and on what (Algorithm 1 of the paper).

The learner waits `w` mega-batches between updates: it trains at
t = w, 2w, ..., B on the w new mega-batches plus, with replay, a fraction of
all earlier ones. The loop asks a waiting policy (`alma_jax.policies`) when
to train; the fixed wait is this one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from alma_jax.data.stream import Stream


def check_wait(num_megabatches: int, wait: int) -> None:
  if not isinstance(wait, int) or wait < 1:
    raise ValueError(f"config.stream.wait must be an integer >= 1, got {wait!r}")
  if num_megabatches % wait:
    divisors = [d for d in range(1, num_megabatches + 1) if num_megabatches % d == 0]
    raise ValueError(f"config.stream.wait={wait} does not divide "
                     f"config.stream.num_megabatches={num_megabatches}; allowed values: {divisors}")


def training_times(num_megabatches: int, wait: int) -> list[int]:
  """The time steps at which the learner updates its parameters."""
  check_wait(num_megabatches, wait)
  return list(range(wait, num_megabatches + 1, wait))


def is_training_time(t: int, wait: int) -> bool:
  return t >= 1 and t % wait == 0


@dataclasses.dataclass(frozen=True)
class StageData:
  """Indices (into the training split) that one stage trains and validates on."""

  t: int
  train: np.ndarray
  val: np.ndarray
  new_megabatches: tuple[int, ...]
  num_replayed: int  # training examples drawn from earlier mega-batches


def _replay_sample(arrays, fraction: float, rng: np.random.Generator) -> np.ndarray:
  if not arrays or fraction <= 0.0:
    return np.zeros((0,), np.int32)
  pool = np.concatenate(arrays)
  if fraction >= 1.0:
    return pool
  k = int(round(fraction * len(pool)))
  return np.sort(rng.choice(pool, size=k, replace=False)).astype(np.int32)


def stage_data(stream: Stream, t: int, wait: int, replay: float, seed: int,
               previous: int | None = None) -> StageData:
  """The data of the stage that trains at time `t`.

  The stage holds the mega-batches that arrived since the previous stage,
  `previous` + 1 ... t (None: the fixed wait's t-w+1 ... t), and, with
  `replay` > 0, a uniformly drawn `replay` fraction of the examples of all
  earlier mega-batches (1.0 = everything seen so far, 0.0 = only the new
  data). The validation set follows the same rule with the validation parts.
  """
  if not 0.0 <= replay <= 1.0:
    raise ValueError(f"config.stream.replay must be in [0, 1], got {replay}")
  if previous is None:
    if not is_training_time(t, wait):
      raise ValueError(f"t={t} is not a training time for wait={wait}")
    previous = t - wait
  if not 0 <= previous < t:
    raise ValueError(f"a stage at t={t} cannot follow one at t={previous} (the previous stage "
                     "comes before it; 0 for none)")
  new = tuple(range(previous + 1, t + 1))
  past = range(1, previous + 1)
  rng = np.random.default_rng([seed, t])
  replay_train = _replay_sample([stream.train[i - 1] for i in past], replay, rng)
  replay_val = _replay_sample([stream.val[i - 1] for i in past], replay, rng)
  train = np.concatenate([stream.train[i - 1] for i in new] + [replay_train])
  val = np.concatenate([stream.val[i - 1] for i in new] + [replay_val])
  return StageData(t=t, train=train.astype(np.int32), val=val.astype(np.int32),
                   new_megabatches=new, num_replayed=int(len(replay_train)))
