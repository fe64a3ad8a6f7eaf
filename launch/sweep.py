"""Runs a grid of configs: method x waiting time x width x replay x seed, ...

Each grid point is one `python -m alma_jax.main` run with its own workdir
(named after its overrides), so finished points are skipped on a rerun and
interrupted ones resume.

Examples:
  # Print the commands of a 2 x 3 grid without running them.
  python launch/sweep.py --config=configs/mnist_sm.py:quick --root=/tmp/sweep \
      --grid=stream.wait=1,5,10 --grid=seed=0,1 --dry_run
  # Run them one after another on this machine.
  python launch/sweep.py --config=configs/mnist_sm.py:quick --root=/tmp/sweep \
      --grid=stream.wait=1,5,10 --grid=seed=0,1
  # Write a SLURM array script with one task per grid point.
  python launch/sweep.py ... --slurm=sweep.sbatch
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import subprocess
import sys


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


def command(config: str, root: str, point, extra: list[str]) -> tuple[list[str], str]:
  name = "_".join(f"{f.split('.')[-1]}-{v}" for f, v in point) or "default"
  workdir = os.path.join(root, name)
  cmd = [sys.executable, "-m", "alma_jax.main", f"--config={config}", f"--workdir={workdir}"]
  cmd += [f"--config.{f}={v}" for f, v in point] + extra
  return cmd, workdir


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="config file, e.g. configs/mnist_sm.py:quick")
  p.add_argument("--root", required=True, help="directory holding one workdir per grid point")
  p.add_argument("--grid", action="append", default=[], help="field=v1,v2,... (repeatable)")
  p.add_argument("--dry_run", action="store_true", help="print the commands only")
  p.add_argument("--slurm", help="write a SLURM array script to this path instead of running")
  p.add_argument("extra", nargs="*", help="extra flags passed to every run (after --)")
  args = p.parse_args(argv)
  runs = [command(args.config, args.root, pt, args.extra) for pt in points(parse_grid(args.grid))]
  if args.slurm:
    lines = ["#!/bin/bash", f"#SBATCH --array=0-{len(runs) - 1}", "#SBATCH --gres=gpu:1", "CMDS=("]
    lines += [f"  {shlex.quote(shlex.join(c))}" for c, _ in runs] + [")", 'eval "${CMDS[$SLURM_ARRAY_TASK_ID]}"']
    with open(args.slurm, "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"wrote {args.slurm} with {len(runs)} tasks")
    return 0
  failed = 0
  for i, (cmd, workdir) in enumerate(runs):
    done = os.path.exists(os.path.join(workdir, "summary.json"))
    print(f"[{i + 1}/{len(runs)}] {'done, skipped: ' if done else ''}{shlex.join(cmd)}", flush=True)
    if args.dry_run or done:
      continue
    failed += subprocess.call(cmd) != 0
  if failed:
    print(f"{failed} of {len(runs)} runs failed", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
