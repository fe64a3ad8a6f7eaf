"""Tests of the grid launcher (launch/sweep.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import requires_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position

SMOKE = "configs/mnist_sm.py:smoke"


def test_grid_expands_to_all_combinations(tmp_path, capsys):
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}",
                   "--grid=stream.wait=1,2", "--grid=seed=0,1,2", "--dry_run"])
  assert rc == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 6
  assert any("--config.stream.wait=2 --config.seed=1" in l for l in lines)
  assert len({l.split("--workdir=")[1].split()[0] for l in lines}) == 6


def test_slurm_script(tmp_path):
  path = tmp_path / "s.sbatch"
  sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0,1", f"--slurm={path}"])
  text = path.read_text()
  assert "#SBATCH --array=0-1" in text and "--config.seed=1" in text
  assert "#SBATCH --gres=gpu:1" in text
  sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0", f"--slurm={path}",
              "--slurm_gpus=0", "--slurm_option=--time=1:00:00"])
  text = path.read_text()
  assert "--gres" not in text and "#SBATCH --time=1:00:00\n" in text


def test_bad_grid_item():
  with pytest.raises(SystemExit, match="field=v1"):
    sweep.main(["--config=c.py", "--root=/tmp/x", "--grid=seed"])


def test_config_that_does_not_load():
  with pytest.raises(SystemExit, match=r"sweep: error: --config=no_such\.py: .*no_such\.py"):
    sweep.main(["--config=no_such.py", "--root=/tmp/x", "--grid=seed=0"])
  with pytest.raises(SystemExit, match=r"sweep: error: --config=.*'sed'"):
    sweep.main([f"--config={SMOKE}", "--root=/tmp/x", "--grid=sed=0"])


def _workdir(root, *extra, config=SMOKE):
  _, workdir, _ = sweep.command(config, str(root), [("seed", "0")], list(extra))
  return workdir


def test_workdir_names_follow_the_resolved_config(tmp_path):
  base = _workdir(tmp_path)
  assert os.path.basename(base).startswith("seed-0-")
  assert _workdir(tmp_path) == base
  assert _workdir(tmp_path, "--config.seed=0") == base  # the same config, spelled out
  assert _workdir(tmp_path, "--overwrite") == base  # not a config flag
  assert _workdir(tmp_path, "--config.data.cache_dir=/elsewhere") == base  # resumable
  others = {_workdir(tmp_path, "--config.train.epochs=1"),
            _workdir(tmp_path, "--config.train.epochs", "1"),
            _workdir(tmp_path, config="configs/mnist_sm.py:quick"),
            _workdir(tmp_path, config="configs/mnist_ens.py:smoke")}
  assert base not in others and len(others) == 3  # the first two are one config


# -- real runs ------------------------------------------------------------------------------------
TINY = ["--config.mesh.num_devices=1", "--config.train.epochs=1", "--config.train.patience=1",
        "--config.stream.num_megabatches=2"]


def _sweep(root, *extra):
  return sweep.main([f"--config={SMOKE}", f"--root={root}", "--grid=seed=0", "--", *TINY, *extra])


@requires_mnist
def test_rerun_skips_only_a_point_of_the_same_config(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("PYTHONPATH", ROOT)
  root = tmp_path / "sweep"
  assert _sweep(root) == 0
  out = capsys.readouterr().out
  assert "done, skipped" not in out
  (done,) = os.listdir(root)
  assert os.path.exists(root / done / "summary.json")

  calls = []
  monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
  # The identical sweep: skipped.
  assert _sweep(root) == 0
  assert "[1/1] done, skipped: " in capsys.readouterr().out and not calls
  # Another extra flag: another config, run in a workdir of its own.
  assert _sweep(root, "--config.train.batch_size=64") == 0
  out = capsys.readouterr().out
  assert "done, skipped" not in out and len(calls) == 1
  assert "--config.train.batch_size=64" in calls[0]
  (new,) = [a.split("=", 1)[1] for a in calls[0] if a.startswith("--workdir=")]
  assert os.path.basename(new) != done and not os.path.exists(new)

  # The same config without a summary: resumed (run again), not skipped.
  calls.clear()
  os.unlink(root / done / "summary.json")
  assert _sweep(root) == 0
  assert "done, skipped" not in capsys.readouterr().out and len(calls) == 1
  # A workdir of the same name holding another config (e.g. written by an older
  # version of the sweep): refused, naming the difference.
  calls.clear()
  with open(root / done / "config.json") as f:
    stored = json.load(f)
  stored["train"]["epochs"] = 7
  with open(root / done / "config.json", "w") as f:
    json.dump(stored, f)
  assert _sweep(root) == 1
  out = capsys.readouterr().out
  assert f"refused ({root / done} holds a run of a different config: config.train.epochs: 7 → 1)" \
      in out and not calls
