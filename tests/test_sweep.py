"""Tests of the grid launcher (launch/sweep.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
import sweep  # pylint: disable=g-import-not-at-top


def test_grid_expands_to_all_combinations(tmp_path, capsys):
  rc = sweep.main(["--config=configs/mnist_sm.py:smoke", f"--root={tmp_path}",
                   "--grid=stream.wait=1,2", "--grid=seed=0,1,2", "--dry_run"])
  assert rc == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 6
  assert any("--config.stream.wait=2 --config.seed=1" in l for l in lines)
  assert len({l.split("--workdir=")[1].split()[0] for l in lines}) == 6


def test_slurm_script(tmp_path):
  path = tmp_path / "s.sbatch"
  sweep.main(["--config=c.py", f"--root={tmp_path}", "--grid=seed=0,1", f"--slurm={path}"])
  text = path.read_text()
  assert "#SBATCH --array=0-1" in text and "--config.seed=1" in text


def test_bad_grid_item():
  with pytest.raises(SystemExit, match="field=v1"):
    sweep.main(["--config=c.py", "--root=/tmp/x", "--grid=seed"])
