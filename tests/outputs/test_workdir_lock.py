"""One run per workdir (alma_jax/outputs/workdir_lock.py): a second run is refused, a dead one's lock taken over."""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from alma_jax import errors
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir_lock
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT
# B=10 stages of one epoch on a slice of MNIST: a few seconds.
ARGS = ["--config=configs/bench/p3_mnist_sm.py:smoke", "--config.mesh.num_devices=1",
        helpers.NO_FIGURE]
B = 10
HOST = socket.gethostname()


def _env(kill_at=None, sig="SIGKILL"):
  return helpers.kill_env(kill_at, sig)


def _cmd(wd):
  return [sys.executable, "-m", "alma_jax.main", f"--workdir={wd}", *ARGS]


def _main(wd, kill_at=None, sig="SIGKILL"):
  return subprocess.run(_cmd(wd), cwd=ROOT, env=_env(kill_at, sig), capture_output=True,
                        text=True, timeout=300, check=False)


def _last_line(proc):
  return proc.stderr.rstrip("\n").splitlines()[-1]


def _ts(wd):
  return [r["t"] for r in io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))]


def _dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


# -- in one process ---------------------------------------------------------------------------------
def test_a_held_workdir_is_refused_and_released(tmp_path):
  wd = str(tmp_path)
  with workdir_lock.hold(wd):
    with open(os.path.join(wd, ".lock")) as f:
      info = json.load(f)
    assert info["pid"] == os.getpid() and info["host"] == HOST and info["start"]
    # flock belongs to an open file, so even the same process cannot take it twice.
    with pytest.raises(workdir_lock.WorkdirLockedError) as e:
      with workdir_lock.hold(wd):
        pass
    assert errors.exit_code(e.value) == 2
    msg = str(e.value)
    assert msg == (f"--workdir={wd} is in use by the run with pid {os.getpid()} on host {HOST}, "
                   f"started {info['start']}; wait for it to finish, stop it (kill {os.getpid()}), "
                   "or choose another --workdir")
    with workdir_lock.hold(wd, primary=False):  # other processes of a multi-host run: no lock
      pass
  assert not os.path.exists(os.path.join(wd, ".lock"))
  with workdir_lock.hold(wd):  # released
    pass


_HOLDER = """
import sys, time
from alma_jax.outputs import workdir_lock
with workdir_lock.hold(sys.argv[1]):
  print("locked", flush=True)
  time.sleep(300)
"""


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
  wd = str(tmp_path)
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, wd], cwd=ROOT, env=_env(),
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {proc.pid} on host"):
      with workdir_lock.hold(wd):
        pass
  finally:
    proc.kill()
    proc.wait()
  # The killed holder left its lock file behind; the OS released its flock.
  with open(os.path.join(wd, ".lock")) as f:
    assert json.load(f)["pid"] == proc.pid
  with workdir_lock.hold(wd):
    with open(os.path.join(wd, ".lock")) as f:
      assert json.load(f)["pid"] == os.getpid()


# -- the fallback without flock ---------------------------------------------------------------------
@pytest.fixture
def no_flock(monkeypatch):
  def flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(workdir_lock.fcntl, "flock", flock)


def _write_lock(wd, **info):
  path = os.path.join(wd, ".lock")
  with open(path, "w") as f:
    json.dump(info, f)
  return path


def test_fallback_takes_over_the_lock_of_a_dead_process(tmp_path, no_flock):
  wd = str(tmp_path)
  path = _write_lock(wd, host=HOST, pid=_dead_pid(), start="2020-01-01T00:00:00", mode="exclusive")
  with workdir_lock.hold(wd):
    with open(path) as f:
      info = json.load(f)
    assert info["pid"] == os.getpid() and info["mode"] == "exclusive"
    with pytest.raises(workdir_lock.WorkdirLockedError,
                       match=rf"in use by the run with pid {os.getpid()} on host "):
      with workdir_lock.hold(wd):
        pass
  assert not os.path.exists(path)


def test_fallback_refuses_a_live_holder_and_one_on_another_host(tmp_path, no_flock):
  wd = str(tmp_path)
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
  try:
    path = _write_lock(wd, host=HOST, pid=sleeper.pid, start="S", mode="exclusive")
    with pytest.raises(workdir_lock.WorkdirLockedError,
                       match=rf"pid {sleeper.pid} on host {re.escape(HOST)}, started S; wait for "
                             rf"it to finish, stop it \(kill {sleeper.pid}\), or choose another"):
      with workdir_lock.hold(wd):
        pass
  finally:
    sleeper.kill()
    sleeper.wait()
  _write_lock(wd, host="elsewhere", pid=_dead_pid(), start="S", mode="exclusive")
  with pytest.raises(workdir_lock.WorkdirLockedError,
                     match=rf"on host elsewhere, started S; wait for it to finish or choose another "
                           rf"--workdir; if that run is no longer running, remove {re.escape(path)}"):
    with workdir_lock.hold(wd):
      pass
  assert json.load(open(path))["host"] == "elsewhere"  # left alone


def test_fallback_empty_lock_file_is_stale_after_a_minute(tmp_path, no_flock):
  wd = str(tmp_path)
  path = os.path.join(wd, ".lock")
  open(path, "w").close()  # a holder that has not written its details yet
  with pytest.raises(workdir_lock.WorkdirLockedError, match="not recorded yet"):
    with workdir_lock.hold(wd):
      pass
  old = time.time() - 120
  os.utime(path, (old, old))
  with workdir_lock.hold(wd):
    assert json.load(open(path))["pid"] == os.getpid()


def test_flock_respects_a_live_holder_of_the_fallback(tmp_path):
  wd = str(tmp_path)
  _write_lock(wd, host="elsewhere", pid=12345, start="S", mode="exclusive")
  with pytest.raises(workdir_lock.WorkdirLockedError, match="pid 12345 on host elsewhere"):
    with workdir_lock.hold(wd):
      pass
  # A lock file of a flock holder is stale once flock is free (its process is gone).
  _write_lock(wd, host="elsewhere", pid=12345, start="S", mode="flock")
  with workdir_lock.hold(wd):
    pass


# -- through the command line ---------------------------------------------------------------------
@requires_mnist
def test_command_line_on_a_held_workdir_exits_2_naming_the_holder(tmp_path):
  wd = str(tmp_path / "wd")
  os.makedirs(wd)
  with workdir_lock.hold(wd):
    start = json.load(open(os.path.join(wd, ".lock")))["start"]
    proc = _main(wd)
    assert sorted(os.listdir(wd)) == [".lock"]  # nothing read or written
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert _last_line(proc) == (
      f"alma_jax: error: --workdir={wd} is in use by the run with pid {os.getpid()} on host "
      f"{HOST}, started {start}; wait for it to finish, stop it (kill {os.getpid()}), or choose "
      "another --workdir")


@requires_mnist
def test_two_runs_on_one_workdir(tmp_path):
  wd = str(tmp_path / "wd")
  # The first run stops itself (SIGSTOP) after logging t=1, holding the lock.
  err_path = tmp_path / "first.err"  # a file, not a pipe a stopped reader could let fill up
  with open(err_path, "w") as err_file:
    first = subprocess.Popen(_cmd(wd), cwd=ROOT, env=_env("t=1:log", "SIGSTOP"),
                             stdout=subprocess.DEVNULL, stderr=err_file)
  try:
    _, status = os.waitpid(first.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the first run ended early: {status}"
    assert _ts(wd) == [0, 1]
    second = _main(wd)
    assert second.returncode == 2, second.stderr[-3000:]
    assert re.fullmatch(rf"alma_jax: error: --workdir={re.escape(wd)} is in use by the run with "
                        rf"pid {first.pid} on host {re.escape(HOST)}, started \S+; wait for it to "
                        rf"finish, stop it \(kill {first.pid}\), or choose another --workdir",
                        _last_line(second)), _last_line(second)
    assert _ts(wd) == [0, 1]  # the second run wrote nothing
  finally:
    os.kill(first.pid, signal.SIGCONT)
  assert first.wait(timeout=300) == 0, err_path.read_text()[-3000:]
  assert _ts(wd) == list(range(B + 1))
  assert os.path.exists(os.path.join(wd, "summary.json"))
  assert not os.path.exists(os.path.join(wd, ".lock"))


@requires_mnist
def test_a_killed_run_leaves_a_lock_that_the_next_run_takes_over(tmp_path):
  wd = str(tmp_path / "wd")
  proc = _main(wd, "t=2:log")
  assert proc.returncode == -signal.SIGKILL
  with open(os.path.join(wd, ".lock")) as f:
    assert not io_utils.process_alive(json.load(f)["pid"])
  proc = _main(wd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert _ts(wd) == list(range(B + 1))
