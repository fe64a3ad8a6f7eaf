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
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SETUP = "if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi"


def script(flags: list[str], *, nodes: int, gpus_per_node: int, cpus_per_task: int = 8,
           time: str = "", partition: str = "", job_name: str = "alma_jax",
           setup: str = DEFAULT_SETUP, root: str = ROOT, options: list[str] = ()) -> str:
  """The text of the batch script."""
  lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
           f"#SBATCH --ntasks-per-node={gpus_per_node}", f"#SBATCH --gres=gpu:{gpus_per_node}",
           f"#SBATCH --cpus-per-task={cpus_per_task}", "#SBATCH --output=%x-%j.out"]
  lines += [f"#SBATCH --time={time}"] * bool(time) + [f"#SBATCH --partition={partition}"] * bool(
      partition) + [f"#SBATCH {o}" for o in options]
  cmd = shlex.join(["python", "-m", "alma_jax.main", "--jax_distributed", *flags])
  lines += ["set -euo pipefail", f"cd {shlex.quote(root)}", setup,
            'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"',
            "# One task per GPU; a task that fails ends the whole step.",
            f"srun --kill-on-bad-exit=1 {cmd}"]
  return "\n".join(lines) + "\n"


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
  p.add_argument("--script", required=True, help="where to write the batch script")
  p.add_argument("--submit", action="store_true", help="submit it with sbatch")
  p.add_argument("flags", nargs="+", help="the flags of alma_jax.main (after --)")
  a = p.parse_args(argv)
  if a.nodes < 1 or a.gpus_per_node < 1:
    p.error("--nodes and --gpus_per_node must be >= 1")
  text = script(a.flags, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                cpus_per_task=a.cpus_per_task, time=a.time, partition=a.partition,
                job_name=a.job_name, setup=a.setup, options=a.option)
  with open(a.script, "w") as f:
    f.write(text)
  print(f"wrote {a.script}: {a.nodes} node(s) x {a.gpus_per_node} GPU(s), one process each")
  if a.submit:
    return subprocess.call(["sbatch", a.script])
  return 0


if __name__ == "__main__":
  sys.exit(main())
