"""What the stream loop carries from one time step to the next."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from alma_jax.core.metrics import Log
from alma_jax.core.train import StageStats
from alma_jax.methods.base import Learner


@dataclasses.dataclass
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
  """

  logs: list[Log]
  learner: Learner | None = None
  opt_state: Any = None
  errors: np.ndarray | None = None
  nll: np.ndarray | None = None
  stats: StageStats | None = None

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
