"""Where a run's wall time goes: start-up, data, compilation, train, eval, I/O.

JAX reports the time it spends tracing, lowering and compiling through
`jax.monitoring`; `compile_seconds()` is the running total of those events in
this process. A `Breakdown` adds the time spent inside a `with` block to one
part, less the compilation inside it, which goes to `compile_s`, so the parts
never count the same second twice.

Tracing to count a computation's operations (the FLOPs of
`alma_jax.engine.accounting`, inside `counting()`) builds no program: its
seconds are not compilation (they stay in `other_s`).

The same events count compiled programs: every XLA executable the process
builds or loads from the persistent compilation cache (`xla_programs`,
eager operations included), those of the run's steps (`step_programs`:
programs whose function is named `STEP_PREFIX` + kind, see
`alma_jax.engine.programs`), the persistent cache's requests and hits, and the
programs a run loaded whole without tracing them (`kept_programs_loaded`,
`alma_jax.runtime.executables`; each also counts as a cache request and hit).
`seconds_per_step` times a compiled train call.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax import monitoring

from alma_jax.models import slots

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "compile_cache_requests",
                "/jax/compilation_cache/cache_hits": "compile_cache_hits",
                # a program loaded whole, without tracing (`alma_jax.runtime.executables`)
                "/alma_jax/kept_programs/loaded": "kept_programs_loaded"}
STEP_PREFIX = "alma_step_"
PARTS = ("data_s", "compile_s", "train_s", "eval_s", "io_s")
COUNTS = ("xla_programs", "step_programs", "compile_cache_requests", "compile_cache_hits",
          "kept_programs_loaded")

_lock = threading.Lock()
_compile_total = 0.0
_counts: collections.Counter = collections.Counter()
_thread = threading.local()


@contextlib.contextmanager
def counting():
  """A block whose traces count operations (FLOP accounting) rather than build programs."""
  before = counting_now()
  _thread.counting = True
  try:
    yield
  finally:
    _thread.counting = before


def counting_now() -> bool:
  """Whether this thread is inside `counting()`."""
  return getattr(_thread, "counting", False)


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  global _compile_total
  if event in COMPILE_EVENTS and not counting_now():
    with _lock:
      _compile_total += duration_secs
      if event == BACKEND_COMPILE:  # one per executable built or loaded from the cache
        _counts["xla_programs"] += 1
        if STEP_PREFIX in str(kwargs.get("fun_name", "")):  # e.g. "jit(alma_step_train)"
          _counts["step_programs"] += 1


def _event_listener(event: str, **kwargs) -> None:
  del kwargs
  if event in CACHE_EVENTS:
    with _lock:
      _counts[CACHE_EVENTS[event]] += 1


monitoring.register_event_duration_secs_listener(_listener)
monitoring.register_event_listener(_event_listener)


def compile_counts() -> dict[str, int]:
  """Running totals of this process: XLA programs, step programs, persistent-cache
  requests and hits."""
  with _lock:
    return {k: int(_counts[k]) for k in COUNTS}


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
    self._counts_start = compile_counts()

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
    out.update(self.counts())
    return out

  def counts(self) -> dict[str, float]:
    """Programs compiled (or loaded) since the breakdown's creation, in this process, and
    the persistent compilation cache's hit rate (`compile_cache_hit_rate`; 0 without
    requests)."""
    now = compile_counts()
    out = {k: float(now[k] - self._counts_start[k]) for k in COUNTS}
    requests = out["compile_cache_requests"]
    out["compile_cache_hit_rate"] = out["compile_cache_hits"] / requests if requests else 0.0
    return out


# A timed group runs calls for at least this long: a step of a few milliseconds timed alone
# is mostly the noise of the host (the choices of `alma_jax.tuning.autotune` rest on these).
MIN_TIMED_S = 0.05


def alternate(calls: dict[Any, Callable[[], Any]], rounds: int,
              min_group_s: float = MIN_TIMED_S) -> dict[Any, float]:
  """Seconds per call of each of `calls` ({name: call}; a call returns what to wait for),
  timed against each other.

  Each call first runs once untimed (it compiles) and once timed, which sets its group: n
  calls lasting at least `min_group_s`. Then `rounds` rounds time one group of every call in
  turn (in reverse order every other round), and each call's figure is its median over the
  rounds, per call. Timed in turns, a host whose speed drifts (by 10-20% within minutes on a
  shared 2-core machine) slows every candidate alike instead of the one it happens to time.
  """
  sizes: dict[Any, int] = {}
  for name, call in calls.items():
    jax.block_until_ready(call())  # compiles
    t0 = time.monotonic()
    jax.block_until_ready(call())
    sizes[name] = max(1, math.ceil(min_group_s / max(time.monotonic() - t0, 1e-6)))
  times: dict[Any, list[float]] = {name: [] for name in calls}
  order = list(calls)
  for r in range(rounds):
    for name in (order if r % 2 == 0 else order[::-1]):
      call, n = calls[name], sizes[name]
      t0 = time.monotonic()
      for _ in range(n):
        out = call()
      jax.block_until_ready(out)
      times[name].append((time.monotonic() - t0) / n)
  return {name: float(np.median(t)) for name, t in times.items()}


def eval_call(programs: Any, learner: Any) -> tuple[Callable[[], Any], int]:
  """(a call of the compiled evaluation of a stacked `learner` on a batch of dummy indices,
  the examples one call evaluates)."""
  batch = programs.timing_eval_batch(slots.leading_size(learner.params))
  fn = programs.eval_fn(learner, False, batch)
  return (lambda: fn(learner.params, learner.model_state, programs.data, batch),
          programs.eval_batch_size)


def step_call(programs: Any, learner: Any) -> tuple[Callable[[], Any], int]:
  """(a call of the compiled train call of a stacked `learner` on dummy indices, which
  leaves `learner` untouched, the train steps one call runs).

  `programs`: the run's `alma_jax.engine.programs.Programs`.
  """
  num = slots.leading_size(learner.params)
  batch = programs.timing_batch(num, programs.method.num_data_orders(learner.structure))
  # The keys' values do not matter to a timing: made on the host, they build no program.
  data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  keys = jax.random.wrap_key_data(np.zeros((num,) + data.shape, data.dtype))
  box = {"state": programs.init_state(learner), "counter": 0}

  def call():
    box["state"], losses, _ = programs.train_call(learner.structure, box["state"], batch, keys,
                                                  np.uint32(box["counter"]))
    box["counter"] += 1
    return losses

  return call, programs.steps_per_call


def seconds_per_step(programs: Any, learner: Any, repeats: int = 3) -> float:
  """Times the compiled train call of a stacked `learner` (`step_call`), per step: the median
  of `repeats` timed groups of calls after the one that compiles (`alternate`)."""
  call, steps = step_call(programs, learner)
  return alternate({0: call}, repeats)[0] / steps
