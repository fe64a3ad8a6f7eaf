"""Work that the run needs later, done meanwhile on one background thread.

A run's FLOP counts (`alma_jax.engine.accounting`) are traces in Python that build no
program: the records need them only when a stage has trained. `later(fn, *args)` starts
`fn(*args)` on this process's background thread (in order of submission, one at a time,
in a copy of the caller's context variables) and returns a `Pending`, whose `result()`
waits for it. While the run's own thread compiles or waits for a device (which release
Python's lock), the counting goes on.

The thread is a daemon: a process that ends (a finished run, a signal) does not wait for
it, and whatever it was computing is not needed any more. An exception of `fn` is raised
again by `result()`, in the caller's thread.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Any, Callable

_queue: queue.SimpleQueue = queue.SimpleQueue()
_lock = threading.Lock()
_worker: threading.Thread | None = None


class Pending:
  """The value of `fn(*args)`, computed on the background thread."""

  def __init__(self, fn: Callable, args: tuple):
    self._fn, self._args = fn, args
    self._context = contextvars.copy_context()
    self._done = threading.Event()
    self._value: Any = None
    self._error: BaseException | None = None

  def _run(self) -> None:
    try:
      self._value = self._context.run(self._fn, *self._args)
    except BaseException as e:  # pylint: disable=broad-exception-caught  (raised by `result`)
      self._error = e
    finally:
      self._fn = self._args = self._context = None  # nothing kept alive once done
      self._done.set()

  def done(self) -> bool:
    return self._done.is_set()

  def result(self) -> Any:
    """The value, once computed (waits for it); raises what `fn` raised."""
    self._done.wait()
    if self._error is not None:
      raise self._error
    return self._value


def later(fn: Callable, *args) -> Pending:
  """`fn(*args)` on the background thread, after everything submitted before it."""
  global _worker
  pending = Pending(fn, args)
  with _lock:
    if _worker is None or not _worker.is_alive():
      _worker = threading.Thread(target=_serve, name="alma_jax-background", daemon=True)
      _worker.start()
    _queue.put(pending)
  return pending


def _serve() -> None:
  while True:
    _queue.get()._run()  # pylint: disable=protected-access


def value(x: Any) -> Any:
  """`x`, or its result when it is `Pending`."""
  return x.result() if isinstance(x, Pending) else x
