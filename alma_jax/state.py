"""The state of a run, as immutable pytrees and records that the code rebinds, never mutates.

From the inside out: a `Learner` (parameters, model state, static structure),
the `TrainState` a train step updates, the early stopping of a stage
(`StopState`), what a finished stage reports (`StageStats`), and the
`RunState` the stream loop carries from one time step to the next. This
module depends on no other module of the package, so every layer can name
these types.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import jax
import numpy as np
from flax import struct

PyTree = Any
NO_BEST = -1.0  # `StopState.best_score` of a unit with no best epoch yet


@struct.dataclass
class Learner:
  """The learner's state: a pytree with a static structure descriptor.

  Attributes:
    params: the model parameters (for stacked members, a leading axis).
    model_state: non-trained collections, e.g. `{"batch_stats": ...}`.
    structure: hashable static description of the architecture (number of
      members, gating trees, ...). Compiled steps are cached per structure, so
      a recompilation happens only when growth changes it.
  """

  params: PyTree
  model_state: PyTree
  structure: Hashable = struct.field(pytree_node=False, default=())


@struct.dataclass
class TrainState:
  """What a train step updates: trainable params, optimizer and model state (and frozen params).

  `anchor` (None unless the loss pulls the parameters toward it, `train.l2_init`): the
  trainable part of the run's initial parameters, passed through unchanged.
  """

  trainable: PyTree
  frozen: PyTree
  model_state: PyTree
  opt_state: PyTree
  anchor: PyTree = None


@struct.dataclass
class StopState:
  """Each member's early stopping within a stage (arrays of length S; scores (S, U))."""

  best_score: Any  # float32 (S, U): each selection unit's best validation score, or NO_BEST
  best_epoch: Any  # int32: the epoch of the last improvement (0: none in this stage)
  since_best: Any  # int32: epochs trained since then
  epochs_run: Any  # int32: the last epoch the member trained in
  steps_run: Any  # int32: train steps the member took in the stage
  active: Any  # bool: the member still trains
  diverged: Any  # bool: the member's loss or parameters became non-finite

  @classmethod
  def start(cls, num: int, units: int) -> "StopState":
    zeros = np.zeros(num, np.int32)
    return cls(np.full((num, units), NO_BEST, np.float32), zeros, zeros, zeros, zeros,
               np.ones(num, bool), np.zeros(num, bool))

  def to_host(self) -> "StopState":
    return jax.tree.map(np.asarray, jax.device_get(self))

  def as_lists(self) -> dict:
    """The fields as lists (a stage save's position)."""
    return {f.name: np.asarray(getattr(self, f.name)).tolist() for f in dataclasses.fields(self)}

  @classmethod
  def from_lists(cls, lists: dict, like: "StopState") -> "StopState":
    return cls(**{f.name: np.asarray(lists[f.name], np.asarray(getattr(like, f.name)).dtype)
                  .reshape(np.shape(getattr(like, f.name))) for f in dataclasses.fields(cls)})


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


@dataclasses.dataclass(frozen=True)
class RunState:
  """The state of Algorithm 1 after time step `t`, for a population of S learners (seeds).

  Attributes:
    logs: each seed's records so far, t = 0 ... `t`.
    learner: the learners, stacked (S, ...) (None before the stream starts).
    opt_state: their optimizer state after the last stage, stacked (None: the next stage
      starts a fresh one).
    errors: each seed's test error of `learner` (None: not evaluated yet).
    nll: each seed's mean test NLL of `learner` (the task's record fields come from it).
    stats: the stage trained at time step `t` (None: the learner did not train at `t`).
    policy_memo: each seed's memory of the stage policy (`alma_jax.policies.Started.memo`),
      or None (it remembers nothing, or no stage has started yet).
  """

  logs: list  # of `alma_jax.engine.metrics.Log`
  learner: Learner | None = None
  opt_state: Any = None
  errors: np.ndarray | None = None
  nll: np.ndarray | None = None
  stats: StageStats | None = None
  policy_memo: tuple | None = None

  @property
  def t(self) -> int:
    """The last time step recorded (-1: none yet)."""
    return len(self.logs[0].records) - 1

  @property
  def trained(self) -> bool:
    """Whether the learner trained at time step `t`."""
    return self.stats is not None

  @property
  def num_stages(self) -> int:
    """The training stages up to time step `t`."""
    return sum(r.trained for r in self.logs[0].records)

  @property
  def last_stage_t(self) -> int:
    """The time step of the last training stage (0: none yet)."""
    return max([0] + [r.t for r in self.logs[0].records if r.trained])
