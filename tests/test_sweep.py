"""Tests of the grid launcher (launch/sweep.py)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from alma_jax.outputs import workdir_lock
from tests.conftest import requires_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position

SMOKE = "configs/mnist_sm.py:smoke"


def _fake_runs(monkeypatch, seconds=0.0, output="", on_start=None, exit_code=0):
  """Replaces subprocess.Popen by runs that record their command, call `on_start` with it,
  write `output` to their stdout file (if any), last `seconds` and exit with `exit_code` (each
  either a value or a function of the command); returns the commands and a list holding the
  most runs in progress at once."""
  calls, peak, started = [], [0], []

  class Run:
    """A stand-in for subprocess.Popen."""

    def __init__(self, cmd, stdout=None, **kwargs):
      del kwargs
      self.args, self.pid, self.returncode = cmd, 0, None
      self._end = time.monotonic() + (seconds(cmd) if callable(seconds) else seconds)
      self._exit = exit_code(cmd) if callable(exit_code) else exit_code
      calls.append(cmd)
      if on_start:
        on_start(cmd)
      started.append(self)
      peak[0] = max(peak[0], sum(r.returncode is None for r in started))
      if stdout is not None and output:
        stdout.write(output)
        stdout.flush()

    def poll(self):
      if self.returncode is None and time.monotonic() >= self._end:
        self.returncode = self._exit
      return self.returncode

    def wait(self, timeout=None):
      del timeout
      while self.poll() is None:
        time.sleep(0.01)
      return self.returncode

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.wait()

  monkeypatch.setattr(subprocess, "Popen", Run)
  return calls, peak


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
  # A waiting policy that times each seed's stages from its own data: one run per seed too.
  trig = _dry(tmp_path, capsys, "--grid=stream.wait_policy=geometric,triggered",
              "--grid=seed=0,1", "--seeds_together=yes")
  assert len(trig) == 4 and not any("num_seeds" in l for l in trig)
  assert len(_dry(tmp_path, capsys, "--grid=stream.wait_policy=geometric", "--grid=seed=0,1",
                  "--seeds_together=yes")) == 1
  path = tmp_path / "s.sbatch"
  sweep.main(vgg + [f"--slurm={path}"])
  assert "#SBATCH --array=0-0" in path.read_text() and "--config.num_seeds=2" in path.read_text()


def test_tpu_sweep_sets_the_workers_up_once_then_runs_each_point_on_all_of_them(
    tmp_path, monkeypatch, capsys):
  base = [f"--config={SMOKE}", f"--root={tmp_path}", "--grid=model.width=8,16",
          "--grid=seed=0,1", "--tpu=pod", "--tpu_zone=z", "--tpu_project=p"]
  calls, _ = _fake_runs(monkeypatch)
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
  sweep.main([f"--config={SMOKE}", f"--root={tmp_path / 'my_sweep'}", "--grid=seed=0,1",
              f"--slurm={path}", "--seeds_together=no"])
  text = path.read_text()
  assert "#SBATCH --array=0-1" in text and "--config.seed=1" in text
  assert "#SBATCH --gres=gpu:1" in text
  # Named, started in the repository, requeued on preemption; before the time limit the run
  # saves and stops, and the task is requeued (launch/slurm.py, tested in test_launchers.py).
  lines = text.splitlines()
  for line in ("#SBATCH --job-name=alma_jax-my_sweep", "#SBATCH --requeue",
               "#SBATCH --signal=B:USR1@120", f"cd {ROOT}", "trap 'requeue=1; stop' USR1",
               'eval "exec ${CMDS[$SLURM_ARRAY_TASK_ID]}" &'):
    assert line in lines, line
  assert lines.index(f"cd {ROOT}") < lines.index("CMDS=(")
  proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0", f"--slurm={path}",
              "--slurm_gpus=0", "--slurm_option=--time=1:00:00"])
  text = path.read_text()
  assert "--gres" not in text and "#SBATCH --time=1:00:00\n" in text


def test_bad_grid_item():
  with pytest.raises(SystemExit, match="field=v1") as info:
    sweep.main(["--config=c.py", "--root=/tmp/x", "--grid=seed"])
  assert info.value.code == sweep.REFUSED


def test_a_refused_flag_is_one_line_and_exit_code_2_as_for_argparse(tmp_path):
  """A sweep's bad flag or grid exits as argparse's refusals do (2), not as a failed run (1)."""
  script = os.path.join(ROOT, "launch", "sweep.py")
  for args, line in [(["--grid=seed"], "sweep: error: --grid='seed' must look like field=v1,v2,..."),
                     (["--no_such_flag"], "sweep.py: error: unrecognized arguments: --no_such_flag")]:
    proc = subprocess.run([sys.executable, script, f"--config={SMOKE}", f"--root={tmp_path}",
                           *args], capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1] == line
  with pytest.raises(sweep.UsageError, match="^sweep: error: --parallel=0 must be >= 1$") as info:
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0", "--parallel=0"])
  assert info.value.code == 2


@pytest.mark.parametrize("args, message", [
    (["--slurm={tmp}/missing/a.sbatch"], "--slurm={tmp}/missing/a.sbatch: its folder "
     "{tmp}/missing does not exist"),
    (["--slurm={tmp}"], "--slurm={tmp} is a directory; give the batch script's file name"),
    (["--slurm={tmp}/a.sbatch", "--slurm_gpus=-1"], "--slurm_gpus=-1 must be >= 0 (0: no GPU)"),
    (["--slurm={tmp}/a.sbatch", "--slurm_option=time=4:00"],
     "--slurm_option='time=4:00' must be one sbatch option, e.g. --slurm_option=--account=abc"),
    (["--slurm={tmp}/a.sbatch", "--slurm_option=--time=1:00"], "the time limit "
     "--slurm_option=--time=1:00 (60 s) must be longer than the 120 s before it at which the "
     "run is told to save and stop"),
], ids=["folder", "directory", "gpus", "option", "time_limit"])
def test_an_array_script_that_would_not_run_is_refused_before_it_is_written(args, message,
                                                                             tmp_path):
  args = [a.format(tmp=tmp_path / "s") for a in args]
  (tmp_path / "s").mkdir()
  with pytest.raises(sweep.UsageError) as info:
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}/root", "--grid=seed=0", *args])
  assert str(info.value) == f"sweep: error: {message.format(tmp=tmp_path / 's')}"
  assert os.listdir(tmp_path / "s") == []


def test_a_root_that_cannot_hold_the_workdirs_is_refused_before_any_run(tmp_path, monkeypatch):
  calls, _ = _fake_runs(monkeypatch)
  (tmp_path / "a_file").write_text("")
  root = tmp_path / "a_file" / "sweep"
  with pytest.raises(sweep.UsageError) as info:
    sweep.main([f"--config={SMOKE}", f"--root={root}", "--grid=seed=0,1"])
  assert str(info.value) == (f"sweep: error: --root={root} is not writable: Not a directory; "
                             "no run was started")
  assert info.value.code == 2 and not calls
  # A dry run only prints the plan, and a root made later serves.
  assert sweep.main([f"--config={SMOKE}", f"--root={root}", "--grid=seed=0,1", "--dry_run",
                     "--no-report"]) == 0 and not calls


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

  calls, _ = _fake_runs(monkeypatch)
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


@requires_mnist
def test_a_point_run_at_a_default_since_left_to_be_chosen_is_found_and_done(tmp_path, capsys):
  # gMoE's slots defaulted to pow2, now auto: a sweep's point at the default finds the folder
  # an earlier sweep ran it in, done, where a point that sets auto in a grid of both values is
  # a run of its own.
  root, config = tmp_path / "r", "configs/mnist_gmoe.py:smoke"
  _, workdir, resolved = sweep.command(config, str(root), [("stream.wait", "1")], [])
  assert resolved["method"]["slots"] == "auto"
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({**resolved, "method": {**resolved["method"], "slots": "pow2"}}, f)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({}, f)
  flags = [f"--config={config}", f"--root={root}", "--grid=stream.wait=1", "--dry_run"]
  assert sweep.main(flags) == 0
  assert "[1/1] done, skipped: " in capsys.readouterr().out
  assert sweep.main(flags + ["--grid=method.slots=pow2,auto"]) == 0
  (pow2, auto) = capsys.readouterr().out.strip().splitlines()[:2]
  assert pow2.startswith("[1/2] done, skipped: ") and f"--workdir={workdir} " in pow2
  assert auto.startswith("[2/2] ") and "done" not in auto and f"--workdir={workdir} " not in auto


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
  # launch/grids/findings.py, the grid behind REPRODUCTION.md: 20 MNIST SM/Ens/UMix points, gEns
  # and 4 language-model points (Ens 4@2, k = 4 and 3, sequential and i.i.d.) with three seeds
  # in one run each; Firefly and the two gMoE gatings one run per seed (their growth depends on
  # the seed).
  assert sweep.main([f"--root={tmp_path}", "--grid_file=launch/grids/findings.py",
                     "--dry_run"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 34
  together = [l for l in lines if "--config.seed=0 --config.num_seeds=3" in l]
  assert len(together) == 25
  assert sum("configs/lm_ens.py:quick " in l for l in together) == 4
  for wait in (1, 25, 50, 250, 500):  # and 10, the config's own
    assert sum(f"--config.stream.wait={wait} " in l + " " for l in together) == 2 + 2 * (wait == 50)
  assert sum("configs/mnist_gens.py:quick " in l for l in together) == 1
  apart = [l for l in lines if "num_seeds" not in l]
  assert len(apart) == 9
  assert sum("configs/mnist_ff.py:quick " in l for l in apart) == 3
  for tree in ("True", "False"):
    assert sum(f"--config.method.tree={tree}" in l for l in apart) == 3
  assert sum("--config.stream.replay=1.0" in l for l in lines) == 2
  assert len({l.split("--workdir=")[1].split()[0] for l in lines}) == 34


@pytest.mark.parametrize("grid, folder", [("findings", "mnist"), ("ten_seeds", "ten_seeds")])
def test_the_findings_grid_s_run_times_are_its_committed_results(grid, folder):
  # Each entry of the grid file's TIME_S (the sweep's ETA) is the mean `wall_s` of that point's
  # rows in the results.csv committed from the grid's last run.
  from alma_jax.reports import findings  # pylint: disable=g-import-not-at-top
  from alma_jax.reports import grid_files  # pylint: disable=g-import-not-at-top
  rows = findings.read_results(f"docs/reproduction/{folder}/results.csv")
  for fields, seconds in grid_files.scope(f"launch/grids/{grid}.py")["TIME_S"]:
    walls = [float(r["wall_s"]) for r in rows if all(r[k] == str(v) for k, v in fields.items())]
    assert walls and round(sum(walls) / len(walls)) == seconds, (fields, walls, seconds)


def test_the_beyond_grid_expands_as_documented(tmp_path, capsys):
  # launch/grids/beyond.py, REPRODUCTION.md's "Beyond the paper": H in {4, 64} x (6 fixed
  # waits, 2 geometric, 5 warm starts at w in {1, 10}) with three seeds in one run each; the
  # 2 triggered points one run per seed (each seed decides its own training times); the
  # CIFAR-10 slice's 6 warm starts one run per seed (the VGG on a CPU). Every run records the
  # plasticity diagnostics.
  assert sweep.main([f"--root={tmp_path}", "--grid_file=launch/grids/beyond.py",
                     "--dry_run"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2 * 18 + 2 * 2 * 3 + 6 * 3
  together = [l for l in lines if "--config.seed=0 " in l and "--config.num_seeds=3" in l]
  assert len(together) == 36
  apart = [l for l in lines if "num_seeds" not in l]
  cifar = [l for l in apart if "configs/cifar_sm.py:quick" in l]
  assert len(cifar) == 18 and all("--config.stream.wait=1 " in l and "--config.model.width=16 "
                                  in l and "--config.data.train_subset=20000 " in l
                                  for l in cifar)
  assert len(apart) == 30 and all("--config.stream.wait_policy=triggered" in l
                                  for l in apart if l not in cifar)
  assert sum("--config.stream.wait_policy=geometric" in l for l in together) == 4
  for policy in ("scratch", "shrink_perturb", "redo", "continual_backprop", "l2_init"):
    assert sum(f"--config.stream.warm_start={policy} " in l for l in together) == 4, policy
  assert all("--config.stream.wait=1 " in l for l in lines if "wait_policy" in l)
  assert all("--config.log.plasticity=True" in l for l in lines)
  assert len({l.split("--workdir=")[1].split()[0] for l in lines}) == 66


def test_the_ten_seeds_grid_expands_as_documented(tmp_path, capsys):
  # launch/grids/ten_seeds.py: 9 SM points (H = 4 at five fixed waits, H = 64 and 256 at
  # w = 10, ReDo and the geometric wait at H = 4) with seeds 0-9 in one run each; gMoE's two
  # gatings one run per seed. Its gMoE runs are named as the findings grid's, so seeds 0-2
  # repeat those runs.
  assert sweep.main([f"--root={tmp_path}", "--grid_file=launch/grids/ten_seeds.py",
                     "--dry_run"]) == 0
  lines = [l + " " for l in capsys.readouterr().out.strip().splitlines()]
  assert len(lines) == 29 and len({l.split("--workdir=")[1].split()[0] for l in lines}) == 29
  together = [l for l in lines if "--config.seed=0 --config.num_seeds=10 " in l]
  assert len(together) == 9 and all("configs/mnist_sm.py:quick " in l for l in together)
  for wait in (1, 5, 25, 50):  # and 10, the config's own
    assert sum(f"--config.stream.wait={wait} " in l for l in together) == 1 + 2 * (wait == 1)
  assert sum("--config.model.width=4 " in l for l in together) == 7
  assert sum("--config.stream.warm_start=redo " in l for l in together) == 1
  assert sum("--config.stream.wait_policy=geometric " in l for l in together) == 1
  apart = [l for l in lines if "num_seeds" not in l]
  assert len(apart) == 20 and all("configs/mnist_gmoe.py:quick " in l for l in apart)
  for tree in ("True", "False"):
    seeds = [l.split("--config.seed=")[1].split()[0] for l in apart
             if f"--config.method.tree={tree} " in l]
    assert sorted(seeds, key=int) == [str(s) for s in range(10)]
  assert "mnist_gmoe-quick_tree-True_seed-0-7e24346a " in " ".join(apart)


def test_the_lm_growth_grid_expands_as_documented(tmp_path, capsys):
  # launch/grids/lm_growth.py, for the tiny preset and the balanced model each: SM with E = 4, 8,
  # 12 and gEns with three seeds in one run each; gMoE one run per seed (the experts it copies
  # depend on the seed). The balanced model's fields on its 7 runs, none on the tiny ones.
  assert sweep.main([f"--root={tmp_path}", "--grid_file=launch/grids/lm_growth.py",
                     "--dry_run"]) == 0
  lines = [l + " " for l in capsys.readouterr().out.strip().splitlines() if "alma_jax.main" in l]
  assert len(lines) == 14 and len({l.split("--workdir=")[1].split()[0] for l in lines}) == 14
  balanced = ("--config.data.vocab_size=2048 --config.model.dim=128 --config.model.ffn_dim=256 "
              "--config.train.steps_per_epoch=800 ")
  for model in ([l for l in lines if balanced in l], [l for l in lines if "dim=" not in l]):
    assert len(model) == 7
    together = [l for l in model if "--config.seed=0 " in l and "--config.num_seeds=3 " in l]
    assert len(together) == 4
    for experts in (4, 8, 12):
      assert sum("configs/lm_sm.py:quick " in l and f"--config.model.num_experts={experts} " in l
                 for l in together) == 1
    assert sum("configs/lm_gens.py:quick " in l for l in together) == 1
    apart = [l for l in model if "num_seeds" not in l]
    assert sorted(l.split("--config.seed=")[1].split()[0] for l in apart) == ["0", "1", "2"]
    assert all("configs/lm_gmoe.py:quick " in l for l in apart)


def test_the_cifar_grids_expand_as_documented(tmp_path, capsys):
  # launch/grids/findings_cifar.py: 19 points x 3 seeds, one run per seed (the VGG on a CPU),
  # all on the reduced protocol (early stopping within 8 epochs); launch/grids/paper_cifar.py:
  # 6 methods x 5 widths x (3 waits + replay at w = 10) x 3 seeds.
  assert sweep.main([f"--root={tmp_path}", "--grid_file=launch/grids/findings_cifar.py",
                     "--dry_run"]) == 0
  lines = [l for l in capsys.readouterr().out.strip().splitlines() if "alma_jax.main" in l]
  assert len(lines) == 57 and len({l.split("--workdir=")[1].split()[0] for l in lines}) == 57
  assert all("--config.data.train_subset=20000" in l and "--config.train.epochs=8" in l
             and "--config.train.patience=2" in l and "num_seeds" not in l for l in lines)
  assert sum("configs/cifar_ens.py:quick " in l for l in lines) == 9
  assert sum("--config.method.num_members=3" in l for l in lines) == 15
  assert sum("--config.stream.replay=1.0" in l for l in lines) == 9
  assert sum("--config.stream.wait=10 " in l for l in lines) == 6  # the tardy learner, w = B
  assert sweep.main([f"--root={tmp_path / 'paper'}", "--grid_file=launch/grids/paper_cifar.py",
                     "--dry_run", "--seeds_together=no"]) == 0
  lines = [l for l in capsys.readouterr().out.strip().splitlines() if "alma_jax.main" in l]
  assert len(lines) == 360
  assert sum("--config.stream.replay=1.0" in l for l in lines) == 90


@pytest.mark.parametrize("grid_file", ["launch/grids/findings.py",
                                       "launch/grids/findings_cifar.py",
                                       "launch/grids/beyond.py",
                                       "launch/grids/lm_growth.py",
                                       "launch/grids/ten_seeds.py"])
def test_every_finding_of_a_grid_compares_points_of_that_grid(tmp_path, grid_file):
  # Each selector of the grid file's FINDINGS picks exactly one of its points (seeds aside), so
  # the report can judge every comparison once the grid has run.
  import csv  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  from alma_jax.outputs import workdir as wd  # pylint: disable=g-import-not-at-top
  from alma_jax.reports import findings  # pylint: disable=g-import-not-at-top
  made = sweep.plan(sweep._args([f"--root={tmp_path}", f"--grid_file={grid_file}",
                                 "--seeds_together=no"]))
  rows = []
  for _, workdir, resolved, _ in made.values():
    flat = wd.flatten(resolved)
    group = json.dumps({k: v for k, v in flat.items() if k not in ("seed", "num_seeds")},
                       sort_keys=True, default=repr)
    rows.append(dict(flat, workdir=workdir, finished=True, group=group, cer_percent=1.0,
                     final_error=0.1, final_perplexity=100.0, mean_perplexity=100.0,
                     comp_paper_total=1.0, mem=1.0,
                     final_dormant_fraction=0.1))
  text = io.StringIO()
  writer = csv.DictWriter(text, sorted(set().union(*rows)), lineterminator="\n")
  writer.writeheader()
  writer.writerows({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                    for k, v in r.items()} for r in rows)
  spec = findings.load_findings(grid_file)
  assert spec, f"{grid_file} names no FINDINGS"
  found = findings.evaluate(findings.read_rows(text.getvalue()), spec)
  seeds = 10 if grid_file.endswith("ten_seeds.py") else 3  # every point's seeds, each compared
  for f in found:
    for c in f.comparisons:
      assert c.outcome != findings.MISSING, (f.id, c)
      assert c.better.n == seeds and c.worse.n == seeds, (f.id, c)


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
  seen, peak = _fake_runs(monkeypatch, seconds=0.2, output="run output\n")
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
  monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("ran a command"))
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=model.width=4,8",
                   "--parallel=2", "--dry_run"])
  captured = capsys.readouterr()
  assert rc == 0 and len(captured.out.strip().splitlines()) == 2
  assert f"report of the grid's workdirs -> {tmp_path / 'report'}" in captured.err
  assert not os.listdir(tmp_path)


# -- signals, and sweeps that share a root ---------------------------------------------------------
def _running(pid: int) -> bool:
  """Whether process `pid` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError):
    return False


def _sweep_process(tmp_path, child: str, flags, name="sweep"):
  """A sweep (in a process of its own) whose points run `child` (a Python program given the
  point's workdir and a file holding its resolved config) instead of alma_jax.main."""
  script = f"""
import json, os, sys
sys.path.insert(0, {os.path.join(ROOT, 'launch')!r})
import sweep
real = sweep.command
def command(config, root, point, extra):
  _, workdir, resolved = real(config, root, point, extra)
  path = os.path.join({str(tmp_path)!r}, {name!r} + "-" + os.path.basename(workdir) + ".json")
  with open(path, "w") as f:
    json.dump(resolved, f)
  return [sys.executable, "-c", {child!r}, workdir, path], workdir, resolved
sweep.command = command
sys.exit(sweep.main({[f"--config={SMOKE}", "--seeds_together=no", "--no-report", *flags]!r}))
"""
  return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.parametrize("parallel", [1, 2])
def test_sigterm_to_a_sweep_stops_its_runs_and_starts_no_more(tmp_path, parallel):
  pids = tmp_path / "pids"
  pids.mkdir()
  child = ("import os, sys, time\n"
           f"open(os.path.join({str(pids)!r}, os.path.basename(sys.argv[1])), 'w')"
           ".write(str(os.getpid()))\n"
           "time.sleep(60)\n")
  proc = _sweep_process(tmp_path, child, [f"--root={tmp_path / 'r'}", "--grid=seed=0,1,2",
                                          f"--parallel={parallel}"])
  children = []
  try:
    deadline = time.monotonic() + 30
    while len(children) < parallel and time.monotonic() < deadline:
      children = [int(t) for t in (p.read_text() for p in pids.iterdir()) if t]
      time.sleep(0.05)
    assert len(children) == parallel
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 143, out
    assert not any(_running(pid) for pid in children), out
    assert len(os.listdir(pids)) == parallel  # no point started after the signal
    assert out.count("killed by SIGTERM (exit code 143)") == parallel, out
    assert "to resume, run the same command again: python launch/sweep.py " in out
  finally:
    proc.kill()
    proc.wait()
    for pid in children:
      if _running(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_point_whose_workdir_another_run_holds_is_running_not_to_run(tmp_path):
  _, workdir, resolved = sweep.command(SMOKE, str(tmp_path), [("seed", "0")], [])
  os.makedirs(workdir)
  assert sweep.status(workdir, resolved)[0] == "run"
  with workdir_lock.hold(workdir):
    state, why = sweep.status(workdir, resolved)
    assert state == "running" and f"pid {os.getpid()}" in why
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(resolved, f)
    assert sweep.status(workdir, resolved)[0] == "running"
  assert sweep.status(workdir, resolved)[0] == "run"


def test_points_that_another_process_ran_or_runs_meanwhile_are_not_run(tmp_path, monkeypatch,
                                                                      capsys):
  made = [sweep.command(SMOKE, str(tmp_path), [("seed", str(s))], []) for s in range(3)]
  with contextlib.ExitStack() as other:  # another sweep, on the same root

    def meanwhile(cmd):
      if f"--workdir={made[0][1]}" not in cmd:
        return
      # While the first point runs, the other sweep finishes the second and starts the third.
      for _, workdir, resolved in made[1:]:
        os.makedirs(workdir)
        with open(os.path.join(workdir, "config.json"), "w") as f:
          json.dump(resolved, f)
      open(os.path.join(made[1][1], "summary.json"), "w").close()
      other.enter_context(workdir_lock.hold(made[2][1]))

    calls, _ = _fake_runs(monkeypatch, on_start=meanwhile)
    rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0,1,2",
                     "--seeds_together=no", "--no-report"])
  assert rc == 0 and len(calls) == 1 and f"--workdir={made[0][1]}" in calls[0]
  captured = capsys.readouterr()
  assert "[2/3] done by another process meanwhile, skipped" in captured.out
  assert f"[3/3] running (by another process, pid {os.getpid()} on " in captured.out
  assert "failed" not in captured.err
  assert "1 of 3 points are running in another process" in captured.err


# A point's fake run: holds the workdir's lock (or fails as a run does when another holds it),
# writes the config, then after a while the summary.
LOCKED_RUN = f"""
import os, shutil, sys, time
sys.path.insert(0, {ROOT!r})
from alma_jax.outputs import workdir_lock
workdir, config = sys.argv[1:3]
os.makedirs(workdir, exist_ok=True)
try:
  with workdir_lock.hold(workdir):
    shutil.copy(config, os.path.join(workdir, "config.json"))
    time.sleep(1.5)
    open(os.path.join(workdir, "summary.json"), "w").write("{{}}")
except workdir_lock.WorkdirLockedError as e:
  print(f"alma_jax: error: {{e}}", file=sys.stderr)
  sys.exit(2)
"""


def test_two_sweeps_on_one_root_count_each_other_s_points_as_running_or_done(tmp_path):
  # Started together, they contend for the same points: a point's run that the other sweep's run
  # holds is refused, which counts as "running (by another process)", not as a failure.
  flags = [f"--root={tmp_path / 'r'}", "--grid=seed=0,1"]
  sweeps = [_sweep_process(tmp_path, LOCKED_RUN, flags, name) for name in ("a", "b")]
  try:
    outs = [p.communicate(timeout=60)[0] for p in sweeps]
  finally:
    for p in sweeps:
      p.kill()
      p.wait()
  for p, out in zip(sweeps, outs):
    assert p.returncode == 0, out
    assert "failed" not in out, out
  workdirs = [os.path.join(tmp_path, "r", n) for n in os.listdir(tmp_path / "r") if n != "logs"]
  assert len(workdirs) == 2
  assert all(os.path.exists(os.path.join(w, "summary.json")) for w in workdirs)


# -- folder names, the status table, checks before any run -----------------------------------------
def test_a_point_has_one_folder_whatever_the_order_of_its_fields(tmp_path, capsys):
  point = [("stream.wait", "1"), ("seed", "0"), ("model.width", "8")]
  made = {sweep.command(SMOKE, str(tmp_path), order, [])[1]
          for order in (point, point[::-1], point[1:] + point[:1])}
  (workdir,) = made
  assert os.path.basename(workdir).startswith("width-8_wait-1_seed-0-")
  one = _dry(tmp_path, capsys, "--grid=stream.wait=1", "--grid=seed=0", "--grid=model.width=8")
  other = _dry(tmp_path, capsys, "--grid=model.width=8", "--grid=seed=0", "--grid=stream.wait=1")
  assert [l.split("--workdir=")[1].split()[0] for l in one] == \
      [l.split("--workdir=")[1].split()[0] for l in other]


def _done(workdir, resolved, summary=True):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(resolved, f)
  if summary:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      f.write("{}")


def test_folders_named_in_the_grid_s_field_order_are_still_found(tmp_path, monkeypatch, capsys):
  # Folders of an earlier sweep, named in the grid's field order: a finished point there is
  # done, an unfinished one resumes there, a folder of the same hash but another config is not it.
  point = [("seed", "0"), ("stream.wait", "1")]
  _, canonical, resolved = sweep.command(SMOKE, str(tmp_path), point, [])
  digest = canonical.rsplit("-", 1)[1]
  old = tmp_path / f"seed-0_wait-1-{digest}"
  _done(old, resolved)
  assert sweep.command(SMOKE, str(tmp_path), point, [])[1] == str(old)
  calls, _ = _fake_runs(monkeypatch)
  flags = [f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0", "--grid=stream.wait=1",
           "--no-report"]
  assert sweep.main(flags) == 0
  assert "[1/1] done, skipped: " in capsys.readouterr().out and not calls
  assert not os.path.exists(canonical)
  os.unlink(old / "summary.json")
  assert sweep.main(flags) == 0
  (cmd,) = calls
  assert f"--workdir={old}" in cmd
  other = dict(resolved, seed=5)
  with open(old / "config.json", "w") as f:
    json.dump(other, f)
  assert sweep.command(SMOKE, str(tmp_path), point, [])[1] == canonical


def test_status_is_a_table_of_the_points_and_starts_nothing(tmp_path, monkeypatch, capsys):
  flags = [f"--config={SMOKE}", f"--root={tmp_path}", "--grid=model.width=4,8,16,32",
           "--no-report"]
  made = [sweep.command(SMOKE, str(tmp_path), [("model.width", w)], []) for w in
          ("4", "8", "16", "32")]
  _done(made[0][1], made[0][2])  # done
  _fake_runs(monkeypatch, exit_code=3)
  assert sweep.main(flags + ["--grid=model.width=16"]) == 1  # the run of width 16 fails
  assert "failed: exit code 3" in capsys.readouterr().out
  os.makedirs(made[1][1])
  with workdir_lock.hold(made[1][1]):  # width 8 runs in another process
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("ran a command"))
    assert sweep.main(flags + ["--status"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"4 points in {tmp_path}:"
  assert out[1].split() == ["#", "state", "folder", "detail"]
  rows = {line.split()[2]: line.split(None, 3)[1:] for line in out[2:6]}
  names = [os.path.basename(w) for _, w, _ in made]
  assert rows[names[0]][0] == "done"
  assert rows[names[1]][0] == "running" and f"pid {os.getpid()}" in rows[names[1]][2]
  assert rows[names[2]][0] == "failed" and "exit code 3" in rows[names[2]][2]
  assert out[5].split()[1:3] == ["to", "run"] and names[3] in out[5]
  assert out[6] == "1 done, 1 running, 1 failed, 1 to run"
  # A run that succeeds clears the failure.
  _fake_runs(monkeypatch)
  assert sweep.main(flags + ["--grid=model.width=16"]) == 0
  assert not os.path.exists(tmp_path / "logs")


def test_status_says_the_time_left_at_the_pace_of_the_done_runs(tmp_path, monkeypatch, capsys):
  path = _grid_file(tmp_path, 'GRID = {"model.width": [4, 8, 16], "seed": [0]}\n'
                    'def run_seconds(config):\n  return 15 * config["model"]["width"]\n')
  flags = [f"--config={SMOKE}", f"--root={tmp_path / 'r'}", f"--grid_file={path}", "--status"]
  monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("ran a command"))
  assert sweep.main(flags) == 0
  assert capsys.readouterr().out.splitlines()[-1] == (
      "time left: 7m00s for 3 point(s), one after another, by the grid file's run_seconds (on "
      "the host it was measured on; no run done here to scale it by)")
  # Width 4 (60 s by the estimate) took 180 s here: the 360 s left take 3x that.
  made = sweep.plan(sweep._args(flags))
  workdir, resolved = next((w, r) for _, w, r, _ in made.values() if r["model"]["width"] == 4)
  _done(workdir, resolved)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({"wall_s": 180.0}, f)
  assert sweep.main(flags) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[-2] == "1 done, 2 to run"
  assert out[-1] == ("time left: 18m00s for 2 point(s), one after another, by the grid file's "
                     "run_seconds x 3 (the pace of the 1 done)")


def test_every_point_is_checked_before_any_run(tmp_path, monkeypatch, capsys):
  # The smoke config has B=4 mega-batches: waits 3 and 5 are invalid, and the data set name.
  monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("ran a command"))
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=stream.wait=1,3,2,5",
                   "--grid=seed=0,1", "--parallel=2"])
  err = capsys.readouterr().err
  assert rc == 2
  assert "sweep: 2 of 4 points are invalid; no run was started:" in err
  assert re.search(r"\[2/4\] wait-3_seed-0_num_seeds-2-\w+: config\.stream\.wait=3 does not "
                   r"divide config\.stream\.num_megabatches=4; allowed values: \[1, 2, 4\]", err)
  assert "[4/4] wait-5_" in err and "[1/4]" not in err
  assert not os.path.exists(tmp_path / "logs")
  # A dry run and a SLURM script are checked too; the mesh of runs elsewhere is theirs.
  assert sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=stream.wait=3",
                     "--dry_run"]) == 2
  path = tmp_path / "s.sbatch"
  assert sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=stream.wait=3",
                     f"--slurm={path}"]) == 2 and not path.exists()
  assert sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=mesh.num_devices=64",
                     f"--slurm={path}"]) == 0
  assert sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=mesh.num_devices=64",
                     "--dry_run"]) == 2
  assert "only 8 cpu devices are visible" in capsys.readouterr().err


def test_grid_values_of_one_config_make_one_workdir(tmp_path, capsys):
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--dry_run",
                   "--grid=optimizer.kwargs.learning_rate=0.1,1e-1,0.10,0.2"])
  assert rc == 0
  out = capsys.readouterr()
  lines = out.out.strip().splitlines()
  assert len(lines) == 2, lines
  assert sum(bool(re.search(r"--config\.optimizer\.kwargs\.learning_rate=0\.1(\s|$)", l))
             for l in lines) == 1
  assert "learning_rate-0.1-" in lines[0] and "learning_rate-0.2-" in lines[1]
  assert out.err.count("resolves to the config of learning_rate-0.1-") == 2
  # A float field given as an integer is written as the float it holds.
  lines = _dry(tmp_path, capsys, "--grid=stream.replay=0,0.0")
  assert len(lines) == 1 and "--config.stream.replay=0.0" in lines[0]


def test_a_root_that_is_a_file_is_refused(tmp_path):
  path = tmp_path / "notes.txt"
  path.write_text("mine")
  with pytest.raises(SystemExit, match=r"^sweep: error: --root=.*notes\.txt exists and is not a "
                                       r"directory"):
    sweep.main([f"--config={SMOKE}", f"--root={path}", "--grid=seed=0", "--dry_run"])
  assert path.read_text() == "mine"


@pytest.mark.parametrize("flags, message", [
    (["--root="], r"--root is empty; give a directory"),
    (["--root={tmp}", "--report_dir="], r"--report_dir is empty; give the directory for the "
                                        r"report, or leave the flag out for <root>/report")])
def test_an_empty_root_or_report_folder_is_refused_before_anything_runs(flags, message, tmp_path,
                                                                        monkeypatch):
  monkeypatch.chdir(tmp_path)  # where an empty folder would put the workdirs
  with pytest.raises(SystemExit, match=rf"^sweep: error: {message}"):
    sweep.main([f"--config={SMOKE}", "--grid=seed=0"] + [f.format(tmp=tmp_path / "root")
                                                         for f in flags])
  assert not os.listdir(tmp_path)


def test_a_repeated_value_is_refused(tmp_path):
  with pytest.raises(SystemExit, match=r"^sweep: error: --grid='seed=0,1,0' repeats 0: each "
                                       r"value once$"):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0,1,0", "--dry_run"])


def test_a_later_grid_flag_replaces_an_earlier_one_s_field(tmp_path, capsys):
  # Its values alone, each point's command with one value of the field (the last flag's).
  lines = _dry(tmp_path, capsys, "--grid=model.width=4,8", "--grid=stream.wait=1,2",
               "--grid=model.width=16")
  runs = [l for l in lines if l.startswith("[")]
  assert len(runs) == 2 and all(l.count("--config.model.width=") == 1 for l in runs)
  assert all("--config.model.width=16" in l and "/width-16_wait-" in l for l in runs)


def test_a_value_the_field_refuses_is_named_with_the_config_as_given(tmp_path):
  with pytest.raises(SystemExit, match=r"^sweep: error: --config=mnist_sm:smoke: "
                                       r"config\.model\.width='a' must be an integer, got str$"):
    sweep.main(["--config=mnist_sm:smoke", f"--root={tmp_path}", "--grid=model.width=4,a",
                "--dry_run"])


def test_a_grid_file_that_raises_is_one_line_naming_its_line(tmp_path):
  path = _grid_file(tmp_path, "WIDTHS = [8]\nGRID = {'model.width': WIDTHS + [undefined]}\n")
  with pytest.raises(SystemExit, match=r"^sweep: error: --grid_file=.*grid\.py: .*grid\.py, "
                                       r"line 2: NameError: name 'undefined' is not defined$"):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", f"--grid_file={path}", "--dry_run"])


def _alma_jax(*args, cwd):
  import shutil  # pylint: disable=g-import-not-at-top
  exe = shutil.which("alma-jax", path=os.path.dirname(sys.executable))
  if exe is None:
    pytest.fail("the alma-jax command is not installed beside this Python (pip install -e .)")
  return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=ROOT))


def test_alma_jax_sweep_and_report_work_from_any_folder_by_name(tmp_path):
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  proc = _alma_jax("sweep", "--config=mnist_sm:smoke", f"--root={tmp_path / 's'}",
                   "--grid=seed=0,1", "--dry_run", "--no-validate", cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (line,) = [l for l in proc.stdout.splitlines() if "alma_jax.main" in l]
  assert f"--config={os.path.join(ROOT, 'configs', 'mnist_sm.py')}:smoke" in line
  # A grid shipped with alma_jax by name; its configs/<file> entries resolve from here too.
  proc = _alma_jax("sweep", "--grid_file=findings_cifar", f"--root={tmp_path / 'c'}", "--dry_run",
                   "--no-validate", cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert sum("alma_jax.main" in l for l in proc.stdout.splitlines()) == 57
  proc = _alma_jax("sweep", "--grid_file=no_such_grid", f"--root={tmp_path / 'c'}", "--dry_run",
                   cwd=elsewhere)
  assert proc.returncode != 0
  assert "no such file, nor a grid of alma_jax's (names: beyond, findings" in proc.stderr
  # The report, of a run that is not there: its own one-line error, from the report command.
  proc = _alma_jax("report", f"--workdirs={tmp_path / 'nothing'}", f"--out={tmp_path / 'r'}",
                   cwd=elsewhere)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith("report: error: --workdirs: ")
  # The findings of a committed results.csv, by the shipped grid's name.
  proc = _alma_jax("findings", f"--results={ROOT}/docs/reproduction/mnist/results.csv",
                   "--grid_file=findings", cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("| finding | claim | verdict |"), proc.stdout[:200]


@pytest.mark.parametrize("word, message", [
    ("reprot", "unknown command 'reprot' (did you mean 'report'?); the commands: sweep, report, "
               "findings, rerun; a run takes flags only: alma-jax --config=NAME --workdir=DIR"),
    ("mnist_sm", "unknown command 'mnist_sm'; the commands: sweep, report, findings, rerun;"),
])
def test_a_word_that_names_no_command_is_refused_with_the_commands(word, message, monkeypatch,
                                                                   capsys):
  from alma_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sys, "argv", ["alma-jax", word, "--config=mnist_sm:smoke"])
  with pytest.raises(SystemExit) as info:
    main_lib.console()
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"alma_jax: error: {message}") and err.count("\n") == 1, err


def test_a_sequential_sweep_says_after_each_run_how_long_it_took_and_the_sweep_s_eta(
    tmp_path, monkeypatch, capsys):
  _fake_runs(monkeypatch, seconds=0.2)
  rc = sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", "--grid=seed=0,1,2",
                   "--seeds_together=no", "--no-report"])
  assert rc == 0
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("sweep: [")]
  assert [l.split(" ended")[0] for l in lines] == ["sweep: [1/3]", "sweep: [2/3]", "sweep: [3/3]"]
  assert lines[0].endswith("1 ended here, 2 to go, sweep_eta=<1s")  # two runs of 0.2 s
  assert lines[-1].endswith("3 ended here, 0 to go, sweep_eta=0s")


def test_the_eta_scales_the_grid_s_estimates_by_the_runs_that_ended():
  # Two runs ended in 2 + 4 s against estimates of 1 + 2: this host takes 2x the estimates.
  ended = [(2.0, 1.0), (4.0, 2.0)]
  # Left: two runs of estimates 3 and 1 (6 + 2 s) and one of estimate 2 running for 1 s (3 s).
  assert sweep.sweep_eta(ended, [3.0, 1.0], [(1.0, 2.0)], parallel=1) == (11.0, 2.0)
  assert sweep.sweep_eta(ended, [3.0, 1.0], [(1.0, 2.0)], parallel=2) == (5.5, 2.0)
  # A running run past its scaled estimate counts as ending now.
  assert sweep.sweep_eta(ended, [], [(9.0, 2.0)], parallel=1) == (0.0, 2.0)
  # A run without an estimate: every run left counts as the mean of the ended ones (3 s).
  assert sweep.sweep_eta(ended, [3.0, None], [(1.0, 2.0)], parallel=1) == (9.0, None)
  assert sweep.sweep_eta([(2.0, None)], [None], [], parallel=1) == (2.0, None)
  # No run finished yet: the estimates as they are (factor 1), or no ETA without them.
  assert sweep.sweep_eta([], [3.0, 1.0], [(1.0, 2.0)], parallel=1) == (5.0, 1.0)
  assert sweep.sweep_eta([], [None], [(1.0, None)], parallel=1) == (None, None)


def test_a_failed_run_sets_no_pace_for_the_eta(tmp_path, monkeypatch, capsys):
  # Width 4 fails at once; widths 8 and 16 take 0.3 s (with estimates: 120 and 240 s).
  def width(cmd):
    return next(int(a.split("=")[1]) for a in cmd if a.startswith("--config.model.width="))
  _fake_runs(monkeypatch, seconds=lambda cmd: 0.0 if width(cmd) == 4 else 0.3,
             exit_code=lambda cmd: 3 if width(cmd) == 4 else 0)
  path = _grid_file(tmp_path, 'GRID = {"model.width": [4, 8, 16], "seed": [0]}\n'
                    'def run_seconds(config):\n'
                    '  return {4: 6000, 8: 120, 16: 240}[config["model"]["width"]]\n')
  assert sweep.main([f"--config={SMOKE}", f"--grid_file={path}", "--no-report",
                     f"--root={tmp_path / 'a'}"]) == 1
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("sweep: [")]
  assert len(lines) == 3, lines
  # After the failure: the estimates left as they are (120 + 240 s), not scaled by its 0 s.
  assert lines[0].endswith("1 ended here, 2 to go, sweep_eta=6m00s (the grid file's "
                           "run_seconds; no run finished yet to scale it)"), lines[0]
  # Then the pace of width 8 alone: its time (>= 0.3 s) over its 120 s, where counting the
  # failed run would give that time over 6120 s.
  assert "2 ended here, 1 to go, sweep_eta=" in lines[1], lines[1]
  factor = float(re.search(r"run_seconds x ([0-9.e-]+)\)$", lines[1]).group(1))
  assert 0.3 / 120 * 0.999 <= factor < 30 / 120, lines[1]  # 3 significant digits printed
  # Without estimates: no ETA until a run finished, then the mean of the finished runs only
  # (1.5 s and more, where counting the failed run would halve it).
  _fake_runs(monkeypatch, seconds=lambda cmd: 0.0 if width(cmd) == 4 else 1.5,
             exit_code=lambda cmd: 3 if width(cmd) == 4 else 0)
  assert sweep.main([f"--config={SMOKE}", "--grid=model.width=4,8,16", "--grid=seed=0",
                     "--no-report", f"--root={tmp_path / 'b'}"]) == 1
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("sweep: [")]
  assert lines[0].endswith("1 ended here, 2 to go, sweep_eta=? (no run finished yet)"), lines
  assert re.search(r"2 ended here, 1 to go, sweep_eta=([2-9]|[1-9][0-9])s$", lines[1]), lines


def test_a_grid_file_s_run_seconds_gives_the_sweep_its_estimate_and_its_eta(
    tmp_path, monkeypatch, capsys):
  _fake_runs(monkeypatch, seconds=0.1)
  path = _grid_file(tmp_path, 'GRID = {"model.width": [4, 8, 16], "seed": [0]}\n'
                    'def run_seconds(config):\n  return 15 * config["model"]["width"]\n')
  base = [f"--config={SMOKE}", f"--grid_file={path}", "--no-report"]
  assert sweep.main(base + [f"--root={tmp_path / 'a'}"]) == 0
  err = capsys.readouterr().err.splitlines()
  assert ("sweep: 3 run(s) to go, 7m00s one after another by the grid file's run_seconds (on "
          "the host it was measured on; after each run the ETA scales it to this one)") in err
  lines = [l for l in err if l.startswith("sweep: [")]
  assert len(lines) == 3
  assert all(re.search(r"sweep_eta=\S+ \(the grid file's run_seconds x [0-9.e-]+\)$", l)
             for l in lines), lines
  assert "3 ended here, 0 to go, sweep_eta=0s (" in lines[-1]
  # No estimate for one point: the mean of the ended runs, and a note that says why.
  none = _grid_file(tmp_path, 'GRID = {"model.width": [4, 8], "seed": [0]}\n'
                    'def run_seconds(config):\n  return {4: 60}.get(config["model"]["width"])\n')
  assert sweep.main([f"--config={SMOKE}", f"--grid_file={none}", "--no-report",
                     f"--root={tmp_path / 'b'}"]) == 0
  err = capsys.readouterr().err
  assert re.search(r"run_seconds of point \[2\] \S*width-8\S* is None \(no estimate\); the "
                   "ETA counts every run as the mean of those that ended", err), err
  assert "one after another" not in err and "run_seconds x" not in err


def test_a_resumed_run_counts_in_the_eta_with_its_whole_time(tmp_path, monkeypatch, capsys):
  # The run of width 4 ends 0.1 s after it started here, but its summary says it took 180 s in
  # all (an earlier process ran most of it): the pace is 180 s for its 60 s estimate.
  def resumed(cmd):
    workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
    if "width-4" in workdir:
      os.makedirs(workdir, exist_ok=True)
      with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"wall_s": 180.0}, f)
  _fake_runs(monkeypatch, seconds=0.1, on_start=resumed)
  path = _grid_file(tmp_path, 'GRID = {"model.width": [4, 8], "seed": [0]}\n'
                    'def run_seconds(config):\n  return 15 * config["model"]["width"]\n')
  assert sweep.main([f"--config={SMOKE}", f"--grid_file={path}", "--no-report",
                     f"--root={tmp_path / 'r'}"]) == 0
  first = next(l for l in capsys.readouterr().err.splitlines() if l.startswith("sweep: [1/2]"))
  assert first.startswith("sweep: [1/2] ended after <1s; ")
  assert first.endswith("1 to go, sweep_eta=6m00s (the grid file's run_seconds x 3)")


@pytest.mark.parametrize("text, message", [
    ("def run_seconds(config):\n  return 1 / 0\n",
     r"run_seconds of point \[1\] \S+ failed: ZeroDivisionError: division by zero$"),
    ("def run_seconds(config):\n  return -1\n",
     r"run_seconds of point \[1\] \S+ returned -1; it must return seconds > 0, or None where "
     "it has no estimate$"),
    ("def run_seconds(config):\n  return '60'\n",
     r"run_seconds of point \[1\] \S+ returned '60'; it must return seconds > 0"),
    ("run_seconds = 60\n", r"run_seconds must be a function of a point's resolved config "
     r"\(a nested dict\); got int$"),
])
def test_a_bad_run_seconds_is_an_error_before_any_run(tmp_path, monkeypatch, text, message):
  calls, _ = _fake_runs(monkeypatch)
  path = _grid_file(tmp_path, 'GRID = {"model.width": [4], "seed": [0]}\n' + text)
  with pytest.raises(SystemExit, match=rf"^sweep: error: --grid_file=\S+grid\.py: {message}"):
    sweep.main([f"--config={SMOKE}", f"--root={tmp_path}", f"--grid_file={path}", "--no-report"])
  assert not calls


@pytest.mark.parametrize("path, runs", [("launch/grids/findings.py", 34),
                                        ("launch/grids/findings_cifar.py", 57),
                                        ("launch/grids/beyond.py", 66),
                                        ("launch/grids/lm_growth.py", 14),
                                        ("launch/grids/ten_seeds.py", 29)])
def test_the_findings_grids_estimate_every_run_from_their_time_tables(tmp_path, path, runs):
  # run_seconds names every run of the grid (its TIME_S), so the sweep's ETA uses it throughout.
  made = sweep.plan(sweep._args([f"--root={tmp_path}", f"--grid_file={path}"]))
  todo = [(i + 1, cmd, w, r) for i, (cmd, w, r, _) in enumerate(made.values())]
  estimates = sweep.run_estimates(path, todo)
  assert len(todo) == runs and len(estimates) == runs

  def by(**fields):  # the estimates of the runs with these fields (section__name=value)
    return [estimates[w] for _, _, w, r in todo
            if all(r.get(k.split("__")[0]).get(k.split("__")[1]) == v for k, v in fields.items())]

  if path.endswith("findings_cifar.py"):  # three seeds of each point's TIME_S, one run each
    scope = {}
    exec(open(path).read(), scope)  # pylint: disable=exec-used
    assert sum(estimates.values()) == 3 * sum(scope["TIME_S"].values())
    assert by(method__name="gmoe") == [221] * 3
    assert by(method__name="ens", stream__replay=1.0) == [247] * 3
  elif path.endswith("beyond.py"):  # MNIST's seeds in one run, but for the triggered waits
    assert by(data__name="cifar10", stream__warm_start="scratch") == [224] * 3
    assert by(model__width=4, stream__wait_policy="triggered", stream__trigger_fraction=0.1
              ) == [29] * 3
    assert by(model__width=64, stream__wait_policy="geometric", stream__geometric_w0=10.0
              ) == [35]
  elif path.endswith("lm_growth.py"):  # SM's and gEns's seeds in one run, gMoE's apart
    assert by(method__name="lm_sm", model__num_experts=12, model__dim=0) == [372]
    assert by(method__name="lm_gmoe", model__dim=0) == [162] * 3
    assert by(method__name="lm_gens", model__dim=0) == [774]
    assert by(method__name="lm_gmoe", model__dim=128) == [118] * 3
    # A point of neither model (another dim) has no estimate, as the file's docstring says.
    other = {"method": {"name": "lm_sm"}, "model": {"dim": 96, "num_experts": 4}}
    assert sweep.load_run_seconds(path)(other) is None
  elif path.endswith("ten_seeds.py"):  # SM's ten seeds in one run, gMoE's apart
    from alma_jax.reports import grid_files  # pylint: disable=g-import-not-at-top
    scope = grid_files.scope(path)
    assert sorted(estimates.values()) == sorted(
        [s for f, s in scope["TIME_S"] if f["method.name"] == "sm"]
        + [s for f, s in scope["TIME_S"] if f["method.name"] == "gmoe" for _ in range(10)])
    assert by(method__name="gmoe", method__tree=False) == [50] * 10
    assert by(method__name="sm", model__width=4, stream__wait=1,
              stream__warm_start="redo") == [227]
  else:  # the seeds of a point in one run, but for gMoE and Firefly
    assert by(method__name="lm_ens", stream__num_megabatches=4, stream__iid=False) == [755]
    assert by(method__name="gmoe", method__tree=False) == [35] * 3
    assert by(method__name="sm", model__width=64, stream__wait=50, stream__replay=1.0) == [100]
