"""Tests of the grid launcher (launch/sweep.py)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import requires_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position

SMOKE = "configs/mnist_sm.py:smoke"


def test_grid_expands_to_all_combinations(tmp_path, capsys):
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}",
                   "--grid=stream.wait=1,2", "--grid=seed=0,1,2", "--dry_run",
                   "--seeds_together=no"])
  assert rc == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 6
  assert any("--config.stream.wait=2 --config.seed=1" in l for l in lines)
  assert len({l.split("--workdir=")[1].split()[0] for l in lines}) == 6


def test_consecutive_seeds_become_one_run_of_num_seeds_except_the_vgg_on_cpu(tmp_path, capsys):
  lines = _dry(tmp_path, capsys, "--grid=stream.wait=1,2", "--grid=seed=3,4,5")
  assert len(lines) == 2
  assert all("--config.seed=3 --config.num_seeds=3" in l for l in lines)
  assert "seed-3_num_seeds-3-" in lines[0]
  # Not consecutive, or asked not to: separate runs.
  assert len(_dry(tmp_path, capsys, "--grid=seed=0,2")) == 2
  assert len(_dry(tmp_path, capsys, "--grid=seed=0,1", "--seeds_together=no")) == 2
  # The VGG on this CPU: separate runs, unless asked; SLURM tasks with GPUs: together.
  vgg = ["--config=configs/cifar_sm.py:smoke", f"--root={tmp_path / 'v'}", "--grid=seed=0,1"]
  assert sweep.main(vgg + ["--dry_run"]) == 0
  assert len(capsys.readouterr().out.strip().splitlines()) == 2
  assert sweep.main(vgg + ["--dry_run", "--seeds_together=yes"]) == 0
  assert "--config.num_seeds=2" in capsys.readouterr().out
  # Growth that depends on the seed: one run per seed, even when asked.
  gmoe = ["--config=configs/mnist_gmoe.py:smoke", f"--root={tmp_path / 'g'}", "--grid=seed=0,1"]
  assert sweep.main(gmoe + ["--dry_run", "--seeds_together=yes"]) == 0
  assert "num_seeds" not in capsys.readouterr().out
  assert len(_dry(tmp_path, capsys, "--grid=method.name=sm,ff", "--grid=seed=0,1")) == 4
  path = tmp_path / "s.sbatch"
  sweep.main(vgg + [f"--slurm={path}"])
  assert "#SBATCH --array=0-0" in path.read_text() and "--config.num_seeds=2" in path.read_text()


def test_tpu_sweep_sets_the_workers_up_once_then_runs_each_point_on_all_of_them(
    tmp_path, monkeypatch, capsys):
  base = [f"--config={SMOKE}", f"--root={tmp_path}", "--grid=model.width=8,16",
          "--grid=seed=0,1", "--tpu=pod", "--tpu_zone=z", "--tpu_project=p"]
  calls = []
  monkeypatch.setattr(sweep.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
  monkeypatch.setattr(sweep._tpu_pod(), "write_archive", lambda path: open(path, "w").close())
  assert sweep.main(base + ["--no-report"]) == 0
  assert [c[4] for c in calls] == ["scp", "ssh", "ssh", "ssh", "ssh"]  # copy, install, 2 points
  assert all(c[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and "--worker=all" in c
             and "--zone=z" in c and "--project=p" in c for c in calls)
  runs = [next(a for a in c if a.startswith("--command=")) for c in calls[3:]]
  made = [sweep.command(SMOKE, str(tmp_path), [("model.width", w), ("seed", "0"),
                                               ("num_seeds", "2")], []) for w in ("8", "16")]
  workdirs = [workdir for _, workdir, _ in made]
  for run, workdir in zip(runs, workdirs):  # seeds together: the runs have an accelerator
    assert "alma_jax.main --jax_distributed --config=configs/mnist_sm.py:smoke" in run
    assert f"--workdir={workdir} " in run and run.endswith("--config.num_seeds=2")
  # A point that is done is skipped; nothing left to run: no setup either.
  for _, workdir, resolved in made:
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(resolved, f)
    open(os.path.join(workdir, "summary.json"), "w").close()
  calls.clear()
  assert sweep.main(base + ["--no-report"]) == 0
  assert not calls and capsys.readouterr().out.count("done, skipped") == 2
  # --no-tpu_setup skips copying and installing.
  assert sweep.main(base[:2] + ["--grid=model.width=4", "--tpu=pod", "--tpu_zone=z",
                                "--no-tpu_setup", "--no-report"]) == 0
  assert [c[4] for c in calls] == ["ssh"]


@pytest.mark.parametrize("flags, message", [
    (["--tpu=pod"], "--tpu needs --tpu_zone"),
    (["--tpu=pod", "--tpu_zone=z", "--parallel=2"], "neither --slurm nor --parallel"),
    (["--tpu_zone=z"], "go with --tpu"),
])
def test_bad_tpu_flags(tmp_path, flags, message):
  with pytest.raises(SystemExit, match=message):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", *flags, "--dry_run"])
  with pytest.raises(SystemExit, match="must be an absolute path"):
    sweep.main([f"--config={SMOKE}", "--root=rel", "--tpu=pod", "--tpu_zone=z", "--dry_run"])


def test_slurm_script(tmp_path):
  path = tmp_path / "s.sbatch"
  sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0,1", f"--slurm={path}",
              "--seeds_together=no"])
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
  (done,) = [n for n in os.listdir(root) if n != "report"]  # the report of the sweep aside
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


# -- grid files, parallel runs, the report ------------------------------------------------------
def _grid_file(tmp_path, text):
  path = tmp_path / "grid.py"
  path.write_text(text)
  return str(path)


def _dry(tmp_path, capsys, *flags):
  assert sweep.main([f"--config={SMOKE}", f"--root={tmp_path / 'r'}", *flags, "--dry_run"]) == 0
  return capsys.readouterr().out.strip().splitlines()


def test_grid_file_union_crossed_with_the_command_line(tmp_path, capsys):
  path = _grid_file(tmp_path, 'WIDTHS = [8, 16]\nGRID = [{"model.width": WIDTHS, '
                    '"stream.replay": [0.0]},\n        {"model.width": [4], "stream.wait": [2]}]\n')
  lines = _dry(tmp_path, capsys, f"--grid_file={path}", "--grid=seed=0,1", "--seeds_together=no")
  assert len(lines) == 6
  assert sum("--config.model.width=16 --config.stream.replay=0.0 --config.seed=1" in l
             for l in lines) == 1
  assert sum("--config.model.width=4 --config.stream.wait=2 --config.seed=0" in l
             for l in lines) == 1
  # A flag replaces the file's field of the same name; repeated points run once.
  lines = _dry(tmp_path, capsys, f"--grid_file={path}", "--grid=model.width=8")
  assert len(lines) == 2 and all("--config.model.width=8" in l for l in lines)
  dup = _grid_file(tmp_path, 'GRID = [{"seed": [0, 1]}, {"seed": [1, 2]}]')
  assert len(_dry(tmp_path, capsys, f"--grid_file={dup}", "--seeds_together=no")) == 3


def test_a_grid_names_its_own_config_files(tmp_path, capsys):
  path = _grid_file(tmp_path, 'GRID = [{"model.width": [8]},\n'
                    '        {"config": ["configs/mnist_gmoe.py:smoke"], "method.tree": [False]},\n'
                    '        {"config": ["configs/cifar_sm.py:smoke",\n'
                    '                    "configs/lm_sm.py:smoke,iid"], "seed": [0, 1]}]\n')
  lines = _dry(tmp_path, capsys, f"--grid_file={path}")
  assert len(lines) == 5  # the VGG's seeds run separately on this CPU; the LM's together
  by_config = {l.split("--config=")[1].split()[0]: l for l in lines}
  assert set(by_config) == {SMOKE, "configs/mnist_gmoe.py:smoke", "configs/cifar_sm.py:smoke",
                            "configs/lm_sm.py:smoke,iid"}
  gmoe = by_config["configs/mnist_gmoe.py:smoke"]
  assert "/mnist_gmoe-smoke_tree-False-" in gmoe and gmoe.endswith("--config.method.tree=False")
  assert "--config.config" not in " ".join(lines)
  assert "/lm_sm-smoke+iid_seed-0_num_seeds-2-" in by_config["configs/lm_sm.py:smoke,iid"]
  assert sum("/cifar_sm-smoke_seed-" in l for l in lines) == 2
  # Without --config, every grid must name its config files.
  with pytest.raises(SystemExit, match="--config is required unless every grid names"):
    sweep.main([f"--root={tmp_path}", f"--grid_file={path}", "--dry_run"])
  # A field of the named config, unknown to --config's: resolved against the grid's own.
  with pytest.raises(SystemExit, match="sweep: error"):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=method.tree=False",
                "--dry_run"])


def test_the_findings_grid_expands_as_documented(tmp_path, capsys):
  # launch/grids/findings.py, the grid behind REPRODUCTION.md: 16 MNIST SM/Ens/UMix points, gEns
  # and 2 language-model points with three seeds in one run each; Firefly and the two gMoE
  # gatings one run per seed (their growth depends on the seed).
  assert sweep.main([f"--root={tmp_path}", "--grid_file=launch/grids/findings.py",
                     "--dry_run"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 28
  together = [l for l in lines if "--config.seed=0 --config.num_seeds=3" in l]
  assert len(together) == 19
  assert sum("configs/lm_sm.py:quick " in l for l in together) == 2
  assert sum("configs/mnist_gens.py:quick " in l for l in together) == 1
  apart = [l for l in lines if "num_seeds" not in l]
  assert len(apart) == 9
  assert sum("configs/mnist_ff.py:quick " in l for l in apart) == 3
  for tree in ("True", "False"):
    assert sum(f"--config.method.tree={tree}" in l for l in apart) == 3
  assert sum("--config.stream.replay=1.0" in l for l in lines) == 2
  assert len({l.split("--workdir=")[1].split()[0] for l in lines}) == 28


@pytest.mark.parametrize("text, message", [
    ("X = 1", "must define GRID.*got no GRID"),
    ("GRID = {'seed': []}", "must define GRID"),
    ("GRID = 3", "got int"),
    ("GRID = {", "grid.py"),
])
def test_bad_grid_file(tmp_path, text, message):
  with pytest.raises(SystemExit, match=f"sweep: error: --grid_file=.*{message}"):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}",
                f"--grid_file={_grid_file(tmp_path, text)}", "--dry_run"])


def test_parallel_must_be_positive(tmp_path):
  with pytest.raises(SystemExit, match="--parallel=0 must be >= 1"):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--parallel=0"])


def test_parallel_runs_at_most_p_at_a_time(tmp_path, monkeypatch, capsys):
  lock, running, peak, seen = threading.Lock(), [0], [0], []

  def fake_call(cmd, stdout=None, stderr=None):
    with lock:
      running[0] += 1
      peak[0] = max(peak[0], running[0])
      seen.append(cmd)
    stdout.write("run output\n")
    time.sleep(0.2)
    with lock:
      running[0] -= 1
    return 0

  monkeypatch.setattr(subprocess, "call", fake_call)
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0,1,2,3,4",
                   "--parallel=2", "--seeds_together=no"])
  assert rc == 0 and len(seen) == 5 and peak[0] == 2
  logs = sorted(os.listdir(tmp_path / "logs"))
  assert len(logs) == 5 and (tmp_path / "logs" / logs[0]).read_text() == "run output\n"
  assert capsys.readouterr().out.count("finished; its output: ") == 5


@requires_mnist
def test_parallel_sweep_of_real_runs_ends_with_the_report(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("PYTHONPATH", ROOT)
  root = tmp_path / "sweep"
  # Two seeds of each width: one run of num_seeds=2 each (their records in seed_<k>/).
  rc = sweep.main([f"--config={SMOKE}", f"--root={root}", "--grid=model.width=4,8",
                   "--grid=seed=0,1", "--parallel=2", "--", *TINY,
                   "--config.log.tensorboard=False"])
  assert rc == 0, capsys.readouterr()
  out = capsys.readouterr().out
  assert "report of 2 workdirs" in out
  text = (root / "report" / "report.md").read_text()
  assert "| mnist | sm | 4 |" in text and "| mnist | sm | 8 |" in text
  assert (root / "report" / "tradeoffs_mnist.png").exists()
  for name in os.listdir(root):
    if name.startswith("width-"):
      with open(root / name / "summary.json") as f:
        cer = json.load(f)["cer_percent"]
      assert f"{cer:.2f}" in text


def test_parallel_dry_run_runs_nothing(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("ran a command"))
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=model.width=4,8",
                   "--parallel=2", "--dry_run"])
  captured = capsys.readouterr()
  assert rc == 0 and len(captured.out.strip().splitlines()) == 2
  assert f"report of the grid's workdirs -> {tmp_path / 'report'}" in captured.err
  assert not os.listdir(tmp_path)
