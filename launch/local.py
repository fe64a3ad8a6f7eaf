"""Runs one alma_jax command as N processes of one `jax.distributed` run on this machine.

For trying multi-process runs without a cluster: every process runs
`python -m alma_jax.main` with the given flags plus `--jax_distributed`, the
coordinator on 127.0.0.1 and its process id; on CPU each process gets
`--devices_per_process` devices, so the global mesh has N x that many. Each
line of output is prefixed with its process id. When one process fails, the
others are stopped at once; the exit code is the failing process's. SIGINT
(Ctrl-C), SIGTERM or SIGHUP is passed on to every process; the launcher then
names the processes it stopped, prints its own command line as the command
that resumes the run, and exits with 128 + the signal number.

Example (two processes of 4 CPU devices, a mesh of 4 data x 2 model):
  python launch/local.py --num_processes=2 --devices_per_process=4 -- \\
      --config=configs/mnist_ens.py:smoke --workdir=/tmp/mp_ens \\
      --config.mesh.model=2 --config.method.num_members=2
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The command that resumes an interrupted run, for alma_jax.main to print (its own command is
# one process's, which alone does not resume a multi-process run).
RESUME_ENV = "ALMA_JAX_RESUME_COMMAND"
# Signals that stop the launcher; it passes them on to its processes.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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


class StopSignals:
  """Records the STOP_SIGNALS that arrive while installed (in the main thread only), for a
  launcher to pass them on to its processes."""

  def __init__(self):
    self.received: list[int] = []
    self._old = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for s in STOP_SIGNALS:
        self._old[s] = signal.signal(s, lambda signum, frame: self.received.append(signum))
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._old.items():
      signal.signal(s, handler)

  def forwarded(self) -> int:
    """The signal to pass on: the first received (SIGHUP as SIGTERM, since a run stops at a
    safe point on SIGINT or SIGTERM and at once on SIGHUP)."""
    return signal.SIGTERM if self.received[0] == signal.SIGHUP else self.received[0]


def exit_code(returncode: int) -> int:
  """A process's exit code as a shell reports it (killed by signal N: 128 + N)."""
  return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
  """`returncode` (a Popen's) in words, e.g. "killed by SIGTERM (exit code 143)"."""
  if returncode < 0:
    return f"killed by {signal.Signals(-returncode).name} (exit code {exit_code(returncode)})"
  return f"exit code {returncode}"


def stop_processes(procs, signum: int, grace_s: float, signals: StopSignals | None = None):
  """Sends `signum` to the running `procs`, waits up to `grace_s` seconds for them (less if
  `signals` receives another signal), then kills the rest; returns the killed ones."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signum)
  deadline, seen = time.monotonic() + grace_s, len(signals.received) if signals else 0
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    if signals and len(signals.received) > seen:
      break  # asked again: no more waiting
    time.sleep(0.05)
  killed = [p for p in procs if p.poll() is None]
  for p in killed:
    p.kill()
    p.wait()
  return killed


def own_command(argv: list[str], script: str) -> str:
  """The command line of the launcher `script` as invoked with `argv`, without `--overwrite`
  (so that running it again resumes)."""
  invoked = os.path.abspath(sys.argv[0]) == os.path.abspath(script)
  args = [a for a in argv if not a.lstrip("-").startswith("overwrite")]
  return shlex.join(["python", sys.argv[0] if invoked else os.path.relpath(script)] + args)


def launch(args: list[str], num_processes: int, devices_per_process: int = 0, port: int = 0,
           env: dict | None = None, out=None, grace_s: float = 30.0, fail_grace_s: float = 5.0,
           resume_command: str = "") -> int:
  """Runs the processes to completion.

  When one fails, the others get SIGTERM at once and SIGKILL after `fail_grace_s` (they are
  likely stuck in a collective). A STOP_SIGNALS signal to the launcher is passed on to every
  process (`StopSignals.forwarded`), which gets `grace_s` to stop before SIGKILL.

  Args:
    args: the flags of alma_jax.main.
    num_processes: processes to start.
    devices_per_process: CPU devices of each process (0: JAX's default).
    port: the coordinator's port (0: a free one).
    env: the processes' environment (default: this one's).
    out: where the processes' output goes, each line prefixed with its process id (default:
      stdout); the launcher's own messages go to stderr.
    grace_s: seconds the processes get to stop (and checkpoint) after a signal.
    fail_grace_s: seconds the others get to stop after a process failed.
    resume_command: the command that resumes the run, which an interrupted process prints
      (by default its own, which alone does not resume a multi-process run).

  Returns:
    0, the exit code of the first failing process, or 128 + the number of the signal that
    stopped the launcher.
  """
  out = out or sys.stdout
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  if devices_per_process:
    env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
  if resume_command:
    env[RESUME_ENV] = resume_command
  procs, relays, code = [], [], 0
  with StopSignals() as signals:
    for i, cmd in enumerate(commands(args, num_processes, port or free_port())):
      if signals.received:
        break
      # A session of its own: Ctrl-C reaches the launcher alone, which passes it on.
      p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
      procs.append(p)
      relays.append(threading.Thread(target=_relay, args=(i, p.stdout, out), daemon=True))
      relays[-1].start()
    while not signals.received:
      codes = [p.poll() for p in procs]  # every process's
      failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
      if failed is not None:
        code = exit_code(codes[failed])
        print(f"local: process {failed} failed ({describe_exit(codes[failed])}); stopping the "
              "others", file=sys.stderr, flush=True)
        stop_processes(procs, signal.SIGTERM, fail_grace_s)
        break
      if all(c == 0 for c in codes):
        break
      time.sleep(0.1)
    if signals.received and not code:
      _interrupted(procs, signals, grace_s, resume_command)
      code = 128 + signals.received[0]
  for t in relays:
    t.join(timeout=5)
  return code


def _interrupted(procs, signals: StopSignals, grace_s: float, resume_command: str) -> None:
  """Stops the processes after a signal and names each one's exit."""
  running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
  print(f"local: {signal.Signals(signals.received[0]).name}: stopping {len(running)} running "
        "process(es)", file=sys.stderr, flush=True)
  killed = stop_processes(procs, signals.forwarded(), grace_s, signals)
  for i, p in running:
    late = " (it did not stop in time)" if p in killed else ""
    print(f"local: process {i} (pid {p.pid}): {describe_exit(p.returncode)}{late}",
          file=sys.stderr)
  if resume_command:
    print(f"local: to resume, run the same command again: {resume_command}", file=sys.stderr)
  sys.stderr.flush()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--devices_per_process", type=int, default=0,
                 help="CPU devices of each process (0: JAX's default)")
  p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  p.add_argument("flags", nargs="*", help="the flags of alma_jax.main (after --)")
  argv = sys.argv[1:] if argv is None else argv
  a = p.parse_args(argv)
  if a.num_processes < 1:
    p.error(f"--num_processes={a.num_processes} must be >= 1")
  if a.devices_per_process < 0:
    p.error(f"--devices_per_process={a.devices_per_process} must be >= 0 (0: JAX's default)")
  if not 0 <= a.port <= 65535:
    p.error(f"--port={a.port} must be a port number from 0 (a free one) to 65535")
  return launch(a.flags, a.num_processes, a.devices_per_process, a.port,
                resume_command=own_command(argv, __file__))


if __name__ == "__main__":
  sys.exit(main())
