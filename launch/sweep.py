"""Runs a grid of configs: method x waiting time x width x replay x seed, ...

Each grid point is one `python -m alma_jax.main` run with its own workdir,
named after its overrides and a short hash of its resolved config (config
file, variant and every `--config.*` flag, extra ones after `--` included;
fields that a run may change on resume, such as data paths, aside). A point
is skipped only when its workdir holds a summary.json and a config.json equal
to the point's config; a point without a summary resumes, and a workdir
holding a different config is refused with the differing fields named. So a
rerun of a sweep skips what is done, and a sweep with another config file or
other flags gets workdirs of its own.

Examples:
  # Print the commands of a 2 x 3 grid without running them.
  python launch/sweep.py --config=configs/mnist_sm.py:quick --root=/tmp/sweep \
      --grid=stream.wait=1,5,10 --grid=seed=0,1 --dry_run
  # Run them one after another on this machine.
  python launch/sweep.py --config=configs/mnist_sm.py:quick --root=/tmp/sweep \
      --grid=stream.wait=1,5,10 --grid=seed=0,1
  # Write a SLURM array script with one task per grid point (each with one GPU;
  # --slurm_gpus=0 for CPU nodes, --slurm_option for more #SBATCH lines).
  python launch/sweep.py ... --slurm=sweep.sbatch --slurm_option=--time=4:00:00
A grid point that itself spans several GPUs or nodes is a job of
`launch/slurm.py` (one process per GPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for alma_jax
from alma_jax import config_resolve  # pylint: disable=g-import-not-at-top,wrong-import-position


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
  grid = []
  for item in items:
    if "=" not in item:
      raise SystemExit(f"sweep: error: --grid={item!r} must look like field=v1,v2,...")
    field, values = item.split("=", 1)
    vals = [v for v in values.split(",") if v]
    if not vals:
      raise SystemExit(f"sweep: error: --grid={item!r} has no values")
    grid.append((field, vals))
  return grid


def points(grid):
  fields = [f for f, _ in grid]
  for combo in itertools.product(*[v for _, v in grid]):
    yield list(zip(fields, combo))


def command(config: str, root: str, point, extra: list[str]) -> tuple[list[str], str, dict]:
  """(command line, workdir, resolved config) of one grid point."""
  flags = [f"--config.{f}={v}" for f, v in point] + extra
  try:
    resolved = config_resolve.resolved_dict(config, flags)
  except config_resolve.ConfigResolveError as e:
    raise SystemExit(f"sweep: error: {e}") from e
  name = "_".join(f"{f.split('.')[-1]}-{v}" for f, v in point) or "default"
  workdir = os.path.join(root, f"{name}-{config_resolve.config_hash(resolved)}")
  cmd = [sys.executable, "-m", "alma_jax.main", f"--config={config}", f"--workdir={workdir}"]
  return cmd + flags, workdir, resolved


def status(workdir: str, resolved: dict) -> tuple[str, str]:
  """("run" | "done" | "refuse", why) for the point of config `resolved` in `workdir`."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return "run", ""  # new (or its outputs are checked by the run itself)
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, ValueError) as e:
    return "refuse", f"{path} cannot be read ({e})"
  diffs = config_resolve.same_run(stored, resolved)
  if diffs:
    return "refuse", f"{workdir} holds a run of a different config: {'; '.join(diffs)}"
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return "done", ""
  return "run", ""


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="config file, e.g. configs/mnist_sm.py:quick")
  p.add_argument("--root", required=True, help="directory holding one workdir per grid point")
  p.add_argument("--grid", action="append", default=[], help="field=v1,v2,... (repeatable)")
  p.add_argument("--dry_run", action="store_true", help="print the commands only")
  p.add_argument("--slurm", help="write a SLURM array script to this path instead of running")
  p.add_argument("--slurm_gpus", type=int, default=1, help="GPUs of each array task (0: none)")
  p.add_argument("--slurm_option", action="append", default=[],
                 help="another #SBATCH line of the array script (repeatable), e.g. "
                 "--slurm_option=--time=4:00:00")
  p.add_argument("extra", nargs="*", help="extra flags passed to every run (after --)")
  args = p.parse_args(argv)
  runs = [command(args.config, args.root, pt, args.extra) for pt in points(parse_grid(args.grid))]
  if args.slurm:
    lines = ["#!/bin/bash", f"#SBATCH --array=0-{len(runs) - 1}"]
    lines += [f"#SBATCH --gres=gpu:{args.slurm_gpus}"] * (args.slurm_gpus > 0)
    lines += [f"#SBATCH {o}" for o in args.slurm_option] + ["CMDS=("]
    lines += [f"  {shlex.quote(shlex.join(c))}" for c, _, _ in runs] + [")", 'eval "${CMDS[$SLURM_ARRAY_TASK_ID]}"']
    with open(args.slurm, "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"wrote {args.slurm} with {len(runs)} tasks")
    return 0
  failed = 0
  for i, (cmd, workdir, resolved) in enumerate(runs):
    state, why = status(workdir, resolved)
    label = {"run": "", "done": "done, skipped: ", "refuse": f"refused ({why}): "}[state]
    print(f"[{i + 1}/{len(runs)}] {label}{shlex.join(cmd)}", flush=True)
    if state == "refuse":
      failed += 1
    if args.dry_run or state != "run":
      continue
    failed += subprocess.call(cmd) != 0
  if failed:
    print(f"{failed} of {len(runs)} runs failed", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
