"""The mega-batch stream: index arrays into the training split.

The training split is permuted with a seeded generator and cut into B
mega-batches of equal size (`np.array_split` semantics: sizes differ by at
most one); each mega-batch keeps a `val_fraction` of its examples as its own
validation set. Nothing is copied: the stream holds only indices.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Stream:
  """B mega-batches, each a (train indices, validation indices) pair."""

  train: tuple[np.ndarray, ...]
  val: tuple[np.ndarray, ...]

  @property
  def num_megabatches(self) -> int:
    return len(self.train)


def make_stream(num_examples: int, num_megabatches: int, val_fraction: float, seed: int) -> Stream:
  """Partitions `num_examples` training examples into a stream.

  Args:
    num_examples: size of the training split (indices 0 ... num_examples-1).
    num_megabatches: B, the number of mega-batches.
    val_fraction: fraction of each mega-batch held out as its validation set.
    seed: seed of the permutation; the same seed gives the same stream.

  Returns:
    A `Stream` of sorted int32 index arrays.
  """
  if num_megabatches < 1:
    raise ValueError(f"config.stream.num_megabatches must be >= 1, got {num_megabatches}")
  if num_megabatches > num_examples:
    raise ValueError(f"config.stream.num_megabatches={num_megabatches} exceeds the "
                     f"{num_examples} training examples")
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"config.stream.val_fraction must be in (0, 1), got {val_fraction}")
  rng = np.random.default_rng(seed)
  perm = rng.permutation(num_examples).astype(np.int32)
  train, val = [], []
  for chunk in np.array_split(perm, num_megabatches):
    n_val = int(round(val_fraction * len(chunk)))
    n_val = min(max(n_val, 1), len(chunk) - 1) if len(chunk) > 1 else 0
    val.append(np.sort(chunk[:n_val]))
    train.append(np.sort(chunk[n_val:]))
  return Stream(train=tuple(train), val=tuple(val))
