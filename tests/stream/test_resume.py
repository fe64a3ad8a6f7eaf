"""Killed or interrupted runs resume to the same outputs (alma_jax/stream/run.py, observers/, io_utils.py).

The runs are killed at the points of `tests/kill_points.py`: the environment
variable ALMA_JAX_TEST_KILL_AT names the point at which the process sends
itself ALMA_JAX_TEST_KILL_SIGNAL (SIGKILL by default).
"""

import os
import signal
import subprocess
import sys

import pytest

from alma_jax.configuration import config_lib
from alma_jax.observers import checkpoints
from alma_jax.outputs import checkpoint
from alma_jax.outputs import io_utils
from alma_jax.stream import run
from tests import helpers
from tests import kill_points
from tests.conftest import requires_mnist

ROOT = helpers.ROOT
# progress_every_s=0 reports (and reaches the `epoch` hook) after every epoch.
ARGS = ["--config=configs/mnist_sm.py:smoke", "--config.mesh.num_devices=1",
        "--config.train.progress_every_s=0", helpers.NO_FIGURE]






def _main(wd, kill_at=None, sig="SIGKILL", extra=()):
  env = kill_points.env()
  env.pop("ALMA_JAX_TEST_KILL_AT", None)
  if kill_at:
    env.update(ALMA_JAX_TEST_KILL_AT=kill_at, ALMA_JAX_TEST_KILL_SIGNAL=sig)
  return subprocess.run([sys.executable, "-m", "alma_jax.main", f"--workdir={wd}", *ARGS, *extra],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("uninterrupted"))
  proc = _main(wd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return helpers.outputs(wd)


# -- the JSON-lines log ------------------------------------------------------------------------------
def test_torn_log_line_is_ignored_and_cut_before_the_next_append(tmp_path):
  path = str(tmp_path / "log.jsonl")
  io_utils.append_jsonl(path, {"t": 0})
  with open(path, "a") as f:
    f.write('{"t": 1, "test_err')  # a crash in the middle of a write
  assert io_utils.read_jsonl(path) == [{"t": 0}]
  io_utils.append_jsonl(path, {"t": 1})
  assert io_utils.read_jsonl(path) == [{"t": 0}, {"t": 1}]
  io_utils.write_jsonl_atomic(path, [{"t": 5}])
  with open(path) as f:
    assert f.read() == '{"t": 5}\n'


# -- SIGKILL at several points, SIGTERM, then resume -----------------------------------------------
@requires_mnist
def test_killed_runs_resume_to_identical_outputs(baseline, tmp_path):
  assert [a["t"] for a in baseline[2]] == [1, 2, 3, 4]  # one architecture line per stage
  wd = str(tmp_path / "wd")
  ckpt_dir = os.path.join(wd, "checkpoints")
  # 1. killed after the record of t=1 is logged, before its checkpoint
  proc = _main(wd, "t=1:log")
  assert proc.returncode == -signal.SIGKILL
  assert len(io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))) == 2
  # 2. killed in the middle of stage 2 (after its first epoch)
  proc = _main(wd, "t=2:epoch")
  assert proc.returncode == -signal.SIGKILL
  assert len(io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))) == 2  # t=0 and t=1 again
  # 3. killed while the checkpoint of t=3 is being written; a torn log line on top
  proc = _main(wd, "t=3:checkpoint")
  assert proc.returncode == -signal.SIGKILL
  with open(os.path.join(wd, "log.jsonl"), "a") as f:
    f.write('{"t": 4, "test_')
  # 4. SIGTERM in the middle of stage 4: the message says how to resume
  proc = _main(wd, "t=4:stage", "SIGTERM")
  assert proc.returncode == 143, proc.stderr[-3000:]
  last = proc.stderr.rstrip("\n").splitlines()[-1]
  assert last.startswith("alma_jax: error: interrupted by SIGTERM; the last checkpoint is t=3; "
                         "to resume, run the same command again: python -m alma_jax.main "), last
  assert "Traceback" not in proc.stderr
  with checkpoint.Checkpointer(ckpt_dir, 3) as ckpt:
    assert ckpt.steps()[-1] == 3
  # 5. the resumed run finishes with the outputs of the uninterrupted one
  proc = _main(wd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert helpers.outputs(wd) == baseline


@requires_mnist
def test_sigint_finishes_the_checkpoint_write_then_stops(baseline, tmp_path, monkeypatch):
  wd = str(tmp_path / "wd")
  c = config_lib.apply_variant(config_lib.base_config("mnist"), "smoke")
  c.mesh.num_devices = 1
  c.train.progress_every_s = 0.0
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_AT", "t=2:checkpoint")
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_SIGNAL", "SIGINT")
  before = signal.getsignal(signal.SIGINT)  # not always the default (e.g. under nohup)
  with pytest.raises(run.RunInterrupted) as info:
    run.run(c, wd)
  assert info.value.exit_code == 130 and info.value.last_checkpoint == 2
  assert signal.getsignal(signal.SIGINT) is before  # handlers restored
  with checkpoint.Checkpointer(os.path.join(wd, "checkpoints"), 3) as ckpt:
    assert ckpt.steps() == [0, 1, 2]  # the interrupted write completed
  monkeypatch.delenv("ALMA_JAX_TEST_KILL_AT")
  run.run(c, wd)
  assert helpers.outputs(wd) == baseline
  run.run(c, wd)  # a finished run: restored from its last checkpoint, same outputs
  assert helpers.outputs(wd) == baseline


def test_checkpoint_times():
  c = config_lib.base_config("mnist")
  c.stream.num_megabatches, c.stream.wait, c.checkpoint.every = 12, 2, 2
  due = lambda t: checkpoints.due(c, t, t // 2, t > 0 and t % 2 == 0, 12)  # stages at 2, 4, ...
  assert [t for t in range(13) if due(t)] == [0, 4, 8, 12]  # t=0, every 2nd stage, and t=B
  c.checkpoint.every = 1
  assert [t for t in range(13) if due(t)] == [0, 2, 4, 6, 8, 10, 12]
