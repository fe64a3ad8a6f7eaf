"""Writes (and optionally submits) a SLURM batch script for one multi-node, multi-GPU run.

One process per GPU: `srun` starts `--gpus_per_node` tasks on each of
`--nodes` nodes, every task runs the same `python -m alma_jax.main` command,
and JAX reads the job's layout from SLURM's variables (the coordinator is
the first node of the step, the process id is SLURM_PROCID, each process
sees one GPU). The workdir must be on a file system that all nodes mount.

  python launch/slurm.py --nodes=2 --gpus_per_node=8 --script=run.sbatch -- \\
      --config=configs/cifar_gens.py --workdir=/shared/runs/cifar_gens
  sbatch run.sbatch

`--submit` calls sbatch itself. The script starts in the repository and runs
`--setup` first (by default it activates `.venv` when there is one).

Time limits and preemption: the job is requeueable (`--requeue`: SLURM puts
a preempted job back in the queue), and `--signal_s` seconds (default 120)
before its time limit SLURM sends the batch shell SIGUSR1, on which the
script passes SIGTERM on to the run (every run saves a checkpoint and stops,
exit code 143) and requeues the job itself. SIGTERM to the batch shell
(preemption, scancel) is passed on too, without a requeue. A requeued job
runs the same command, which resumes the run from its checkpoint.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys

import run_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SETUP = "if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi"
# Seconds before the time limit at which a run is told to save and stop.
SIGNAL_S = 120


def time_limit_s(text: str) -> int | None:
  """The seconds of a SLURM time limit (`--time`: minutes, minutes:seconds,
  hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds);
  None for no limit (0, UNLIMITED, INFINITE). Raises ValueError for another text."""
  if text.upper() in ("UNLIMITED", "INFINITE"):
    return None
  m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
  if m is None:
    raise ValueError(text)
  days, first, second, third = m.groups()
  if days is not None:  # days-hours[:minutes[:seconds]]
    hours, minutes, seconds = first, second or 0, third or 0
  elif third is not None:  # hours:minutes:seconds
    hours, minutes, seconds = first, second, third
  else:  # minutes[:seconds]
    hours, minutes, seconds = 0, first, second or 0
  total = ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)
  return total or None


def requeue_options(signal_s: int = SIGNAL_S) -> list[str]:
  """#SBATCH lines: requeueable, and SIGUSR1 to the batch shell `signal_s` s before the limit."""
  return ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{signal_s}"]


def setup_lines(root: str = ROOT, setup: str = DEFAULT_SETUP) -> list[str]:
  """Shell lines that enter the repository and its environment."""
  return [f"cd {shlex.quote(root)}", setup, 'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"']


def run_lines(command: str) -> list[str]:
  """Shell lines that run `command` (in the background, so that the shell can take signals)
  and exit with its exit code. SIGUSR1 (the time limit is near) passes SIGTERM on to it, on
  which the run saves a checkpoint and stops, and requeues the job; SIGTERM (preemption,
  scancel) is passed on alone."""
  return [
      "# Before the time limit (SIGUSR1) the run saves and stops, and the job is requeued: its",
      "# next start runs the same command, which resumes. SIGTERM is passed on, no requeue.",
      "requeue=0",
      'stop() { signalled=1; kill -TERM "$pid" 2>/dev/null || true; }',
      "trap 'requeue=1; stop' USR1",
      "trap stop TERM",
      f"{command} &",
      "pid=$!",
      "# A trapped signal ends `wait` early: wait again (for the run's exit code).",
      "while :; do",
      '  signalled=0 code=0',
      '  wait "$pid" || code=$?',
      '  [ "$signalled" = 1 ] || break',
      "done",
      'if [ "$requeue" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
      'exit "$code"',
  ]


def script(flags: list[str], *, nodes: int, gpus_per_node: int, cpus_per_task: int = 8,
           time: str = "", partition: str = "", job_name: str = "alma_jax",
           setup: str = DEFAULT_SETUP, root: str = ROOT, options: list[str] = (),
           signal_s: int = SIGNAL_S) -> str:
  """The text of the batch script."""
  lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
           f"#SBATCH --ntasks-per-node={gpus_per_node}", f"#SBATCH --gres=gpu:{gpus_per_node}",
           f"#SBATCH --cpus-per-task={cpus_per_task}", "#SBATCH --output=%x-%j.out"]
  lines += requeue_options(signal_s)
  lines += [f"#SBATCH --time={time}"] * bool(time) + [f"#SBATCH --partition={partition}"] * bool(
      partition) + [f"#SBATCH {o}" for o in options]
  cmd = shlex.join(["python", "-m", "alma_jax.main", "--jax_distributed", *flags])
  lines += ["set -euo pipefail"] + setup_lines(root, setup)
  lines += ["# One task per GPU; a task that fails ends the whole step (srun passes SIGTERM on)."]
  lines += run_lines(f"srun --kill-on-bad-exit=1 {cmd}")
  return "\n".join(lines) + "\n"


def limit_problem(time_flag: str, time: str, signal_s: int = SIGNAL_S) -> str | None:
  """Why the time limit `time` (given as `time_flag`=`time`) and the signal `signal_s` seconds
  before it cannot be a job's (one line), or None."""
  if not 0 <= signal_s <= 65535:
    return f"--signal_s={signal_s} must be from 0 to 65535 seconds (SLURM's range)"
  if not time:
    return None
  try:
    limit = time_limit_s(time)
  except ValueError:
    return (f"{time_flag}={time} is not a SLURM time limit; allowed: minutes, minutes:seconds, "
            "hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds "
            "or UNLIMITED")
  if limit is not None and signal_s >= limit:
    return (f"the time limit {time_flag}={time} ({limit} s) must be longer than the "
            f"{signal_s} s before it at which the run is told to save and stop")
  return None


def options_problem(flag: str, options: list[str], signal_s: int = SIGNAL_S) -> str | None:
  """Why the extra #SBATCH options `options` (each given as `flag`) cannot be a script's, a
  time limit among them checked as `limit_problem` does (one line), or None."""
  for option in options:
    if not option.startswith("-") or "\n" in option:
      return f"{flag}={option!r} must be one sbatch option, e.g. {flag}=--account=abc"
    name, _, value = option.partition("=")
    if name in ("--time", "-t"):
      found = limit_problem(f"{flag}={name}", value, signal_s)
      if found:
        return found
  return None


def script_problem(flag: str, path: str) -> str | None:
  """Why the batch script cannot be written at `path` (given as `flag`), or None."""
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    return f"{flag}={path}: its folder {folder} does not exist"
  if os.path.isdir(path):
    return f"{flag}={path} is a directory; give the batch script's file name"
  return None


def _refusal(a) -> str | None:
  """Why the flags `a` cannot make a script that runs (one line), or None."""
  for name in ("nodes", "gpus_per_node", "cpus_per_task"):
    if getattr(a, name) < 1:
      return f"--{name}={getattr(a, name)} must be >= 1"
  for name in ("job_name", "partition"):
    if any(c.isspace() for c in getattr(a, name)):
      return f"--{name}={getattr(a, name)!r} must not contain spaces"
  found = (limit_problem("--time", a.time, a.signal_s)
           or options_problem("--option", a.option, a.signal_s)
           or run_flags.problem(a.flags) or script_problem("--script", a.script))
  if found:
    return found
  if a.submit and shutil.which("sbatch") is None:
    return ("--submit: sbatch is not on this machine's PATH; write the script without --submit "
            "and submit it where SLURM runs")
  return None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--nodes", type=int, default=1)
  p.add_argument("--gpus_per_node", type=int, default=1, help="GPUs (= processes) per node")
  p.add_argument("--cpus_per_task", type=int, default=8)
  p.add_argument("--time", default="", help="e.g. 24:00:00")
  p.add_argument("--partition", default="")
  p.add_argument("--job_name", default="alma_jax")
  p.add_argument("--option", action="append", default=[],
                 help="another #SBATCH line, e.g. --option=--account=abc (repeatable)")
  p.add_argument("--setup", default=DEFAULT_SETUP, help="shell line run before srun")
  p.add_argument("--signal_s", type=int, default=SIGNAL_S, help="seconds before the time "
                 "limit at which the run saves, stops and the job is requeued")
  p.add_argument("--script", required=True, help="where to write the batch script")
  p.add_argument("--submit", action="store_true", help="submit it with sbatch")
  p.add_argument("flags", nargs="+", help="the flags of alma_jax.main (after --)")
  a = p.parse_args(argv)
  refused = _refusal(a)
  if refused:
    p.error(refused)
  text = script(a.flags, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                cpus_per_task=a.cpus_per_task, time=a.time, partition=a.partition,
                job_name=a.job_name, setup=a.setup, options=a.option, signal_s=a.signal_s)
  with open(a.script, "w") as f:
    f.write(text)
  print(f"wrote {a.script}: {a.nodes} node(s) x {a.gpus_per_node} GPU(s), one process each")
  if a.submit:
    return subprocess.call(["sbatch", a.script])
  return 0


if __name__ == "__main__":
  sys.exit(main())
