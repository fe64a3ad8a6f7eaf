"""Runs survive a crash at any instant and resume, by the same command, to the same records.

Covers: SIGKILL at random instants (before the first checkpoint lands, inside
stages, during writes), checkpoints inside a stage, verified checkpoints,
and the workdir's refusal of paths that are not the run's own files.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from alma_jax.configuration import config_lib
from alma_jax.engine import steps as steps_lib
from alma_jax.errors import ConfigError
from alma_jax.methods.base import Learner
from alma_jax.outputs import checkpoint as ckpt_lib
from alma_jax.outputs import io_utils
from alma_jax.outputs import tensorboard
from alma_jax.outputs import workdir as workdir_lib
from alma_jax.outputs import workdir_lock
from alma_jax.stream import run
from tests import helpers
from tests.conftest import requires_mnist, requires_text
from tests.data.test_text import SMALL_VOCAB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _command(wd, config, extra=()):
  # Saves inside every stage (after each epoch), so random kills land between them too.
  return [sys.executable, "-m", "alma_jax.main", f"--workdir={wd}", f"--config={config}",
          "--config.mesh.num_devices=1", "--config.train.progress_every_s=0",
          "--config.checkpoint.stage_every_epochs=1", helpers.NO_FIGURE, *extra]


def _env(kill_at=None, sig="SIGKILL"):
  return helpers.kill_env(kill_at, sig)


def _run(cmd, kill_at=None, sig="SIGKILL", kill_after_s=None):
  """Runs `cmd`; SIGKILLs it `kill_after_s` seconds after its start (if given)."""
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(kill_at, sig), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate(timeout=kill_after_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
  return proc.returncode, err


# -- SIGKILL at named and random instants, 12 times, across SM, gMoE, FF and a language model ----
KILL_CONFIGS = [
    pytest.param("configs/mnist_sm.py:smoke", marks=requires_mnist),
    pytest.param("configs/mnist_gmoe.py:smoke", marks=requires_mnist),
    pytest.param("configs/mnist_ff.py:smoke", marks=requires_mnist),
    pytest.param("configs/lm_gmoe.py:smoke", marks=requires_text),
]
# The language model on a small vocabulary (tests/data/test_text.py says why), over three
# mega-batches: two growths of its experts, into more slots and then within them.
KILL_FLAGS = {"configs/lm_gmoe.py:smoke": (f"--config.data.vocab_size={SMALL_VOCAB}",
                                           "--config.stream.num_megabatches=3")}


@pytest.mark.parametrize("config", KILL_CONFIGS)
def test_random_kills_resume_to_the_records_of_an_uninterrupted_run(config, tmp_path):
  base, flags = str(tmp_path / "uninterrupted"), KILL_FLAGS.get(config, ())
  start = time.monotonic()
  code, err = _run(_command(base, config, flags))
  wall = time.monotonic() - start
  assert code == 0, err[-3000:]
  expected = helpers.outputs(base)
  wd = str(tmp_path / "killed")
  cmd = _command(wd, config, flags)
  # Named instants first (the first checkpoint still being written; a stage part-way,
  # after one of its saves), then one at a random instant from 30% of the run's length on.
  rng = random.Random(config)
  kills = [("t=0:checkpoint", None), ("t=2:stage_saved", None),
           (None, rng.uniform(0.3, 1.0) * wall)]
  for kill_at, after_s in kills:
    code, err = _run(cmd, kill_at=kill_at, kill_after_s=after_s)
    assert code in (0, -signal.SIGKILL), (kill_at, after_s, err[-3000:])
    if kill_at is not None:
      assert code == -signal.SIGKILL, (kill_at, err[-3000:])
  code, err = _run(cmd)  # the same command, no question asked
  assert code == 0, err[-3000:]
  assert helpers.outputs(wd) == expected


# -- resume without asking ---------------------------------------------------------------------------
@requires_mnist
def test_records_beyond_a_missing_checkpoint_are_recomputed_by_the_same_command(tmp_path):
  base = str(tmp_path / "uninterrupted")
  assert _run(_command(base, "configs/mnist_sm.py:smoke"))[0] == 0
  wd = str(tmp_path / "wd")
  cmd = _command(wd, "configs/mnist_sm.py:smoke")
  code, _ = _run(cmd, kill_at="t=2:log")
  assert code == -signal.SIGKILL
  shutil.rmtree(os.path.join(wd, "checkpoints"))  # as if none had landed
  assert len(io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))) == 3
  code, err = _run(cmd)
  assert code == 0, err[-3000:]
  assert helpers.outputs(wd) == helpers.outputs(base)


# -- checkpoints inside a stage ------------------------------------------------------------------------
@requires_mnist
def test_sigterm_inside_a_stage_saves_it_and_the_stage_continues_there(tmp_path):
  base = str(tmp_path / "uninterrupted")
  per_epoch = ["--config.train.stage_program=per_epoch"]  # the host makes the train calls
  assert _run(_command(base, "configs/mnist_sm.py:smoke", per_epoch))[0] == 0
  wd = str(tmp_path / "wd")
  # Saves only when a signal asks: one save, made by SIGTERM, in the middle of stage 3.
  cmd = _command(wd, "configs/mnist_sm.py:smoke", ["--config.checkpoint.stage_every_epochs=0",
                                                  "--config.checkpoint.every_s=0", *per_epoch])
  code, err = _run(cmd, kill_at="t=3:epoch", sig="SIGTERM")
  assert code == 143, err[-3000:]
  assert "stage t=3 was saved at epoch 2, call 1" in err
  assert "to resume, run the same command again" in err.splitlines()[-1]
  assert os.listdir(os.path.join(wd, "checkpoints_stage"))
  code, err = _run(cmd)
  assert code == 0, err[-3000:]
  assert "stage t=3 continues from its save at epoch 2, call 1" in err
  assert helpers.outputs(wd) == helpers.outputs(base)
  # The event file too: the stage's epoch before its save is there once, as uninterrupted.
  events = helpers.epoch_events(base)
  assert helpers.epoch_events(wd) == events
  assert [s for s, _ in events] == list(range(1, len(events) + 1))
  # The stage save is removed once a stream checkpoint covers its stage.
  assert not [n for n in os.listdir(os.path.join(wd, "checkpoints_stage")) if n.isdigit()]


@requires_mnist
def test_a_stage_save_of_another_stage_or_damaged_is_not_used(tmp_path, monkeypatch):
  c = helpers.smoke()
  c.checkpoint.stage_every_epochs = 1
  base = str(tmp_path / "base")
  run.run(c, base)
  wd = str(tmp_path / "wd")
  helpers.interrupt(c, wd, "t=2:stage_saved", monkeypatch)
  stage_dir = os.path.join(wd, "checkpoints_stage")
  (step,) = [n for n in os.listdir(stage_dir) if n.isdigit()]
  _flip_bits(os.path.join(stage_dir, step), random.Random(0), 400)
  run.run(c, wd)  # the damaged save is set aside; the stage starts from its beginning
  assert helpers.outputs(wd) == helpers.outputs(base)


# -- verified checkpoints --------------------------------------------------------------------------
def _data_files(folder):
  out = []
  for root, _, files in os.walk(folder):
    out += [os.path.join(root, f) for f in files if "meta" not in root.split(os.sep)[-2:]
            and os.path.getsize(os.path.join(root, f)) > 0]
  return out


def _flip_bits(folder, rng, count):
  """Flips `count` random bits in the array files under `folder`."""
  files = [f for f in _data_files(folder) if "state" in f]
  for _ in range(count):
    path = rng.choice(files)
    with open(path, "r+b") as f:
      size = os.fstat(f.fileno()).st_size
      pos = rng.randrange(size)
      f.seek(pos)
      b = f.read(1)[0]
      f.seek(pos)
      f.write(bytes([b ^ (1 << rng.randrange(8))]))


def _learner(value):
  params = {"w": np.full((1, 64, 32), value, np.float32), "b": np.arange(32, dtype=np.float32)[None]}
  return Learner(params=params, model_state={}, structure=("toy", 1))


def _target(structure, has_opt_state):
  del has_opt_state
  learner = _learner(0.0)
  tree = {"params": learner.params, "model_state": {}, "key": np.zeros(2, np.uint32)}
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_every_single_bit_flip_in_a_checkpoint_is_found_or_harmless(tmp_path):
  """40 single-bit flips in the newest checkpoint's files: each restore gives either that
  checkpoint's exact arrays or the previous checkpoint's, never different numbers."""
  src = str(tmp_path / "src")
  with ckpt_lib.Checkpointer(src, 3) as ckpt:
    for t in (0, 1):
      ckpt.save(t, _learner(float(t + 1) / 3), None, np.zeros(2, np.uint32), [{"t": t}])
  rng = random.Random(1)
  outcomes = set()
  for i in range(40):
    d = str(tmp_path / f"flip{i}")
    shutil.copytree(src, d)
    _flip_bits(os.path.join(d, "1"), rng, 1)
    with ckpt_lib.Checkpointer(d, 3) as ckpt:
      snap = ckpt.restore_latest(_target, quarantine_dir=str(tmp_path / f"bad{i}"))
    w = np.asarray(snap.learner.params["w"])
    expected = _learner(float(snap.t + 1) / 3).params
    np.testing.assert_array_equal(w, expected["w"])
    np.testing.assert_array_equal(np.asarray(snap.learner.params["b"]), expected["b"])
    outcomes.add(snap.t)
  assert 0 in outcomes  # some flips were found and the older checkpoint used


def test_a_checksum_mismatch_names_the_damaged_arrays(tmp_path):
  with ckpt_lib.Checkpointer(str(tmp_path), 3) as ckpt:
    ckpt.save(0, _learner(1.0), None, np.zeros(2, np.uint32), [{"t": 0}])
    meta = ckpt.read_meta(0)
    meta["checksums"]["['params']['w']"] = "0" * 64
    with pytest.raises(ckpt_lib.CorruptCheckpointError, match=r"step 0 is damaged: 1 array.*'w'"):
      ckpt.restore_tree(0, _target(None, False), meta)


@requires_mnist
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_used(tmp_path):
  base = str(tmp_path / "base")
  run.run(helpers.smoke(), base)
  expected = helpers.outputs(base)
  for attempt in range(3):
    wd = str(tmp_path / f"wd{attempt}")
    shutil.copytree(base, wd)
    _flip_bits(os.path.join(wd, "checkpoints", "4"), random.Random(attempt), 200)
    run.run(helpers.smoke(), wd)
    assert helpers.outputs(wd) == expected
    assert os.listdir(os.path.join(wd, "checkpoints_unreadable"))


@requires_mnist
def test_no_good_checkpoint_stops_with_a_clear_error(tmp_path):
  c = helpers.smoke()
  c.checkpoint.max_to_keep = 1
  wd = str(tmp_path / "wd")
  run.run(c, wd)
  _flip_bits(os.path.join(wd, "checkpoints", "4"), random.Random(5), 400)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"no checkpoint in .* can be restored"):
    run.run(c, wd)


# -- the workdir holds only the run's own files -------------------------------------------------------
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  wd = tmp_path / "wd"
  wd.mkdir()
  os.symlink(victim, wd / ".lock")
  with pytest.raises(workdir_lock.WorkdirLockedError, match=r"\.lock is a symbolic link"):
    with workdir_lock.hold(str(wd)):
      pass
  assert victim.read_text() == "precious"


def test_appending_through_a_symlink_is_refused(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  os.symlink(victim, tmp_path / "log.jsonl")
  with pytest.raises(io_utils.NotRegularFileError, match=r"log\.jsonl is a symbolic link"):
    io_utils.append_record(str(tmp_path / "log.jsonl"), {"t": 0})
  assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name,kind", [("log.jsonl", "link"), ("checkpoints", "file"),
                                       ("summary.json", "dir"), ("seed_3", "link")])
def test_output_paths_of_the_wrong_kind_are_refused_before_anything_is_written(tmp_path, name,
                                                                                kind):
  wd = tmp_path / "wd"
  wd.mkdir()
  path = wd / name
  if kind == "link":
    os.symlink(tmp_path, path)
  elif kind == "file":
    path.write_text("x")
  else:
    path.mkdir()
  with pytest.raises(ConfigError, match=f"{name} is "):
    run.run(helpers.smoke(), str(wd))


@requires_mnist
def test_overwrite_removes_only_what_the_run_wrote(tmp_path):
  c = helpers.smoke(num_seeds=2)
  wd = tmp_path / "wd"
  run.run(c, str(wd))
  (wd / "seed_notes.txt").write_text("mine")
  (wd / "seed_analysis").mkdir()
  (wd / "seed_analysis" / "a.csv").write_text("1,2")
  (wd / "seed_0" / "my_plot.png").write_text("mine too")
  (wd / "seed_1" / "wandb_run.json").write_text("{}")  # the W&B writer's, like the run's
  (wd / "wandb").mkdir()
  run.run(c, str(wd), overwrite=True)
  assert not (wd / "wandb").exists() and not (wd / "seed_1" / "wandb_run.json").exists()
  assert (wd / "seed_notes.txt").read_text() == "mine"
  assert (wd / "seed_analysis" / "a.csv").read_text() == "1,2"
  assert (wd / "seed_0" / "my_plot.png").read_text() == "mine too"
  assert (wd / "seed_1" / "log.jsonl").exists()


# -- architecture.jsonl and input data ----------------------------------------------------------------
@requires_mnist
def test_a_corrupt_architecture_line_is_rebuilt_from_the_checkpoint(tmp_path):
  base = str(tmp_path / "base")
  run.run(helpers.smoke(), base)
  wd = str(tmp_path / "wd")
  shutil.copytree(base, wd)
  path = os.path.join(wd, "architecture.jsonl")
  lines = open(path).read().splitlines()
  lines[1] = "\x00\x00garbage"
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  run.run(helpers.smoke(), wd)
  assert helpers.outputs(wd) == helpers.outputs(base)


def test_an_unreadable_architecture_log_names_its_file(tmp_path):
  path = tmp_path / "architecture.jsonl"
  path.write_text('{"t": 1}\nnot json\n{"t": 3}\n')
  with pytest.raises(ConfigError, match=r"architecture\.jsonl cannot be read"):
    workdir_lib.sync_architecture_log(str(tmp_path), 3)
  workdir_lib.sync_architecture_log(str(tmp_path), 2, [{"t": 1}, {"t": 2}, {"t": 3}])
  assert io_utils.read_jsonl(str(path)) == [{"t": 1}, {"t": 2}]


@requires_text
def test_a_changed_input_file_is_refused_on_resume(tmp_path, monkeypatch):
  text = tmp_path / "book.txt"
  text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n"
                          for i in range(400)), encoding="utf-8")
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"), "smoke")
  c.mesh.num_devices = 1
  c.data.text_file, c.data.name = str(text), "book"
  c.data.vocab_size = SMALL_VOCAB  # (its size plays no part here)
  wd = str(tmp_path / "wd")
  helpers.interrupt(c, wd, "t=2:saved", monkeypatch)
  text.write_text(text.read_text().replace("lazy dog", "sleepy cat"), encoding="utf-8")
  with pytest.raises(ckpt_lib.IncompatibleCheckpointError,
                     match=r"written from other input data than config\.data\.text_file="):
    run.run(c, wd)
  assert json.load(open(os.path.join(wd, "config.json")))["data"]["name"] == "book"


@requires_mnist
def test_a_signal_during_an_epoch_s_evaluation_saves_the_stage_at_the_next_epoch(tmp_path,
                                                                                  monkeypatch):
  c = helpers.smoke(train__stage_program="per_epoch")  # an evaluation per epoch, from the host
  c.checkpoint.every_s = 0.0  # saves only when the signal asks
  base = str(tmp_path / "base")
  run.run(c, base)
  calls = []
  evaluate = steps_lib.Steps.evaluate_units

  def interrupted_evaluation(self, learner, split, idx):
    if split == "train":  # a stage's validation: the third is stage 2's first epoch
      calls.append(1)
      if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGINT)
    return evaluate(self, learner, split, idx)

  monkeypatch.setattr(steps_lib.Steps, "evaluate_units", interrupted_evaluation)
  wd = str(tmp_path / "wd")
  with pytest.raises(run.RunInterrupted):
    run.run(c, wd)
  monkeypatch.setattr(steps_lib.Steps, "evaluate_units", evaluate)
  stage_dir = os.path.join(wd, "checkpoints_stage")
  (step,) = [n for n in os.listdir(stage_dir) if n.isdigit()]
  with ckpt_lib.Checkpointer(stage_dir, 1) as ckpt:
    meta = ckpt.read_meta(int(step))
  assert (meta["stage_t"], meta["position"]["epoch"], meta["position"]["next_call"]) == (2, 2, 0)
  run.run(c, wd)
  assert helpers.outputs(wd) == helpers.outputs(base)


@pytest.mark.parametrize("name", [".lock", "log.jsonl", "architecture.jsonl"])
def test_a_hard_link_in_the_place_of_a_written_file_is_refused_and_its_target_untouched(tmp_path,
                                                                                        name):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  wd = tmp_path / "wd"
  wd.mkdir()
  os.link(victim, wd / name)
  with pytest.raises(ValueError, match=re.escape(name) + r" is a hard link"):
    if name == ".lock":
      with workdir_lock.hold(str(wd)):
        pass
    else:
      io_utils.append_jsonl(str(wd / name), {"t": 0})
  assert victim.read_text() == "precious\n"


def test_a_hard_link_in_the_place_of_the_tensorboard_events_file_is_refused(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  (tmp_path / "tb").mkdir()
  writer = tensorboard.Writer(str(tmp_path / "tb"), [])
  os.unlink(writer.path)
  os.link(victim, writer.path)
  with pytest.raises(io_utils.NotRegularFileError, match=r"is a hard link"):
    writer._append(b"event")  # pylint: disable=protected-access
  assert victim.read_text() == "precious\n"
