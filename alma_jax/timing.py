"""Where a run's wall time goes: start-up, data, compilation, train, eval, I/O.

JAX reports the time it spends tracing, lowering and compiling through
`jax.monitoring`; `compile_seconds()` is the running total of those events in
this process. A `Breakdown` adds the time spent inside a `with` block to one
part, less the compilation inside it, which goes to `compile_s`, so the parts
never count the same second twice.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from jax import monitoring

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
PARTS = ("data_s", "compile_s", "train_s", "eval_s", "io_s")

_lock = threading.Lock()
_compile_total = 0.0


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  del kwargs
  global _compile_total
  if event in COMPILE_EVENTS:
    with _lock:
      _compile_total += duration_secs


monitoring.register_event_duration_secs_listener(_listener)


def compile_seconds() -> float:
  """Seconds this process has spent tracing, lowering and compiling so far."""
  return _compile_total


def process_age_s() -> float | None:
  """Seconds since this process started (Linux), else None."""
  try:
    with open("/proc/self/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return None


class Breakdown:
  """The parts of a run's wall time, in seconds.

  `with breakdown("train_s"): ...` adds the block's wall time to a part, less
  the compilation inside the block; compilation is counted process-wide
  (inside blocks or not) from the breakdown's creation, as `compile_s`.
  """

  def __init__(self):
    self._parts = {p: 0.0 for p in PARTS}
    self._compile_start = compile_seconds()

  @contextlib.contextmanager
  def __call__(self, part: str):
    if part not in self._parts or part == "compile_s":
      raise ValueError(f"unknown timing part {part!r}; valid parts: {PARTS[:1] + PARTS[2:]}")
    t0, c0 = time.monotonic(), compile_seconds()
    try:
      yield
    finally:
      dt, dc = time.monotonic() - t0, compile_seconds() - c0
      self._parts[part] += max(0.0, dt - dc)

  def add(self, parts: dict[str, float]) -> None:
    """Adds seconds measured elsewhere (a stage, or a resumed run's past)."""
    for p, v in parts.items():
      if p in self._parts:
        self._parts[p] += float(v)

  def as_dict(self) -> dict[str, float]:
    out = dict(self._parts)
    out["compile_s"] += compile_seconds() - self._compile_start
    return out

  def report(self, wall_s: float, startup_s: float | None) -> dict[str, float]:
    """The parts for a run's summary: `other_s` is what none of them covers in
    `wall_s` (FLOP counting, growth, Python between steps); `startup_s`
    (before the run began) is reported on its own."""
    out = self.as_dict()
    out["other_s"] = max(0.0, wall_s - sum(out[p] for p in PARTS))
    if startup_s is not None:
      out["startup_s"] = startup_s
    return out
