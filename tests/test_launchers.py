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


# -- a batch script or a pod run that would fail is refused before it is written or started --
import run_flags  # pylint: disable=g-import-not-at-top,wrong-import-position

OK = ["--config=configs/mnist_sm.py", "--workdir=/shared/runs/a"]


@pytest.mark.parametrize("flags, message", [
    ([], "the flags after -- must give --config=<config file or name>"),
    (["--workdir=/x"], "the flags after -- must give --config=<config file or name>"),
    (["--config=mnist_sm"], "the flags after -- must give --workdir=<folder>"),
    (["--config=mnsit_sm", "--workdir=/x"],
     "--config=mnsit_sm: no config file or name 'mnsit_sm'; did you mean 'mnist_sm'?"),
    (["--config", "mnist_sm:smok", "--workdir", "/x"],
     "--config=mnist_sm:smok: config variant 'smok' is unknown; valid: ['paper', 'smoke', "
     "'quick']"),
    (OK + ["--config.stream.wiat=2"], "--config=configs/mnist_sm.py: --config.stream.wiat: "
     "stream has no field 'wiat' in configs/mnist_sm.py"),
    (OK + ["--config.stream.wait=7"],
     "config.stream.wait=7 does not divide config.stream.num_megabatches=500"),
    (OK + ["--config.model.width=0"], "config.model.width=0"),
], ids=["nothing", "no_config", "no_workdir", "unknown_name", "unknown_variant",
        "unknown_field", "broken_rule", "bad_value"])
def test_flags_that_cannot_start_a_run_are_named_before_the_launch(flags, message):
  found = run_flags.problem(flags)
  assert found is not None and found.startswith(message), found
  assert "\n" not in found


def test_flags_of_a_valid_run_pass_whatever_this_machine_holds(monkeypatch, tmp_path):
  # Checked from the repository's folder, by name or path, without the data (which the
  # run's machines hold): a data folder with nothing in it changes nothing.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
  (tmp_path / "configs").mkdir()  # not the file the run reads: the repository's is
  (tmp_path / "configs" / "mnist_sm.py").write_text("raise RuntimeError('not this one')\n")
  for flags in (OK, ["--config=mnist_gmoe:quick", "--workdir=rel", "--config.method.grow_every=2"],
                ["-config", "lm_gmoe:smoke", "-workdir", "/x", "--overwrite"]):
    assert run_flags.problem(flags) is None, flags
  assert run_flags.problem(["--config=mnist_sm", "--workdir=rel"],
                           shared_workdir_absolute=True).startswith(
                               "--workdir=rel must be an absolute path to a folder that every "
                               "worker sees")


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("30:15", 1815), ("2:00:00", 7200), ("1-12", 129600), ("1-12:30", 131400),
    ("1-0:0:5", 86405), ("0", None), ("UNLIMITED", None), ("infinite", None)])
def test_slurm_time_limits_in_every_format_slurm_takes(text, seconds):
  assert slurm.time_limit_s(text) == seconds


@pytest.mark.parametrize("text", ["abc", "1:2:3:4", "-5", "1-", "2h", ""])
def test_slurm_time_limit_that_is_none_of_slurm_s_formats(text):
  with pytest.raises(ValueError):
    slurm.time_limit_s(text)


@pytest.mark.parametrize("args, message", [
    (["--nodes=0"], "--nodes=0 must be >= 1"),
    (["--gpus_per_node=0"], "--gpus_per_node=0 must be >= 1"),
    (["--cpus_per_task=0"], "--cpus_per_task=0 must be >= 1"),
    (["--time=2h"], "--time=2h is not a SLURM time limit; allowed: minutes, minutes:seconds,"),
    (["--signal_s=-5"], "--signal_s=-5 must be from 0 to 65535 seconds"),
    (["--time=1:00"], "the time limit --time=1:00 (60 s) must be longer than the 120 s before "
     "it at which the run is told to save and stop"),
    (["--option=--time=2h"], "--option=--time=2h is not a SLURM time limit"),
    (["--job_name=a b"], "--job_name='a b' must not contain spaces"),
    (["--option=account=abc"], "--option='account=abc' must be one sbatch option, e.g. "
     "--option=--account=abc"),
    (["--script={tmp}/missing/run.sbatch"], "--script={tmp}/missing/run.sbatch: its folder "
     "{tmp}/missing does not exist"),
    (["--script={tmp}"], "--script={tmp} is a directory"),
    (["--submit"], "--submit: sbatch is not on this machine's PATH"),
    (["--", "--config=configs/mnist_sm.py"], "the flags after -- must give --workdir="),
], ids=["nodes", "gpus", "cpus", "time", "signal_range", "signal_past_limit", "option_time",
        "job_name",
        "option", "script_folder", "script_dir", "no_sbatch", "run_flags"])
def test_slurm_refuses_a_script_that_would_not_run_and_writes_nothing(args, message, tmp_path,
                                                                      capsys, monkeypatch):
  monkeypatch.setattr(slurm.shutil, "which", lambda name: None)  # no SLURM here
  args = [a.format(tmp=tmp_path) for a in args]
  script = [] if any(a.startswith("--script") for a in args) else [f"--script={tmp_path}/r.sb"]
  flags = [] if "--" in args else ["--", *OK]
  with pytest.raises(SystemExit) as info:
    slurm.main(script + args + flags)
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert f": error: {message.format(tmp=tmp_path)}" in err, err
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flags, path, message", [
    (["--config=mnist_sm", "--workdir=runs/a"], "/usr/bin", "--workdir=runs/a must be an "
     "absolute path to a folder that every worker sees"),
    (["--config=mnist_sm:smok", "--workdir=/x"], "/usr/bin", "config variant 'smok' is unknown"),
    (["--config=mnist_sm", "--workdir=/x"], "", "gcloud is not on this machine's PATH"),
], ids=["relative_workdir", "bad_config", "no_gcloud"])
def test_tpu_pod_refuses_a_run_that_would_fail_before_copying_anything(flags, path, message,
                                                                       capsys, monkeypatch):
  monkeypatch.setattr(tpu_pod.shutil, "which", lambda name: f"{path}/{name}" if path else None)
  monkeypatch.setattr(tpu_pod, "execute", lambda *a, **k: pytest.fail("started"))
  with pytest.raises(SystemExit) as info:
    tpu_pod.main(["--tpu=t", "--zone=z", "--", *flags])
  assert info.value.code == 2
  assert message in capsys.readouterr().err
