"""Runs one alma_jax command on every worker of a Cloud TPU VM (pod slice) with gcloud.

Three steps, four `gcloud compute tpus tpu-vm` commands on all workers at once
(`--worker=all`):
  copy     the repository's files (those git tracks or would track, as they are
           in the working tree) to ~/alma_jax on every worker (`scp` of a
           tarball, then `ssh` to unpack it);
  install  a virtual environment there with requirements.txt and JAX for TPU;
  run      `python -m alma_jax.main --jax_distributed <flags>` on every worker
           (JAX reads the coordinator and the process ids from the TPU VM).
The workdir must be a directory that every worker sees (Filestore/NFS, or a
bucket mounted with gcsfuse at the same path on each worker); data may be read
from a bucket (`--config.data.data_dir=gs://...`).

  python launch/tpu_pod.py --tpu=alma-v4-32 --zone=us-central2-b -- \\
      --config=configs/cifar_gens.py --workdir=/mnt/shared/runs/cifar_gens

`--dry_run` prints the commands; `--steps=run` skips copying and installing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile

import run_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("copy", "install", "run")
REMOTE_DIR = "~/alma_jax"
JAX_TPU = "jax[tpu]==0.10.2"


def _gcloud(tpu: str, zone: str, project: str, verb: str, *rest: str) -> list[str]:
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={zone}", "--worker=all"]
  return cmd + ([f"--project={project}"] if project else [])


def ssh(tpu: str, zone: str, project: str, command: str) -> list[str]:
  return _gcloud(tpu, zone, project, "ssh", tpu, f"--command={command}")


def commands(flags: list[str], *, tpu: str, zone: str, project: str = "", archive: str,
             steps=STEPS) -> list[list[str]]:
  """The gcloud command lines of `steps`; `archive` is the local tarball of the code."""
  out = []
  if "copy" in steps:
    out.append(_gcloud(tpu, zone, project, "scp", archive, f"{tpu}:~/alma_jax.tar.gz"))
    out.append(ssh(tpu, zone, project, f"mkdir -p {REMOTE_DIR} && tar -xzf ~/alma_jax.tar.gz -C "
                   f"{REMOTE_DIR}"))
  if "install" in steps:
    out.append(ssh(tpu, zone, project, f"cd {REMOTE_DIR} && python3 -m venv .venv && "
                   f".venv/bin/pip install -q -r requirements.txt -e . && "
                   f".venv/bin/pip install -q -U {shlex.quote(JAX_TPU)}"))
  if "run" in steps:
    run = shlex.join([".venv/bin/python", "-m", "alma_jax.main", "--jax_distributed", *flags])
    out.append(ssh(tpu, zone, project, f"cd {REMOTE_DIR} && {run}"))
  return out


def tracked_files(root: str = ROOT) -> list[str]:
  """The repository's files that git tracks or would track (untracked ones not ignored)."""
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=root, capture_output=True, check=True)
  return [f for f in out.stdout.decode().split("\0") if f and os.path.isfile(os.path.join(root, f))]


def write_archive(path: str, root: str = ROOT) -> None:
  """A tarball of `tracked_files`, as they are in the working tree."""
  with tarfile.open(path, "w:gz") as tar:
    for name in tracked_files(root):
      tar.add(os.path.join(root, name), arcname=name)


def execute(flags: list[str], *, tpu: str, zone: str, project: str = "", steps=STEPS,
            dry_run: bool = False) -> int:
  """Prints and runs the commands of `steps` one after another (the archive of the code
  written first when copying); 0 when all succeeded, 1 at the first failure."""
  with tempfile.TemporaryDirectory() as tmp:
    archive = os.path.join(tmp, "alma_jax.tar.gz")
    if "copy" in steps and not dry_run:
      write_archive(archive)
    for cmd in commands(flags, tpu=tpu, zone=zone, project=project, archive=archive,
                        steps=steps):
      print(shlex.join(cmd), flush=True)
      if not dry_run and subprocess.call(cmd) != 0:
        print(f"tpu_pod: failed: {shlex.join(cmd)}", file=sys.stderr)
        return 1
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tpu", required=True, help="the TPU VM's name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default="")
  p.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of "
                 f"{','.join(STEPS)}")
  p.add_argument("--dry_run", action="store_true", help="print the commands only")
  p.add_argument("flags", nargs="+", help="the flags of alma_jax.main (after --)")
  a = p.parse_args(argv)
  steps = [s for s in a.steps.split(",") if s]
  if not set(steps) <= set(STEPS):
    p.error(f"--steps={a.steps}: valid steps are {','.join(STEPS)}")
  if "run" in steps:
    found = run_flags.problem(a.flags, shared_workdir_absolute=True)
    if found:
      p.error(found)
  if not a.dry_run and shutil.which("gcloud") is None:
    p.error("gcloud is not on this machine's PATH (the Google Cloud CLI runs the steps); "
            "--dry_run prints the commands")
  return execute(a.flags, tpu=a.tpu, zone=a.zone, project=a.project, steps=steps,
                 dry_run=a.dry_run)


if __name__ == "__main__":
  sys.exit(main())
