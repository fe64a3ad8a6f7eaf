"""Multi-process runs: when to start `jax.distributed`, which process writes, barriers.

A run on several hosts (a TPU pod, a SLURM job with one process per GPU) is
one JAX program per process over a global mesh. Every process runs the same
stream loop on the same host values (data, indices, seeds) and feeds its own
devices' slices (`alma_jax.core.sharding.put`); the outputs (log, summary,
architecture log) are written by process 0 alone, while orbax writes the
checkpoints collectively (every process calls save and restore). The workdir
must be on a file system that all processes see.

`jax.distributed.initialize()` runs when `config.mesh.distributed` is "yes",
or "auto" (the default) and the environment asks for it: `--jax_distributed`
or ALMA_JAX_DISTRIBUTED=1, a SLURM step with several tasks, an Open MPI
launch of several processes, or a TPU VM that names several workers. Where
the coordinator address, the number of processes and the process id are not
given, JAX detects them (SLURM, Open MPI, Cloud TPU).
"""

from __future__ import annotations

import os

import jax
from jax.experimental import multihost_utils


def cluster_asks(environ=None) -> str | None:
  """What in the environment asks for a multi-process run (None: nothing)."""
  env = os.environ if environ is None else environ
  if env.get("ALMA_JAX_DISTRIBUTED") == "1":
    return "ALMA_JAX_DISTRIBUTED=1"
  if "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return f"a SLURM step of {env['SLURM_NTASKS']} tasks"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return f"an Open MPI launch of {env['OMPI_COMM_WORLD_SIZE']} processes"
  workers = [w for w in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if w]
  if len(workers) > 1:
    return f"a TPU VM of {len(workers)} workers"
  return None


def wanted(setting: str, flag: bool, environ=None) -> tuple[bool, str]:
  """(whether to call `jax.distributed.initialize()`, why) for `config.mesh.distributed`."""
  if flag:
    return True, "--jax_distributed"
  if setting == "yes":
    return True, "config.mesh.distributed=yes"
  if setting == "no":
    return False, "config.mesh.distributed=no"
  why = cluster_asks(environ)
  return why is not None, why or "a single process"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """`jax.distributed.initialize()`; arguments left None are detected by JAX."""
  jax.distributed.initialize(coordinator_address=coordinator_address or None,
                             num_processes=num_processes, process_id=process_id)


def is_primary() -> bool:
  """Whether this process writes the run's outputs (process 0)."""
  return jax.process_index() == 0


def sync(name: str) -> None:
  """Waits until every process of a multi-process run reaches the point `name`."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
