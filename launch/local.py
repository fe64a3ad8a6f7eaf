"""Runs one alma_jax command as N processes of one `jax.distributed` run on this machine.

For trying multi-process runs without a cluster: every process runs
`python -m alma_jax.main` with the given flags plus `--jax_distributed`, the
coordinator on 127.0.0.1 and its process id; on CPU each process gets
`--devices_per_process` devices, so the global mesh has N x that many. Each
line of output is prefixed with its process id. When one process fails, the
others are stopped; the exit code is the first failing process's.

Example (two processes of 4 CPU devices, a mesh of 4 data x 2 model):
  python launch/local.py --num_processes=2 --devices_per_process=4 -- \\
      --config=configs/mnist_ens.py:smoke --workdir=/tmp/mp_ens \\
      --config.mesh.model=2 --config.method.num_members=2
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def commands(args: list[str], num_processes: int, port: int) -> list[list[str]]:
  """The command line of every process."""
  return [[sys.executable, "-m", "alma_jax.main", *args, "--jax_distributed",
           f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
           f"--process_id={i}"] for i in range(num_processes)]


def _relay(i: int, stream, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(f"[{i}] {line}")
    out.flush()


def _stop(procs, grace_s: float) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def launch(args: list[str], num_processes: int, devices_per_process: int = 0, port: int = 0,
           env: dict | None = None, out=None, grace_s: float = 30.0) -> int:
  """Runs the processes to completion; returns 0 or the first failing process's exit code."""
  out = out or sys.stdout
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  if devices_per_process:
    env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
  procs, relays = [], []
  for i, cmd in enumerate(commands(args, num_processes, port or free_port())):
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    procs.append(p)
    relays.append(threading.Thread(target=_relay, args=(i, p.stdout, out), daemon=True))
    relays[-1].start()
  code = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed:
        code = failed[0]
        _stop(procs, grace_s)
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    _stop(procs, grace_s)
    code = 130
  for t in relays:
    t.join(timeout=5)
  code = code or next((p.returncode for p in procs if p.returncode), 0)
  return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--devices_per_process", type=int, default=0,
                 help="CPU devices of each process (0: JAX's default)")
  p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  p.add_argument("flags", nargs="*", help="the flags of alma_jax.main (after --)")
  a = p.parse_args(argv)
  return launch(a.flags, a.num_processes, a.devices_per_process, a.port)


if __name__ == "__main__":
  sys.exit(main())
