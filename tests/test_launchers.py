"""Tests of the multi-process launchers (launch/local.py, launch/slurm.py, launch/tpu_pod.py);
the local launcher runs for real in tests/test_multiprocess.py."""

import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time

import pytest

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
  for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", f"cd {ROOT}"):
    assert line + "\n" in text
  srun = [l for l in text.splitlines() if l.startswith("srun ")]
  assert len(srun) == 1
  assert srun[0].endswith(" &")  # in the background, so that the shell takes signals
  assert shlex.split(srun[0][:-2])[2:] == ["python", "-m", "alma_jax.main", "--jax_distributed",
                                           *FLAGS]
  proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


# A run that saves and exits 143 on SIGTERM, as alma_jax.main does; its pid goes to argv[1].
TERM_143 = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
            "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
            "time.sleep(60)\n"
            "sys.exit(0)\n")


@pytest.mark.parametrize("signum, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_the_batch_shell_stops_the_run_on_a_signal_and_requeues_before_the_time_limit(
    tmp_path, signum, requeued):
  # SLURM's time-limit signal (SIGUSR1 to the batch shell) stops the run, which saves and exits
  # 143, and requeues the job; SIGTERM (preemption, scancel) stops it without a requeue.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol'}\n")
  (bin_dir / "scontrol").chmod(0o755)
  pid_file = tmp_path / "pid"
  command = shlex.join([sys.executable, "-c", TERM_143, str(pid_file)])
  script = tmp_path / "job.sh"
  script.write_text("\n".join(["set -euo pipefail", *slurm.run_lines(command)]) + "\n")
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77")
  shell = subprocess.Popen(["bash", str(script)], env=env)
  try:
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
      time.sleep(0.05)
    run_pid = int(pid_file.read_text())
    shell.send_signal(signum)
    assert shell.wait(timeout=20) == 143
    assert not _running(run_pid)
  finally:
    shell.kill()
    shell.wait()
  calls = (tmp_path / "scontrol").read_text() if (tmp_path / "scontrol").exists() else ""
  assert calls == ("requeue 77\n" if requeued else "")


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
  # The devices page says how many commands a dry run prints.
  with open(os.path.join(ROOT, "docs", "devices.md")) as f:
    readme = " ".join(f.read().split())
  said = re.search(r"`launch/tpu_pod\.py --dry_run` prints its (\w+) `gcloud", readme).group(1)
  assert said == ["one", "two", "three", "four", "five"][len(lines) - 1]
  archive = tmp_path / "code.tar.gz"
  tpu_pod.write_archive(str(archive))
  with tarfile.open(archive) as tar:
    names = set(tar.getnames())
  assert {"alma_jax/main.py", "requirements.txt", "launch/tpu_pod.py"} <= names


# -- the local launcher's processes: failures, signals, the command that resumes --------------------
def _wait_for_pids(folder, n, timeout_s=20.0):
  """The pids that `n` fake processes wrote to files in `folder`."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    names = os.listdir(folder) if os.path.isdir(folder) else []
    texts = [open(os.path.join(folder, name)).read() for name in names]
    if len(names) >= n and all(texts):
      return [int(t) for t in texts]
    time.sleep(0.05)
  raise AssertionError(f"{n} processes did not start within {timeout_s} s")


def _running(pid: int) -> bool:
  """Whether process `pid` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError):
    return False


def _kill_all(pids) -> None:
  for pid in pids:
    if _running(pid):
      os.kill(pid, signal.SIGKILL)


# A fake process that writes its pid to the file argv[1], then sleeps (ignoring SIGTERM with
# argv[2] == "ignore", as a process stuck in a collective does).
SLEEPER = ("import os, signal, sys, time\n"
           "if sys.argv[2:] == ['ignore']:\n"
           "  signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
           "time.sleep(60)\n")


def test_local_launcher_stops_every_process_as_soon_as_any_one_fails(tmp_path, monkeypatch,
                                                                     capsys):
  # Process 1 fails while process 0 waits (in a collective: it ignores SIGTERM); the launcher
  # stops process 0 at once, killing it after a short grace, and exits with process 1's code.
  pids = tmp_path / "pids"
  pids.mkdir()
  fail = "import sys, time; time.sleep(0.5); print('failing'); sys.exit(3)"
  monkeypatch.setattr(local, "commands", lambda args, n, port: [
      [sys.executable, "-c", SLEEPER, str(pids / "0"), "ignore"], [sys.executable, "-c", fail]])
  start = time.monotonic()
  try:
    assert local.launch([], 2) == 3
    assert time.monotonic() - start < 12
    (pid,) = _wait_for_pids(pids, 1)
    assert not _running(pid)
  finally:
    _kill_all(_wait_for_pids(pids, 1))
  captured = capsys.readouterr()
  assert "[1] failing\n" in captured.out
  assert "process 1 failed (exit code 3)" in captured.err


def _resume_command_of_main(env) -> str:
  code = ("import sys; sys.argv = ['alma_jax/main.py', '--config=c.py', '--workdir=/tmp/a b', "
          "'--overwrite']; from alma_jax import main; print(main._resume_command())")
  return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                        text=True, check=True).stdout.strip()


def test_a_run_started_by_a_launcher_names_the_launcher_s_command_to_resume():
  env = {k: v for k, v in os.environ.items() if k != "ALMA_JAX_RESUME_COMMAND"}
  env["PYTHONPATH"] = ROOT
  assert _resume_command_of_main(env) == "python -m alma_jax.main --config=c.py '--workdir=/tmp/a b'"
  env["ALMA_JAX_RESUME_COMMAND"] = "python launch/local.py -- --config=c.py"
  assert _resume_command_of_main(env) == "python launch/local.py -- --config=c.py"


def test_local_launcher_gives_its_processes_its_own_command_to_resume(monkeypatch, capsys):
  monkeypatch.chdir(ROOT)
  monkeypatch.delenv("ALMA_JAX_RESUME_COMMAND", raising=False)
  show = "import os; print(os.environ.get('ALMA_JAX_RESUME_COMMAND'))"
  monkeypatch.setattr(local, "commands", lambda args, n, port: [[sys.executable, "-c", show]] * n)
  assert local.main(["--num_processes=2", "--", "--config=c.py", "--workdir=/tmp/a b",
                     "--overwrite"]) == 0
  out = capsys.readouterr().out
  command = "python launch/local.py --num_processes=2 -- --config=c.py '--workdir=/tmp/a b'"
  assert f"[0] {command}\n" in out and f"[1] {command}\n" in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_local_launcher_stops_its_processes(tmp_path, signum):
  # SIGHUP reaches the processes as SIGTERM, on which a run stops at a safe point.
  pids = tmp_path / "pids"
  pids.mkdir()
  script = (f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'launch')!r})\nimport local\n"
            f"local.commands = lambda args, n, port: [[sys.executable, '-c', {SLEEPER!r}, "
            f"f'{pids}/{{i}}'] for i in range(n)]\n"
            "sys.exit(local.main(['--num_processes=2', '--', '--config=c.py']))\n")
  launcher = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
  children = []
  try:
    children = _wait_for_pids(pids, 2)
    launcher.send_signal(signum)
    out, _ = launcher.communicate(timeout=15)
    assert launcher.returncode == 128 + signum, out
    assert not any(_running(pid) for pid in children)
    for i in range(2):
      assert f"process {i} (pid {children[i]}): killed by SIGTERM (exit code 143)" in out, out
    assert "to resume, run the same command again: python launch/local.py --num_processes=2 " \
        "-- --config=c.py" in out
  finally:
    launcher.kill()
    launcher.wait()
    _kill_all(children)


@pytest.mark.parametrize("flag, message", [
    ("--num_processes=0", "--num_processes=0 must be >= 1"),
    ("--num_processes=-3", "--num_processes=-3 must be >= 1"),
    ("--devices_per_process=-1", "--devices_per_process=-1 must be >= 0"),
    ("--port=70000", "--port=70000 must be a port number"),
])
def test_local_launcher_refuses_counts_that_start_nothing(flag, message, capsys):
  with pytest.raises(SystemExit) as info:
    local.main([flag, "--", "--config=configs/mnist_sm.py:smoke", "--workdir=/nonexistent"])
  assert info.value.code == 2
  assert message in capsys.readouterr().err
