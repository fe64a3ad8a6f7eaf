"""Tests of the multi-process launchers (launch/local.py, launch/slurm.py, launch/tpu_pod.py);
the local launcher runs for real in tests/test_multiprocess.py."""

import os
import shlex
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import local  # pylint: disable=g-import-not-at-top,wrong-import-position
import slurm  # pylint: disable=g-import-not-at-top,wrong-import-position
import tpu_pod  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = ["--config=configs/cifar_gens.py", "--workdir=/shared/run dir"]


def test_local_launcher_gives_every_process_its_id_and_the_loopback_coordinator():
  cmds = local.commands(FLAGS, 3, 1234)
  assert len(cmds) == 3
  for i, cmd in enumerate(cmds):
    assert cmd[1:3] == ["-m", "alma_jax.main"] and cmd[3:5] == FLAGS
    assert cmd[5:] == ["--jax_distributed", "--coordinator_address=127.0.0.1:1234",
                       "--num_processes=3", f"--process_id={i}"]


def test_slurm_script_runs_one_process_per_gpu(tmp_path):
  path = tmp_path / "run.sbatch"
  assert slurm.main(["--nodes=2", "--gpus_per_node=8", "--time=2:00:00", f"--script={path}",
                     "--option=--account=abc", "--", *FLAGS]) == 0
  text = path.read_text()
  for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
               "#SBATCH --time=2:00:00", "#SBATCH --account=abc"):
    assert line + "\n" in text
  srun = [l for l in text.splitlines() if l.startswith("srun ")]
  assert len(srun) == 1
  assert shlex.split(srun[0])[2:] == ["python", "-m", "alma_jax.main", "--jax_distributed",
                                      *FLAGS]


def test_tpu_pod_copies_installs_and_runs_the_same_command_on_every_worker(tmp_path, capsys):
  assert tpu_pod.main(["--tpu=pod", "--zone=z", "--project=p", "--dry_run", "--", *FLAGS]) == 0
  lines = [shlex.split(l) for l in capsys.readouterr().out.splitlines()]
  assert [l[4] for l in lines] == ["scp", "ssh", "ssh", "ssh"]
  assert all("--worker=all" in l and "--zone=z" in l and "--project=p" in l for l in lines)
  run = next(a for a in lines[-1] if a.startswith("--command="))[len("--command="):]
  assert shlex.split(run.split(" && ", 1)[1]) == [".venv/bin/python", "-m", "alma_jax.main",
                                                   "--jax_distributed", *FLAGS]
  assert "jax[tpu]==0.10.2" in " ".join(lines[2])
  tpu_pod.main(["--tpu=pod", "--zone=z", "--steps=run", "--dry_run", "--", *FLAGS])
  assert len(capsys.readouterr().out.splitlines()) == 1
  archive = tmp_path / "code.tar.gz"
  tpu_pod.write_archive(str(archive))
  with tarfile.open(archive) as tar:
    names = set(tar.getnames())
  assert {"alma_jax/main.py", "requirements.txt", "launch/tpu_pod.py"} <= names
