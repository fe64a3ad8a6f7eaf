"""SIGINT/SIGTERM/SIGHUP handling of a run.

SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session; a run started
with `nohup` keeps ignoring it) stop a run at the next safe point: a stage in
progress is abandoned (it is recomputed on resume), a log or checkpoint write
in progress (`Signals.critical()`) is finished first; then `RunInterrupted`
is raised.
While JAX works (`Signals.deferred()`: the stream loop), the handler only
records the signal, since an exception raised from a handler that lands in a
JAX callback or in JAX's dispatch would be swallowed there; the loop stops at
the next step boundary (`Signals.check()`, after every compiled train call).

In a multi-process run (`vote`: `alma_jax.runtime.multihost.Vote`) a process
never stops on its own: the handler only records the signal, and every
`check()` asks all processes whether one of them has a signal, so that they
all stop at the same check, whichever of them the signal reached and when.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable

# The signals that stop a run (SIGHUP where the platform has it).
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                if hasattr(signal, name))


class RunInterrupted(BaseException):
  """SIGINT/SIGTERM/SIGHUP stopped the run; `exit_code` is 128 + the signal number."""

  def __init__(self, signum: int, last_checkpoint: int | None):
    self.signum = signum
    self.last_checkpoint = last_checkpoint
    self.exit_code = 128 + signum
    where = (f"the last checkpoint is t={last_checkpoint}" if last_checkpoint is not None
             else "no checkpoint was written yet")
    super().__init__(f"interrupted by {signal.Signals(signum).name}; {where}")


# Seconds a compilation may still take after a signal before the process exits without waiting
# for it (`on_stop_while_compiling`): a compile is often over sooner, and then the run stops at
# its next check as usual.
COMPILE_GRACE_S = 2.0
_ON_STOP_WHILE_COMPILING: list = []


def on_stop_while_compiling(exit_fn) -> None:
  """Registers `exit_fn(signum, last_checkpoint)`, which ends the process (it must not return),
  for a signal that arrives while XLA compiles: no handler runs until a compile returns, which
  can take minutes, so a watcher thread calls it once `COMPILE_GRACE_S` seconds pass with the
  compile still going. For a command-line run of one process (`alma_jax.main`); a library
  caller's process is never ended this way."""
  _ON_STOP_WHILE_COMPILING[:] = [exit_fn]


# Signals that arrived while `hold_early()` or `catch_early_sigint()` was in force, for the
# run's `Signals` to act on.
_EARLY: list[int] = []


def _handled() -> list[int]:
  """The SIGNALS a run handles: all of them, but SIGHUP when it is ignored (`nohup`: the run
  outlives its terminal)."""
  return [s for s in SIGNALS if not (s == getattr(signal, "SIGHUP", None)
                                     and signal.getsignal(s) == signal.SIG_IGN)]


def hold_early() -> None:
  """Records SIGNALS from now on until a run's `Signals` takes over (and acts on them at its
  first check): for a multi-process run, whose processes must stop together at a check they
  agree on, not one of them at once while the others wait for it."""
  if threading.current_thread() is not threading.main_thread():
    return
  for s in _handled():
    signal.signal(s, lambda signum, frame: _EARLY.append(signum))


def catch_early_sigint() -> None:
  """Until a run's `Signals` takes over, SIGINT raises KeyboardInterrupt as Python's own
  handler does, and is recorded too: one raised where Python ignores exceptions (a garbage
  collector's callback, a `__del__`: "Exception ignored in ...") still stops the run, at its
  first check. For the command line's process; a SIGINT handler other than Python's default
  (the caller's, or SIG_IGN) is left as it is."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
    return

  def handler(signum, frame):
    del frame
    _EARLY.append(signum)
    raise KeyboardInterrupt

  signal.signal(signal.SIGINT, handler)


class Signals:
  """Handlers of `SIGNALS`: raise at once, or after the current `critical()` section."""

  def __init__(self, vote: Callable[[int | None], int | None] | None = None,
               compiling: Callable[[], bool] | None = None):
    """`vote`: the processes' agreement on a pending signal (`multihost.Vote`) in a
    multi-process run; None: this process decides alone. `compiling()`: whether XLA compiles
    now (`alma_jax.engine.meter.Meter.is_compiling`), for `on_stop_while_compiling`."""
    self.vote, self.compiling = vote, compiling
    self._wakeup = None  # (read fd, write fd, the wakeup fd before) of the watcher
    self.pending: int | None = None
    self.last_checkpoint: int | None = None
    self._depth = 0
    self._defer = 0
    self._old = {}

  def __enter__(self) -> "Signals":
    if _EARLY and self.pending is None:  # since `hold_early()` or `catch_early_sigint()`
      self.pending = _EARLY[0]
    _EARLY.clear()  # this run's now
    if threading.current_thread() is threading.main_thread():
      for s in _handled():
        self._old[s] = signal.signal(s, self._handle)
      if self.compiling is not None and self.vote is None and _ON_STOP_WHILE_COMPILING:
        self._watch()
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._old.items():
      signal.signal(s, handler)
    if self._wakeup is not None:
      r, w, before = self._wakeup
      self._wakeup = None
      signal.set_wakeup_fd(before)
      os.close(w)  # the watcher reads the end of the pipe and returns

  def _watch(self) -> None:
    """Starts the watcher: the C-level handler writes each signal's number to a pipe at once,
    even while the main thread is inside a compile."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    self._wakeup = (r, w, signal.set_wakeup_fd(w, warn_on_full_buffer=False))
    exit_fn, compiling = _ON_STOP_WHILE_COMPILING[0], self.compiling

    def watch():
      try:
        while data := os.read(r, 64):
          signums = [b for b in data if b in SIGNALS]
          if not signums or not compiling():
            continue
          deadline = time.monotonic() + COMPILE_GRACE_S
          while compiling() and time.monotonic() < deadline:
            time.sleep(0.05)
          if compiling():
            exit_fn(signums[0], self.last_checkpoint)
      finally:
        os.close(r)

    threading.Thread(target=watch, name="alma_jax-signal-watcher", daemon=True).start()

  def _handle(self, signum, frame) -> None:
    del frame
    if self.pending is None:
      self.pending = signum
    if self._depth == 0 and self._defer == 0 and self.vote is None:
      raise RunInterrupted(self.pending, self.last_checkpoint)

  @contextlib.contextmanager
  def deferred(self):
    """A section (JAX work) where a signal is only recorded; `check()` acts on it."""
    self._defer += 1
    try:
      yield
    finally:
      self._defer -= 1

  def stopping(self) -> bool:
    """Whether a signal asks the run to stop, without raising; in a multi-process run, whether
    one reached any process (a vote: every process asks here)."""
    if self.vote is None:
      return self.pending is not None
    agreed = self.vote(self.pending)  # the processes' decision, whatever arrives meanwhile
    if agreed is not None and self.pending is None:
      self.pending = agreed
    return agreed is not None

  def check(self) -> None:
    """Raises `RunInterrupted` if a signal arrived (a step boundary outside writes); in a
    multi-process run, if one arrived in any process (every process checks here)."""
    if self._depth == 0 and self.stopping():
      raise RunInterrupted(self.pending, self.last_checkpoint)

  @contextlib.contextmanager
  def critical(self, act: bool = True):
    """A section (a write) that a signal does not interrupt; it acts after it (`act` False,
    or a multi-process run: at the next `check()`, e.g. a stage that saves itself before it
    stops)."""
    self._depth += 1
    try:
      yield
    finally:
      self._depth -= 1
    if act and self._depth == 0 and self.pending is not None and self.vote is None:
      raise RunInterrupted(self.pending, self.last_checkpoint)
