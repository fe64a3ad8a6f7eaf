"""The JAX work a pytest session does: traces, lowerings, XLA compiles and kept programs loaded.

A pytest plugin: every process of the session (each xdist worker) counts JAX's
compile-path events and writes them, at its exit, to `$ALMA_JAX_WORK_OUT.<pid>`
(JSON). Then this script adds them up.

    ALMA_JAX_WORK_OUT=/tmp/work PYTHONPATH=benchmarks \\
        python -m pytest -q -n 2 -p jax_work tests/policies/test_plasticity.py
    python benchmarks/jax_work.py /tmp/work

Counts are properties of the programs, not of the machine's speed: they compare two
commits where timings on a drifting host cannot.
"""

import atexit
import collections
import glob
import json
import os
import sys
import threading

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "traces",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings",
           "/jax/core/compile/backend_compile_duration": "backend_compiles"}
_KEPT = "/alma_jax/kept_programs/loaded"  # a kept program loaded (also a backend compile event)


def _install(out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  counts = collections.Counter()
  lock = threading.Lock()  # a run's FLOP counts trace on its background thread too

  def duration(event, seconds, **kwargs):
    del kwargs
    if event in _EVENTS:
      with lock:
        counts[_EVENTS[event]] += 1
        counts[_EVENTS[event] + "_s"] += seconds

  def plain(event, **kwargs):
    del kwargs
    if event == _KEPT:
      with lock:
        counts["kept_loaded"] += 1

  jax.monitoring.register_event_duration_secs_listener(duration)
  jax.monitoring.register_event_listener(plain)
  atexit.register(lambda: _write(f"{out}.{os.getpid()}", counts))


def _write(path: str, counts) -> None:
  with open(path, "w") as f:
    json.dump(dict(counts), f)


def pytest_configure(config):
  del config
  out = os.environ.get("ALMA_JAX_WORK_OUT")
  if out:
    _install(out)


def total(out: str) -> dict:
  """The counts of every process that wrote `out`.<pid>."""
  summed = collections.Counter()
  for path in glob.glob(f"{glob.escape(out)}.*"):
    with open(path) as f:
      summed.update(json.load(f))
  summed["compiled"] = summed["backend_compiles"] - summed["kept_loaded"]
  return dict(summed)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(f"usage: {sys.argv[0]} OUT  (the ALMA_JAX_WORK_OUT of a pytest session)")
  for key, value in sorted(total(sys.argv[1]).items()):
    print(f"{key:22s} {value:.1f}" if isinstance(value, float) else f"{key:22s} {value}")
