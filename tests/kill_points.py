"""Kill points: a run that sends itself a signal at a named point, for crash and resume tests.

The environment variable `ALMA_JAX_TEST_KILL_AT` (a comma-separated list such
as `t=2:checkpoint,summary`) makes the run send itself
`ALMA_JAX_TEST_KILL_SIGNAL` (default SIGKILL) at the named points:

- `t=N:stage`: after stage N has started (its growth done), before it trains;
- `t=N:epoch`: when an epoch of stage N has ended (its observers told);
- `t=N:log`: once every observer has written the record of N (inside the
  record's critical section, so a signal other than SIGKILL acts right after it);
- `t=N:checkpoint`: while the checkpoint of N is being written;
- `t=N:saved`: once that asynchronous write is confirmed complete (at the next
  checkpoint, an interruption or the end of the run);
- `t=N:stage_saved`: once a save of stage N's progress is written;
- `summary`: before summary.json is written.

With `ALMA_JAX_TEST_KILL_PROCESS=i` only process i of a multi-process run is
killed. The points are wrappers that `install()` puts around the run's own
functions; nothing in the package knows of them. The test process installs them
once (`conftest.py`); a run started as a subprocess has them when its
`PYTHONPATH` holds `HOOK_DIR` (whose `sitecustomize` installs them as soon as the
run's module is imported, so that nothing of JAX loads earlier than the run loads
it). The environment is read at each point, so a test sets and clears it around
one run.
"""

from __future__ import annotations

import functools
import os
import signal

HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_hook")
_installed = False


def _kill(point: str, t: int | None = None) -> None:
  spec = os.environ.get("ALMA_JAX_TEST_KILL_AT")
  if not spec or (point if t is None else f"t={t}:{point}") not in spec.split(","):
    return
  only = os.environ.get("ALMA_JAX_TEST_KILL_PROCESS")
  if only:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() != int(only):
      return
  os.kill(os.getpid(), getattr(signal, os.environ.get("ALMA_JAX_TEST_KILL_SIGNAL", "SIGKILL")))


def _after(owner, name: str, when):
  """Wraps `owner.name` so that `when(args, kwargs, result)` runs after it."""
  original = getattr(owner, name)

  @functools.wraps(original)
  def wrapped(*args, **kwargs):
    result = original(*args, **kwargs)
    when(args, kwargs, result)
    return result
  setattr(owner, name, wrapped)


def install() -> None:
  """Puts the kill points around the run's functions (once per process)."""
  global _installed
  if _installed:
    return
  _installed = True
  # pylint: disable=g-import-not-at-top
  from alma_jax.observers import base as observers_base
  from alma_jax.observers import checkpoints as ckpt_obs
  from alma_jax.observers import summary
  from alma_jax.outputs import checkpoint as ckpt_lib
  from alma_jax.outputs import stage_checkpoint
  from alma_jax.stream import run
  # pylint: enable=g-import-not-at-top

  class Last(observers_base.Observer):
    """Told last: the record's and the epoch's points follow every other observer."""

    def on_record(self, state, records) -> None:
      del records
      _kill("log", state.t)

    def on_epoch(self, t, epoch, loss, val_accuracy, ran) -> None:
      del epoch, loss, val_accuracy, ran
      _kill("epoch", t)

  outputs = run._outputs  # pylint: disable=protected-access
  run._outputs = lambda setup, signals, clock, meter, extra: outputs(  # pylint: disable=protected-access
      setup, signals, clock, meter, (*extra, Last()))
  _after(run, "_start_stage", lambda a, kw, r: _kill("stage", a[3][0].t))
  _after(ckpt_lib.Checkpointer, "start_save", lambda a, kw, r: _kill("checkpoint", a[1]))
  _after(stage_checkpoint.Store, "save", lambda a, kw, r: _kill("stage_saved", a[0].t))

  finish = ckpt_obs.Checkpoints.finish

  @functools.wraps(finish)
  def finish_then_kill(self, *args, **kwargs):
    t = self._pending  # pylint: disable=protected-access
    finish(self, *args, **kwargs)
    if t is not None:
      _kill("saved", t)
  ckpt_obs.Checkpoints.finish = finish_then_kill

  on_end = summary.Summary.on_end

  @functools.wraps(on_end)
  def kill_then_summarise(self, state):
    _kill("summary")
    return on_end(self, state)
  summary.Summary.on_end = kill_then_summarise


def env(base: dict | None = None) -> dict:
  """`base` (default: this process's environment) with `HOOK_DIR` and the checkout on
  `PYTHONPATH`, for a run started as a subprocess that may be killed at a point."""
  e = dict(os.environ if base is None else base)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  e["PYTHONPATH"] = os.pathsep.join([HOOK_DIR, root])
  return e
