"""A run's progress lines: what is compiled and why, a running line with speed and ETAs, a
heartbeat.

`Meter` is told what the run does (`doing`), when a program starts and ends
compiling (`compiling`, `compiled`), when a training stage starts and ends
and how far its train calls got (`stage_start`, `trained`, `stage_end`).
It logs

- before each compilation, what is compiled and why (first use of a kind of
  program, a new structure or slot count after growth, a new population);
- during a stage, at most every `every_s` seconds, a running line: t/B with
  the percentage of the stream, the stage's epoch and step, examples/s (tokens/s
  for text) and the ETA of the stage and of the run, both from the speed
  measured between the last lines (compilation excluded);
- a heartbeat, from a thread, whenever nothing was said for `heartbeat_s`
  seconds (a long compilation, a long evaluation), naming what the run does.

The ETAs count train steps: the rest of the stage and the stages the waiting
policy plans after it, each of the epochs that the finished stages ran on
average (all of them before a stage has finished; early stopping shortens
stages), at the seconds per step measured last (between train calls) and the
seconds an epoch's evaluation took (between its last train call and its end);
the run's ETA adds, for each
time step left, the mean time a time step spent outside its stage so far
(the test evaluation, the outputs). Levels (`config.log.progress`):
`full` says all of it, `stage` only a line per training stage
(`alma_jax.observers.progress`), `off` none of these lines. Only the process
that writes the outputs speaks (process 0 of a multi-process run). The meter
reads the time through `now`, so that tests can drive it with a fake clock.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Callable

import numpy as np
from absl import logging

LEVELS = ("off", "stage", "full")
HEARTBEAT_MIN_S = 5.0  # the heartbeat's least period
HEARTBEAT_AFTER_S = 5.0  # the heartbeat waits this long past a due running line
SPEED_HALF_LIFE_S = 30.0  # older measurements of the speed count half after this long


def duration(seconds: float) -> str:
  """A short duration: 42s, 3m05s, 2h10m, 1d04h; <1s for some time under a second (0s: none)."""
  if not math.isfinite(seconds):
    return "?"
  if 0.0 < seconds < 0.5:
    return "<1s"
  s = int(round(max(0.0, seconds)))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  if s < 86400:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  return f"{s // 86400}d{s % 86400 // 3600:02d}h"


@dataclasses.dataclass
class Plan:
  """What the ETAs count on.

  Attributes:
    num_t: B, the last time step.
    stages: the planned training times -> train steps per epoch of their stage.
    epochs: epochs per stage (`config.train.epochs`).
    examples_per_step: examples one train step takes (every seed's together).
    unit: what examples/s counts ("examples", or "tokens" for text).
    unit_per_example: units in one example (text: tokens per sequence).
  """

  num_t: int
  stages: dict[int, int]
  epochs: int
  examples_per_step: int
  unit: str = "examples"
  unit_per_example: int = 1


def epoch_line(t: int, epoch: int, epochs: int, losses, acc, best_acc, stop) -> str:
  """A stage's line for an epoch of S members (`acc` (S,), `best_acc` (S, units) as reported,
  `stop` the `StopState`): one member's numbers, or the seeds' mean and how many train."""
  head = f"  t={t} epoch {epoch}/{epochs} loss={np.mean(losses):.4f}"
  if len(acc) == 1:
    return (f"{head} val_acc={acc[0]:.4f} best={np.max(best_acc[0]):.4f}@"
            f"{stop.best_epoch[0]}")
  return (f"{head} val_acc={np.mean(acc):.4f} (mean of {len(acc)} seeds, "
          f"{int(stop.active.sum())} training)")


class Meter:
  """The progress lines of one run (see the module's docstring)."""

  def __init__(self, level: str = "full", *, every_s: float = 10.0, primary: bool = True,
               heartbeat_s: float | None = None, now: Callable[[], float] = time.monotonic,
               say: Callable[[str], None] | None = None):
    if level not in LEVELS:
      raise ValueError(f"progress level {level!r} is unknown; valid levels: {list(LEVELS)}")
    self.level = level if primary else "off"
    self.every_s = float(every_s)
    self.heartbeat_s = (max(self.every_s, HEARTBEAT_MIN_S) + HEARTBEAT_AFTER_S
                        if heartbeat_s is None else float(heartbeat_s))
    self.now = now
    self._say = say or (lambda msg: logging.info("%s", msg))
    self._lock = threading.RLock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.plan: Plan | None = None
    self.t = 0
    self.last_said = now()  # any line
    self._last_running = now()  # the last running or epoch line (they measure the speed)
    self.activity, self.activity_since = "starting", now()
    self._before_compile: tuple[str, float] | None = None
    self.compile_s = 0.0  # seconds compiling, as timed by `compiled`
    self.seconds_per_step: float | None = None  # train calls only
    self.seconds_per_epoch: float | None = None  # an epoch's time besides its steps (validation)
    self._epoch_done_at: tuple[float, float] | None = None  # (time, compile_s)
    self._epochs_run: list[float] = []  # epochs each finished stage ran (its longest seed)
    self._stage: dict | None = None  # the stage in progress
    self._mark = (now(), 0.0, 0)  # (time, compile_s, steps) of the last measurement
    self._steps = 0  # train steps so far (this process)
    self._step_mark: tuple[float, float, float] | None = None  # (time, compile_s, stage s)
    self._outside: list[float] = []  # seconds each time step spent outside its stage
    self._stage_began = 0.0
    self._epoch_line_at = now()  # the last epoch line, or the stage's start
    self._last_stage_t = -1

  # -- what is said ----------------------------------------------------------------------------
  @property
  def full(self) -> bool:
    return self.level == "full"

  @property
  def stages(self) -> bool:
    """Whether a line per training stage is said."""
    return self.level != "off"

  def say(self, msg: str, *, level: str = "full") -> None:
    """Logs `msg` when the meter's level includes `level` ("stage" or "full")."""
    if self.level == "off" or (level == "full" and not self.full):
      return
    with self._lock:
      self.last_said = self.now()
      self._say(msg)

  # -- what the run does -----------------------------------------------------------------------
  def doing(self, activity: str) -> None:
    """The run now does `activity` (what the heartbeat names)."""
    with self._lock:
      self.activity, self.activity_since = activity, self.now()

  def compiling(self, what: str, why: str) -> None:
    """A program is about to compile: says what and why; the heartbeat names it meanwhile."""
    with self._lock:
      self._before_compile = (self.activity, self.activity_since)
      self.doing(f"compiling {what} ({why})")
    self.say(f"compiling {what} ({why})")

  def is_compiling(self) -> bool:
    """Whether a program announced by `compiling` is compiling now."""
    return self._before_compile is not None

  def compiled(self, what: str, seconds: float) -> None:
    """The program announced last compiled (and ran once) in `seconds`."""
    with self._lock:
      self.compile_s += seconds
      if self._before_compile is not None:
        self.activity, self.activity_since = self._before_compile
        self._before_compile = None
    if seconds >= 1.0:
      self.say(f"compiled {what} in {seconds:.1f}s")

  # -- training --------------------------------------------------------------------------------
  def at(self, t: int) -> None:
    """The stream reached time step `t`: measures the time the previous step spent outside
    its training stage (evaluation, outputs), compilation excluded."""
    with self._lock:
      now = self.now()
      if self._step_mark is not None:
        t0, c0, in_stage = self._step_mark
        self._outside.append(max(0.0, now - t0 - (self.compile_s - c0) - in_stage))
      self._step_mark = (now, self.compile_s, 0.0)
      self.t = t

  def stage_start(self, t: int, epochs: int, steps_per_epoch: int) -> None:
    """A training stage at `t` starts: `epochs` epochs of `steps_per_epoch` train steps."""
    with self._lock:
      self.t = t
      self._stage = {"t": t, "epochs": int(epochs), "steps_per_epoch": max(1, int(steps_per_epoch)),
                     "epoch": 1, "step": 0}
      self._mark = (self.now(), self.compile_s, self._steps)
      self._stage_began = self._mark[0] - self.compile_s
      self._epoch_line_at = self._mark[0]
      self.doing(f"training the stage at t={t}")

  def trained(self, epoch: int, step: int, steps: int, last: bool = False) -> None:
    """`steps` more train steps are done; the stage is at `step` steps into epoch `epoch`.

    When a running line is due (`every_s` > 0 and that long since the last line) and this
    is not the epoch's last call (`last`: the epoch's own line follows), the speed is
    measured and the line said.
    """
    with self._lock:
      self._steps += steps
      if self._stage is not None:
        self._stage.update(epoch=epoch, step=step)
      due = (self.full and not last and self.every_s > 0
             and self.now() - self._last_running >= self.every_s)
      if last:
        self._measure()
        self._epoch_done_at = (self.now(), self.compile_s)
    if due:
      self._measure()
      self._last_running = self.now()
      self.say(self.running())

  def epoch_end(self, line: Callable[[], str]) -> None:
    """An epoch ended and was evaluated: measures the time since its last train call, and
    says the stage's epoch line (`line()`) with the running fields when one is due (at most
    every `every_s` seconds since the stage's start or its last epoch line)."""
    with self._lock:
      now = self.now()
      line = line() if now - self._epoch_line_at >= self.every_s else None
      if line is not None:
        self._epoch_line_at = now
      if self._epoch_done_at is not None:
        t0, c0 = self._epoch_done_at
        extra = max(0.0, now - t0 - (self.compile_s - c0))
        self.seconds_per_epoch = (extra if self.seconds_per_epoch is None
                                  else 0.5 * (self.seconds_per_epoch + extra))
        self._epoch_done_at = None
      self._mark = (now, self.compile_s, self._steps)  # the next steps' time starts here
      if self._stage is not None:  # the next epoch is where the stage is
        self._stage.update(epoch=self._stage["epoch"] + 1, step=0)
      if line is not None:
        self._last_running = now
    if line is not None:
      self.say(f"{line} {self.fields()}")

  def stage_end(self, epochs_run: float) -> None:
    """The stage ended after `epochs_run` epochs (its longest seed's)."""
    with self._lock:
      self._epochs_run.append(float(epochs_run))
      if self._stage is not None:
        self._last_stage_t = self._stage["t"]
      self._stage = None
      if self._step_mark is not None:  # the stage's time, compilation excluded
        t0, c0, in_stage = self._step_mark
        self._step_mark = (t0, c0, in_stage + self.now() - self.compile_s - self._stage_began)
      self.doing(f"after the stage at t={self.t}")

  def _measure(self) -> None:
    """Updates the seconds per step from the steps and time since the last measurement."""
    with self._lock:
      now = self.now()
      t0, c0, s0 = self._mark
      steps, dt = self._steps - s0, now - t0 - (self.compile_s - c0)
      if steps <= 0:
        return
      self._mark = (now, self.compile_s, self._steps)
      if dt <= 0:
        return
      rate = dt / steps
      if self.seconds_per_step is None:
        self.seconds_per_step = rate
      else:  # recent measurements weigh more; a long interval outweighs a short one
        w = 1.0 - 0.5 ** (dt / SPEED_HALF_LIFE_S)
        self.seconds_per_step += w * (rate - self.seconds_per_step)

  # -- the numbers -----------------------------------------------------------------------------
  def expected_epochs(self) -> float:
    """Epochs a stage is expected to run: the mean of the finished stages (all before one)."""
    epochs = self.plan.epochs if self.plan else (self._stage or {}).get("epochs", 1)
    if not self._epochs_run:
      return float(epochs)
    return min(float(epochs), sum(self._epochs_run) / len(self._epochs_run))

  def stage_left(self) -> tuple[float, float]:
    """(train steps, epochs) the stage in progress is expected still to take ((0, 0)
    between stages); the epoch in progress counts."""
    st = self._stage
    if st is None or st["epoch"] > st["epochs"]:  # (after its last epoch)
      return 0.0, 0.0
    spe = st["steps_per_epoch"]
    done = (st["epoch"] - 1) * spe + st["step"]
    expected = min(self.expected_epochs(), st["epochs"])
    steps = max(expected * spe - done, spe - st["step"], 0.0)
    return steps, max(expected - st["epoch"] + 1, 1.0)

  def run_left(self) -> tuple[float, float]:
    """(train steps, epochs) the run is expected still to take: the stage in progress and
    the stages planned after it."""
    steps, epochs = self.stage_left()
    if self.plan is not None:
      if self._stage is not None:
        after = self._stage["t"]
      else:  # the stage at t is still to come unless it has run
        after = self.t if self._last_stage_t == self.t else self.t - 1
      later = [spe for t, spe in self.plan.stages.items() if t > after]
      steps += sum(later) * self.expected_epochs()
      epochs += len(later) * self.expected_epochs()
    return steps, epochs

  def eta(self, steps: float, epochs: float = 0.0) -> float:
    """Seconds that `steps` train steps and the evaluations of `epochs` epochs take at the
    measured speed (nan: not measured)."""
    if not steps:
      return 0.0
    if not self.seconds_per_step:
      return math.nan
    return steps * self.seconds_per_step + epochs * (self.seconds_per_epoch or 0.0)

  def run_eta(self) -> float:
    """Seconds the run is expected still to take: its stages, and the time steps after
    this one at the mean time a step spent outside its stage (evaluation, outputs)."""
    outside = 0.0
    if self.plan is not None and self._outside:
      outside = (self.plan.num_t - self.t) * sum(self._outside) / len(self._outside)
    return self.eta(*self.run_left()) + outside

  def speed(self) -> str:
    """The measured speed, e.g. '1,234 examples/s' ('' before a measurement)."""
    if not self.seconds_per_step or self.plan is None:
      return ""
    per_s = self.plan.examples_per_step * self.plan.unit_per_example / self.seconds_per_step
    return f"{per_s:,.0f} {self.plan.unit}/s"

  def position(self) -> str:
    """t/B with the percentage of the stream, e.g. 't=3/10 (30%)'."""
    num_t = self.plan.num_t if self.plan else 0
    pct = f" ({100.0 * self.t / num_t:.0f}%)" if num_t else ""
    return f"t={self.t}/{num_t}{pct}"

  def fields(self) -> str:
    """The running fields: speed and ETAs of the stage and the run."""
    parts = [self.speed()]
    with self._lock:
      if self._stage is not None:
        parts.append(f"stage_eta={duration(self.eta(*self.stage_left()))}")
      parts.append(f"run_eta={duration(self.run_eta())}")
    return " ".join(p for p in parts if p)

  def running(self) -> str:
    """The running line: where the stream and the stage are, speed and ETAs."""
    with self._lock:
      st = self._stage
      where = self.position()
      if st is not None:
        if st["epochs"] > 1:
          where += f" epoch {st['epoch']}/{st['epochs']}"
        where += f" step {st['step']}/{st['steps_per_epoch']}"
      return f"  {where} {self.fields()}"

  # -- the heartbeat ---------------------------------------------------------------------------
  def beat(self) -> None:
    """Says what the run does when nothing was said for `heartbeat_s` seconds."""
    if not self.full:
      return
    with self._lock:
      now = self.now()
      if now - self.last_said < self.heartbeat_s:
        return
      line = f"  ... {self.activity} ({duration(now - self.activity_since)})"
      if self._stage is not None and not self.activity.startswith("compiling"):
        line = self.running()
      elif self.plan is not None:
        line += f"; {self.position()}"
    self.say(line)

  def start(self) -> "Meter":
    """Starts the heartbeat thread (level full only)."""
    if self.full and self._thread is None:
      self._thread = threading.Thread(target=self._beats, name="alma_jax-progress", daemon=True)
      self._thread.start()
    return self

  def _beats(self) -> None:
    period = min(1.0, self.heartbeat_s / 4)
    while not self._stop.wait(period):
      try:
        self.beat()
      except Exception as e:  # pylint: disable=broad-except  (a log line must not stop the run)
        logging.warning("progress heartbeat stopped: %s", e)
        return

  def close(self) -> None:
    """Stops the heartbeat thread."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
