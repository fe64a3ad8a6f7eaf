"""A run's time and compiled programs, carried across resumes."""

from __future__ import annotations

import json
import time

from alma_jax.engine import timing
from alma_jax.observers.base import Observer
from alma_jax.outputs import checkpoint as ckpt_lib


class Clock(Observer):
  """The run's time breakdown (`timing.Breakdown`), its elapsed time and the programs it
  compiled, each continuing what a resumed run had before its checkpoint.

  Attributes:
    timer: the time breakdown (the loop and the outputs time their parts with it).
    startup_s: seconds the process spent before the run (None: unknown).
  """

  def __init__(self, steps, timer: timing.Breakdown, t_start: float, startup_s: float | None):
    self.steps, self.timer, self.t_start, self.startup_s = steps, timer, t_start, startup_s
    self.elapsed_before = 0.0
    self.compiled_before: set[str] = set()  # programs compiled before a resume

  def elapsed(self) -> float:
    """Seconds the run has taken, before its last resume included."""
    return self.elapsed_before + time.monotonic() - self.t_start

  def compiled(self) -> set[str]:
    """The structures' keys of the step programs compiled so far, before resumes included."""
    return self.compiled_before | {json.dumps(ckpt_lib.structure_to_json(k))
                                   for k in self.steps.compiled}

  def add_compiled(self, names) -> None:
    """Counts programs that a restored part of the run compiled (a stage's save)."""
    self.compiled_before |= set(names)

  def facts(self) -> dict:
    """What a checkpoint keeps of the clock."""
    return {"compiled": sorted(self.compiled()), "elapsed_s": self.elapsed(),
            "timings": self.timer.as_dict()}

  def on_start(self, state, snapshot) -> None:
    if snapshot is not None:
      self.compiled_before = set(snapshot.extra.get("compiled", []))
      self.elapsed_before = float(snapshot.extra.get("elapsed_s", 0.0))
      self.timer.add(snapshot.extra.get("timings", {}))
