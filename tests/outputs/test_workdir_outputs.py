"""A run's outputs stay consistent: ordered log, full or read-only disks, deleted checkpoints,
stale temp files and file permissions (alma_jax/outputs/io_utils.py, checkpoint.py, workdir.py)."""

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import orbax.checkpoint as ocp
import pytest

from alma_jax import errors
from alma_jax.data import images
from alma_jax.outputs import checkpoint
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as workdir_lib
from alma_jax.stream import run
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT
B = 4  # mega-batches of the smoke config








def _log_lines(wd):
  """The log's raw lines; every one must be a complete JSON record (no torn line)."""
  with open(os.path.join(wd, "log.jsonl"), "rb") as f:
    data = f.read()
  assert data.endswith(b"\n")
  return [json.loads(l) for l in data.decode().splitlines()]


def _steps(wd):
  with checkpoint.Checkpointer(os.path.join(wd, "checkpoints"), 3) as ckpt:
    return ckpt.steps()




@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """(workdir, outputs) of an uninterrupted smoke run."""
  wd = str(tmp_path_factory.mktemp("uninterrupted"))
  run.run(helpers.smoke(), wd)
  return wd, helpers.outputs(wd)


def _copy(src, tmp_path):
  dst = str(tmp_path / "copy")
  shutil.copytree(src, dst)
  return dst


# -- the metrics log only grows by the next record -----------------------------------------------
def test_append_record_accepts_only_the_next_t(tmp_path):
  path = str(tmp_path / "log.jsonl")
  with pytest.raises(io_utils.LogOrderError, match=r"record of t=1 to .*: it is empty \(expected t=0\)"):
    io_utils.append_record(path, {"t": 1})
  for t in range(3):
    io_utils.append_record(path, {"t": t, "pad": "x" * 5000})  # lines longer than a read chunk
  for t in (1, 2, 4):
    with pytest.raises(io_utils.LogOrderError,
                       match=rf"record of t={t} to .*: its last record is t=2 \(expected t=3\); "
                             "is another process writing to this workdir\\?"):
      io_utils.append_record(path, {"t": t})
  with open(path, "a") as f:
    f.write('{"t": 3, "pa')  # torn by a crash: cut off, so t=3 follows t=2
  io_utils.append_record(path, {"t": 3})
  assert [r["t"] for r in io_utils.read_jsonl(path)] == [0, 1, 2, 3]
  assert errors.exit_code(io_utils.LogOrderError("x")) == 1


# -- full or read-only file system during a run ----------------------------------------------------
_MESSAGE = ("cannot write {path}: No space left on device; the checkpoints and log.jsonl written "
            "so far are intact — free space and run the same command again to resume")


def _check_cli_message(exc, path, detail="No space left on device"):
  msg, code = errors.cli_error(exc)
  assert code == 1
  assert msg == _MESSAGE.format(path=path).replace("No space left on device", detail)


@requires_mnist
def test_full_disk_while_logging_keeps_the_log_and_resumes(finished, tmp_path, monkeypatch):
  wd = str(tmp_path / "wd")
  real_open = open

  class FullDisk:
    """A file whose write of the record of t=2 stops half-way with ENOSPC."""

    def __init__(self, f):
      self._f = f

    def write(self, data):
      if b'"t": 2' in data:
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      return self._f.write(data)

    def __getattr__(self, name):
      return getattr(self._f, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return self._f.__exit__(*exc)

  def fake_open(path, mode="r", *args, **kw):
    f = real_open(path, mode, *args, **kw)
    return FullDisk(f) if str(path).endswith("log.jsonl") and mode == "r+b" else f

  monkeypatch.setattr(io_utils, "open", fake_open, raising=False)
  with pytest.raises(io_utils.WorkdirWriteError) as info:
    run.run(helpers.smoke(), wd)
  _check_cli_message(info.value, os.path.join(wd, "log.jsonl"))
  assert [r["t"] for r in _log_lines(wd)] == [0, 1]  # the half-written line was taken back
  assert _steps(wd) == [0, 1]
  monkeypatch.undo()
  run.run(helpers.smoke(), wd)
  assert helpers.outputs(wd) == finished[1]


@requires_mnist
def test_full_disk_while_checkpointing_is_one_error_and_resumes(finished, tmp_path, monkeypatch,
                                                                caplog, capfd):
  # orbax writes the checkpoint's JSON part in a background thread; make it fail at t=3
  # as a full disk would (this patches a private method of the pinned orbax version).
  wd = str(tmp_path / "wd")
  real = ocp.JsonCheckpointHandler._save_fn

  async def save_fn(self, x, directory):
    if f"checkpoints{os.sep}3.orbax-checkpoint-tmp" in str(directory):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await real(self, x, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)
  with caplog.at_level(logging.INFO), helpers.unraisable_reports() as reports:
    with pytest.raises(io_utils.WorkdirWriteError) as info:
      run.run(helpers.smoke(), wd)
  assert not reports, helpers.describe_reports(reports)  # nor "Exception ignored in" lines
  ckpt_dir = os.path.join(wd, "checkpoints")
  _check_cli_message(info.value, os.path.join(ckpt_dir, "3"))
  # orbax's error lines (each with a traceback) are left out; the cause is logged once.
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]
  assert "Traceback" not in caplog.text and "Traceback" not in capfd.readouterr().err
  assert f"orbax could not write {ckpt_dir}/3" in caplog.text
  assert _steps(wd) == [0, 1, 2]
  # The write of t=3 failed in the background while t=4 trained; the save of t=4 found it.
  assert [r["t"] for r in _log_lines(wd)] == [0, 1, 2, 3, 4]
  monkeypatch.undo()
  run.run(helpers.smoke(), wd)
  assert helpers.outputs(wd) == finished[1]
  assert sorted(os.listdir(ckpt_dir)) == ["2", "3", "4"]  # the partial checkpoint is gone


@requires_mnist
@pytest.mark.parametrize("failure", ["no_space", "read_only"])
def test_checkpoint_directory_probed_before_saving(failure, finished, tmp_path, monkeypatch):
  wd = str(tmp_path / "wd")
  real_check = checkpoint.Checkpointer._check_writable

  def check(self, step, state, meta):
    if step == 2 and failure == "no_space":
      usage = shutil.disk_usage(self.directory)
      monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                          lambda p: usage._replace(free=100 * 1024))
    if step == 2 and failure == "read_only":
      def mkstemp(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
      monkeypatch.setattr(checkpoint.tempfile, "mkstemp", mkstemp)
    return real_check(self, step, state, meta)

  monkeypatch.setattr(checkpoint.Checkpointer, "_check_writable", check)
  with pytest.raises(io_utils.WorkdirWriteError) as info:
    run.run(helpers.smoke(), wd)
  path = os.path.join(wd, "checkpoints", "2")
  msg, code = errors.cli_error(info.value)
  assert code == 1
  if failure == "no_space":
    assert msg.startswith(f"cannot write {path}: No space left on device (it needs about ")
    assert "MiB, 0.1 MiB are free); the checkpoints and log.jsonl written so far are intact" in msg
  else:
    assert msg == (f"cannot write {path}: Read-only file system; the checkpoints and log.jsonl "
                   "written so far are intact — make the file system writable and run the same "
                   "command again to resume")
  assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["0", "1"]
  assert [r["t"] for r in _log_lines(wd)] == [0, 1, 2]
  monkeypatch.undo()
  run.run(helpers.smoke(), wd)
  assert helpers.outputs(wd) == finished[1]


def test_cli_message_of_a_write_error_is_the_error_alone():
  e = io_utils.WorkdirWriteError("/w/summary.json", errno.EDQUOT)
  assert errors.cli_error(e) == (
      "cannot write /w/summary.json: Disk quota exceeded; the checkpoints and log.jsonl written "
      "so far are intact — free space (or raise the disk quota) and run the same command again "
      "to resume", 1)


# -- records without checkpoints ------------------------------------------------------------------
_NO_CONFIG = (r"^--workdir={wd} holds the records of t=0\.\.4 and summary\.json of a run but "
              r"neither its config\.json nor a checkpoint \(in {wd}/checkpoints\), so it cannot be "
              r"told whether they are this config's; a new run would overwrite them: pass "
              r"--overwrite to discard them, or choose another --workdir$")


@requires_mnist
def test_records_without_checkpoints_are_computed_again(finished, tmp_path):
  """Records are a function of (config, seed, t): the same config recomputes them."""
  wd = _copy(finished[0], tmp_path)
  shutil.rmtree(os.path.join(wd, "checkpoints"))
  run.run(helpers.smoke(), wd)
  assert helpers.outputs(wd) == finished[1]


@requires_mnist
def test_records_of_an_unknown_config_are_not_overwritten(finished, tmp_path):
  wd = _copy(finished[0], tmp_path)
  shutil.rmtree(os.path.join(wd, "checkpoints"))
  os.unlink(os.path.join(wd, "config.json"))
  before = helpers.tree_digest(wd)
  with pytest.raises(workdir_lib.UnresumableWorkdirError,
                     match=_NO_CONFIG.format(wd=re.escape(wd))) as info:
    run.run(helpers.smoke(), wd)
  assert errors.exit_code(info.value) == 2
  assert helpers.tree_digest(wd) == before
  run.run(helpers.smoke(), wd, overwrite=True)
  assert helpers.outputs(wd) == finished[1]


@requires_mnist
def test_checkpointing_off_computes_the_records_again(finished, tmp_path):
  wd = _copy(finished[0], tmp_path)
  c = helpers.smoke()
  c.checkpoint.enabled = False
  run.run(c, wd)
  assert helpers.outputs(wd) == finished[1]


def test_records_without_a_checkpoint_start_again_when_config_json_is_there(tmp_path):
  wd = str(tmp_path)
  for t in range(3):
    io_utils.append_record(os.path.join(wd, "log.jsonl"), {"t": t})
  with pytest.raises(workdir_lib.UnresumableWorkdirError, match=r"records of t=0\.\.2 of a run"):
    workdir_lib.check_outputs(wd, helpers.smoke(), overwrite=False)
  os.makedirs(os.path.join(wd, "checkpoints", "0.orbax-checkpoint-tmp-123"))  # incomplete
  with pytest.raises(workdir_lib.UnresumableWorkdirError):
    workdir_lib.check_outputs(wd, helpers.smoke(), overwrite=False)
  io_utils.write_json_atomic(os.path.join(wd, "config.json"), {})
  workdir_lib.check_outputs(wd, helpers.smoke(), overwrite=False)  # started again, nothing lost
  shutil.rmtree(os.path.join(wd, "checkpoints"))
  os.unlink(os.path.join(wd, "config.json"))
  os.makedirs(os.path.join(wd, "checkpoints", "0"))  # a checkpoint checks its own config
  workdir_lib.check_outputs(wd, helpers.smoke(), overwrite=False)


# -- stale temp files ---------------------------------------------------------------------------------
_KILLED_WRITER = """
import sys
import types
from alma_jax.outputs import io_utils
with io_utils.atomic_writer(sys.argv[1], "wb") as f:
  f.write(b"\\0" * 100000)
  f.flush()
  print("writing", flush=True)
  sys.stdin.read()
"""


def _fake_cache(cache_dir):
  """A decoded-cache entry of a made-up data set (no tfds needed to load it)."""
  rng = np.random.default_rng(0)
  arrays = {"train_x": rng.integers(0, 255, (20, 4, 4, 1), np.uint8),
            "train_y": np.arange(20, dtype=np.int32) % 2,
            "test_x": rng.integers(0, 255, (10, 4, 4, 1), np.uint8),
            "test_y": np.arange(10, dtype=np.int32) % 2}
  folder = os.path.join(cache_dir, "fake_ds", "1.0.0")
  images._write_cache(folder, arrays, {"name": "fake_ds", "version": "1.0.0", "num_classes": 2,  # pylint: disable=protected-access
                                       "mean": [0.5], "std": [0.25]})
  return folder


def test_stale_cache_temporaries_are_removed_on_the_next_load(tmp_path):
  cache = str(tmp_path / "cache")
  folder = _fake_cache(cache)
  # A cache write killed in the middle leaves its temp file.
  proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, os.path.join(folder, "big.npy")],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "writing"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed = [n for n in os.listdir(folder) if n.startswith(f".tmp-{proc.pid}-")]
  assert len(killed) == 1 and os.path.getsize(os.path.join(folder, killed[0])) == 100000
  tag = io_utils.host_tag()
  live = f".tmp-{os.getpid()}-{tag}-abcdefgh-test_x.npy"  # a writer still running
  other_host = f".tmp-1-{io_utils.host_tag('elsewhere')}-abcdefgh-test_x.npy"
  old_style, old_style_new = ".tmp-k3j2h1train_x.npy", ".tmp-zzzzzzmeta.json"
  for name in (live, other_host, old_style, old_style_new):
    with open(os.path.join(folder, name), "w") as f:
      f.write("partial")
  day_ago = os.path.getmtime(os.path.join(folder, old_style)) - 2 * 86400
  os.utime(os.path.join(folder, old_style), (day_ago, day_ago))
  ds = images.load_image_dataset("fake_ds", cache_dir=cache, data_dir=str(tmp_path / "no_tfds"))
  assert ds.timings["source"] == "cache" and ds.train_x.shape == (20, 4, 4, 1)
  left = sorted(n for n in os.listdir(folder) if n.startswith(".tmp-"))
  assert left == sorted([live, other_host, old_style_new])


def test_stale_workdir_temporaries_are_removed_before_a_run(tmp_path):
  wd = str(tmp_path)
  stale = f".tmp-{_dead_pid()}-{io_utils.host_tag()}-abcdefgh-summary.json"
  with open(os.path.join(wd, stale), "w") as f:
    f.write("{")
  workdir_lib.check_outputs(wd, helpers.smoke(), overwrite=False)
  assert not os.path.exists(os.path.join(wd, stale))


def _dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


# -- permissions ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(umask, mode, tmp_path):
  old = os.umask(umask)
  try:
    assert io_utils.current_umask() == umask
    io_utils.write_json_atomic(str(tmp_path / "a.json"), {"x": 1})
    with io_utils.atomic_writer(str(tmp_path / "b.npy"), "wb") as f:
      np.save(f, np.zeros(3))
    io_utils.append_record(str(tmp_path / "log.jsonl"), {"t": 0})
  finally:
    os.umask(old)
  for name in ("a.json", "b.npy", "log.jsonl"):
    assert os.stat(tmp_path / name).st_mode & 0o777 == mode, name


def test_only_the_closed_loop_report_of_a_failed_save_is_dropped():
  seen = []
  hook = checkpoint._QuietClosedLoops()  # pylint: disable=protected-access
  hook.previous = seen.append

  def report(exc):
    return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None,
                                 err_msg=None, object=None)

  hook(report(RuntimeError("Event loop is closed")))
  assert not seen
  other = report(RuntimeError("something else"))
  hook(other)
  assert seen == [other]


# -- --overwrite removes only what runs wrote ---------------------------------------------------
def _step_folder(path):
  os.makedirs(os.path.join(path, "meta"))
  with open(os.path.join(path, "_CHECKPOINT_METADATA"), "w") as f:
    f.write("{}")


def test_overwrite_keeps_a_users_files_in_the_checkpoint_and_wandb_folders(tmp_path, caplog):
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "log.jsonl").write_text('{"t": 0}\n')
  _step_folder(str(wd / "checkpoints" / "3"))
  (wd / "checkpoints" / "7.orbax-checkpoint-tmp-12").mkdir()
  (wd / "checkpoints" / "my_model.pt").write_text("mine")
  (wd / "checkpoints" / "12").mkdir()  # numbered, but no checkpoint metadata: not a run's
  _step_folder(str(wd / "checkpoints_unreadable" / "4-1700000000"))
  (wd / "checkpoints_stage").mkdir()
  (wd / "checkpoints_stage" / "notes.txt").write_text("mine")
  (wd / "wandb_run.json").write_text('{"id": "abc123", "last_t": 3, "epochs": 5}')
  (wd / "wandb" / "run-20260101_120000-abc123" / "files").mkdir(parents=True)
  (wd / "wandb" / "offline-run-20260102_120000-abc123").mkdir()
  (wd / "wandb" / "offline-run-20260102_120000-abc123-1").mkdir()  # resumed in the same second
  (wd / "wandb" / "run-20250101_000000-other9").mkdir()  # another project's W&B run
  os.symlink("run-20260101_120000-abc123", wd / "wandb" / "latest-run")
  seed = wd / "seed_1"
  (seed / "wandb" / "run-20250101_000000-zzz").mkdir(parents=True)  # its id is not recorded
  (seed / "log.jsonl").write_text('{"t": 0}\n')
  with caplog.at_level(logging.WARNING):
    workdir_lib.clear_outputs(str(wd))
  left = sorted(os.path.relpath(os.path.join(r, n), wd) for r, ds, fs in os.walk(wd)
                for n in ds + fs)
  assert left == ["checkpoints", "checkpoints/12", "checkpoints/my_model.pt", "checkpoints_stage",
                  "checkpoints_stage/notes.txt", "seed_1", "seed_1/wandb",
                  "seed_1/wandb/run-20250101_000000-zzz", "wandb",
                  "wandb/run-20250101_000000-other9"]
  assert "kept" in caplog.text and "my_model.pt" in caplog.text


def test_overwrite_says_it_removed_outputs_only_where_there_were_some(tmp_path, caplog):
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "mine.txt").write_text("mine")
  with caplog.at_level(logging.WARNING):
    workdir_lib.clear_outputs(str(wd))  # a folder no run wrote in
  assert "removed" not in caplog.text and sorted(os.listdir(wd)) == ["mine.txt"]
  (wd / "log.jsonl").write_text('{"t": 0}\n')
  with caplog.at_level(logging.WARNING):
    workdir_lib.clear_outputs(str(wd))
  # In words that fit the command line's --overwrite and the API's overwrite=True alike.
  assert f"removed the previous run's outputs from {wd} (overwrite)" in caplog.text
  assert "--overwrite" not in caplog.text and sorted(os.listdir(wd)) == ["mine.txt"]


def test_overwrite_removes_folders_that_held_only_a_runs_outputs(tmp_path):
  wd = tmp_path / "wd"
  wd.mkdir()
  _step_folder(str(wd / "checkpoints" / "0"))
  _step_folder(str(wd / "checkpoints_stage" / "5"))
  (wd / "wandb_run.json").write_text('{"id": "abc123"}')
  (wd / "wandb" / "run-20260101_120000-abc123").mkdir(parents=True)
  for name in ("latest-run", "debug.log"):
    os.symlink("run-20260101_120000-abc123", wd / "wandb" / name)
  (wd / "mine.txt").write_text("mine")
  workdir_lib.clear_outputs(str(wd))
  assert sorted(os.listdir(wd)) == ["mine.txt"]
