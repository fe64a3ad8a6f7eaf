"""Two processes of one `jax.distributed` run on CPU, coordinated over 127.0.0.1
(alma_jax/runtime/multihost.py, sharding.py, run.py; launch/local.py)."""

import io
import json
import os
import subprocess
import sys

import chex
import jax
import numpy as np

from alma_jax.outputs import io_utils
from tests import kill_points
from tests import multiprocess_worker
from tests.conftest import requires_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import local  # pylint: disable=g-import-not-at-top,wrong-import-position
WALL_TIME_FIELDS = ("wall_s", "timings", "provenance")


def test_both_processes_hold_the_same_parameters_as_one_process(tmp_path):
  port = local.free_port()
  env = dict(os.environ, PYTHONPATH=ROOT)
  procs = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess_worker", str(port), str(i),
                             str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
  held = [dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(2)]
  with jax.enable_x64(True):
    ref, acc, nll = multiprocess_worker.train_stage(1, 1)
  want = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(ref.params)[0]}
  for h in held:
    assert not any(np.isnan(v).any() for v in h.values())  # each holds every parameter
    np.testing.assert_array_equal(h["acc"], held[0]["acc"])
    chex.assert_trees_all_close({k: h[k] for k in want}, want, atol=1e-9, rtol=1e-9)
    np.testing.assert_allclose(h["acc"], acc)
    np.testing.assert_allclose(h["nll"], nll, atol=1e-9, rtol=1e-9)
  for k in want:  # the two processes' copies are the same, bit for bit
    np.testing.assert_array_equal(held[0][k], held[1][k])


def _launch(workdir, cache, kill_at=None, **kill):
  """The two-process run; `kill_at` and `kill` (signal=..., process=...): the kill hook of
  `alma_jax.outputs.interrupts` in its processes."""
  env = kill_points.env()
  for name in ("AT", "SIGNAL", "PROCESS"):
    env.pop(f"ALMA_JAX_TEST_KILL_{name}", None)
  if kill_at:
    env["ALMA_JAX_TEST_KILL_AT"] = kill_at
  env.update({f"ALMA_JAX_TEST_KILL_{k.upper()}": str(v) for k, v in kill.items()})
  out = io.StringIO()
  args = ["--config=configs/mnist_ens.py:smoke", f"--workdir={workdir}",
          "--config.method.num_members=2", "--config.mesh.model=2", "--config.train.epochs=1",
          f"--compilation_cache_dir={cache}"]
  code = local.launch(args, num_processes=2, devices_per_process=2, env=env, out=out)
  return code, out.getvalue()


def _outputs(workdir):
  strip = lambda d: {k: v for k, v in d.items() if k not in WALL_TIME_FIELDS}
  log = [strip(r) for r in io_utils.read_jsonl(os.path.join(workdir, "log.jsonl"))]
  with open(os.path.join(workdir, "summary.json")) as f:
    return log, strip(json.load(f))


@requires_mnist
def test_two_process_run_writes_one_log_and_resumes_after_a_kill(tmp_path):
  cache = tmp_path / "xla"
  code, out = _launch(tmp_path / "whole", cache)
  assert code == 0, out[-5000:]
  assert "process 0 of 2" in out and "process 1 of 2" in out
  assert "mesh {'data': 2, 'model': 2}" in out
  assert out.count("] done: 1 seed(s)") == 2  # both processes finish ...
  # ... and process 0 alone says the progress lines.
  assert out.count("compiling the evaluation (first use") == 1, out[-5000:]
  assert out.count("t=4/4 (100%) epochs=") == 1, out[-5000:]
  names = sorted(n for n in os.listdir(tmp_path / "whole") if not n.startswith("."))
  events = [n for n in names if n.startswith("events.out.tfevents.")]
  assert len(events) == 1  # one writer: process 0
  assert [n for n in names if n not in events] == [
      "architecture.jsonl", "checkpoints", "config.json", "error.png", "log.jsonl",
      "summary.json"]
  log, summary = _outputs(tmp_path / "whole")
  assert [r["t"] for r in log] == [0, 1, 2, 3, 4]  # ... and one of them writes the log, once
  assert len(io_utils.read_jsonl(tmp_path / "whole" / "architecture.jsonl")) == 4
  # SIGTERM reaches process 1 alone, before its stage at t=2: both processes stop at the same
  # check, each with its own message (process 0 is not left waiting in a collective until the
  # launcher kills it).
  wd = tmp_path / "interrupted"
  code, out = _launch(wd, cache, kill_at="t=2:stage", signal="SIGTERM", process=1)
  assert code == 143, out[-5000:]
  for i in (0, 1):
    assert f"[{i}] alma_jax: error: interrupted by SIGTERM; the last checkpoint is t=1" in out, (
        out[-5000:])
  assert "SIGKILL" not in out and "did not stop" not in out, out[-5000:]
  assert [r["t"] for r in io_utils.read_jsonl(wd / "log.jsonl")] == [0, 1]
  # Both resume from t=1 and kill themselves once the checkpoint of t=2 is written (the
  # asynchronous write is confirmed when t=3 saves, after logging t=3) ...
  code, out = _launch(wd, cache, kill_at="t=2:saved")
  assert code == 137, out[-5000:]
  assert out.count("resuming") == 2, out[-5000:]
  assert [r["t"] for r in io_utils.read_jsonl(wd / "log.jsonl")] == [0, 1, 2, 3]
  # ... and both resume again, to the outputs of the uninterrupted run.
  code, out = _launch(wd, cache)
  assert code == 0, out[-5000:]
  assert out.count("resuming") == 2, out[-5000:]
  assert _outputs(wd) == (log, summary)
