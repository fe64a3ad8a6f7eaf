"""Multi-process runs: when to start `jax.distributed`, which process writes, barriers.

A run on several hosts (a TPU pod, a SLURM job with one process per GPU) is
one JAX program per process over a global mesh. Every process runs the same
stream loop on the same host values (data, indices, seeds) and feeds its own
devices' slices (`alma_jax.engine.sharding.put`); the outputs (log, summary,
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


def check_flags(start: bool, coordinator_address: str | None = None,
                num_processes: int | None = None, process_id: int | None = None) -> None:
  """Raises ValueError, naming the flag, for `--coordinator_address`, `--num_processes` or
  `--process_id` that cannot start a multi-process run (`start`: whether this is one), and
  for an ALMA_JAX_DISTRIBUTED that is neither 1 nor 0."""
  asked = os.environ.get("ALMA_JAX_DISTRIBUTED", "")
  if asked not in ("", "0", "1"):
    raise ValueError(f"ALMA_JAX_DISTRIBUTED={asked!r} in the environment: allowed values '1' (a "
                     "multi-process run) and '0' or unset (as the config's mesh.distributed "
                     "says)")
  given = [f"--{name}={value}" for name, value in (
      ("coordinator_address", coordinator_address), ("num_processes", num_processes),
      ("process_id", process_id)) if value is not None]
  if given and not start:
    raise ValueError(f"{' '.join(given)}: these flags set up a multi-process run; add "
                     "--jax_distributed (or set config.mesh.distributed=yes)")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and (process_id < 0 or (
      num_processes is not None and process_id >= num_processes)):
    last = num_processes - 1 if num_processes is not None else "--num_processes - 1"
    raise ValueError(f"--process_id={process_id} must be from 0 to {last}")
  if coordinator_address is not None:
    host, colon, port = coordinator_address.rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
      raise ValueError(f"--coordinator_address={coordinator_address!r} must be host:port, e.g. "
                       "10.0.0.1:1234 (a port from 1 to 65535)")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """`jax.distributed.initialize()`; arguments left None are detected by JAX."""
  jax.distributed.initialize(coordinator_address=coordinator_address or None,
                             num_processes=num_processes, process_id=process_id)


def is_primary() -> bool:
  """Whether this process writes the run's outputs (process 0)."""
  return jax.process_index() == 0


# How long a process waits for the others at a vote (`Vote`) or when it leaves a run that
# stops: longer than any host-side pause between two checks (a checkpoint write, an evaluation).
VOTE_TIMEOUT_S = 1800.0
LEAVE_TIMEOUT_S = 30.0


def _client():
  """The coordination service's client of a multi-process run (None: a single process)."""
  if jax.process_count() <= 1:
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


class Vote:
  """Agreement of the processes of a run on one value at each point where all of them ask.

  Every process calls the vote at the same points of its program, in the same
  order (the stream loop is the same program in every process), with its own
  value or None; each call returns the value of the lowest process id that
  gave one, the same in every process, or None. It waits for the others at a
  barrier of the coordination service (host-side: the devices keep working on
  the programs already dispatched), so that every process takes the same
  decision at the same point: a signal that reached one process stops all of
  them at the same step, none left waiting in a collective for a peer that
  stopped. In a single process it returns the value given.
  """

  def __init__(self, timeout_s: float = VOTE_TIMEOUT_S):
    self.timeout_ms = int(timeout_s * 1000)
    self.count = 0

  def __call__(self, mine: int | None) -> int | None:
    client = _client()
    if client is None:
      return mine
    self.count += 1
    prefix = f"alma_jax/vote/{self.count}/"
    if mine is not None:
      client.key_value_set(f"{prefix}{jax.process_index():06d}", str(int(mine)))
    client.wait_at_barrier(f"alma_jax/vote/{self.count}", self.timeout_ms)
    given = sorted(client.key_value_dir_get(prefix))
    return int(given[0][1]) if given else None


def leave(timeout_s: float = LEAVE_TIMEOUT_S) -> None:
  """Before a multi-process run's process exits early (a signal stopped the run): waits, at
  most `timeout_s`, until every process leaves, so that process 0, which hosts the
  coordination service, does not end it under the others (they would abort)."""
  client = _client()
  if client is None:
    return
  try:
    client.wait_at_barrier("alma_jax/leave", int(timeout_s * 1000))
  except Exception:  # pylint: disable=broad-except
    pass  # a peer gone already or stuck: leave anyway


def sync(name: str) -> None:
  """Waits until every process of a multi-process run reaches the point `name`."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
