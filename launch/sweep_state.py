"""The state of a sweep's points (launch/sweep.py): done, running, failed or to run.

`status` decides whether a point runs: "done" (its workdir holds a summary
and the point's config), "running" (another live process holds the workdir's
lock), "refuse" (the workdir holds another config) or "run". A sweep keeps
the exit of a point's failed run in `<root>/logs/<workdir name>.failed.json`
until a run of the point succeeds, so that `--status` (`print_status`) tells
failed points from those not run yet. `invalid_points` checks every point's
config as the run checks it (`alma_jax.stream.validation.validate`, without loading
data) before a sweep starts anything.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for alma_jax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for local.py
from alma_jax import errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.outputs import workdir as wd  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.outputs import workdir_lock  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.stream import validation  # pylint: disable=g-import-not-at-top,wrong-import-position
import local  # pylint: disable=g-import-not-at-top,wrong-import-position

# Where the outputs of runs in parallel and the exit of each failed run go, under the root.
LOGS_DIR = "logs"
FAILED_SUFFIX = ".failed.json"


def holder(workdir: str, any_host: bool = False) -> dict | None:
  """The run holding `workdir`'s lock (its host and pid, from the lock file): a live process
  of this host, or with `any_host` also a process of another host (whose liveness cannot be
  checked from here, and whose lock file may be left over from a killed run)."""
  try:
    with open(os.path.join(workdir, workdir_lock.LOCK_FILE)) as f:
      info = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
    return None
  if info.get("host") == socket.gethostname():
    return info if io_utils.process_alive(info["pid"]) else None
  return info if any_host else None


def status(workdir: str, resolved: dict, any_host: bool = False) -> tuple[str, str]:
  """("run" | "done" | "running" | "refuse", why) for the point of config `resolved` in
  `workdir`; "running": another process holds the workdir (see `holder` for `any_host`)."""
  path = os.path.join(workdir, "config.json")
  other = holder(workdir, any_host)
  running = other and ("running", f"by another process, pid {other['pid']} on "
                                  f"{other.get('host', '?')}")
  if not os.path.exists(path):
    return running or ("run", "")  # new (or its outputs are checked by the run itself)
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, ValueError) as e:
    return "refuse", f"{path} cannot be read ({e})"
  diffs = config_resolve.same_run(stored, resolved)
  if diffs:
    return "refuse", f"{workdir} holds a run of a different config: {'; '.join(diffs)}"
  if running:
    return running
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return "done", ""
  return "run", ""


def _failure_file(workdir: str) -> str:
  root, name = os.path.split(os.path.normpath(workdir))
  return os.path.join(root, LOGS_DIR, name + FAILED_SUFFIX)


def record_exit(workdir: str, returncode: int, log: str | None) -> None:
  """Keeps how a point's run failed (`<root>/logs/<name>.failed.json`, for --status); a run
  that succeeded removes it. A file that cannot be written only warns."""
  path = _failure_file(workdir)
  try:
    if returncode == 0:
      if os.path.exists(path):
        os.unlink(path)
        if not os.listdir(os.path.dirname(path)):  # left by failures alone
          os.rmdir(os.path.dirname(path))
      return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ended = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    io_utils.write_json_atomic(path, {"exit_code": returncode, "ended": ended, "log": log,
                                      "exit": local.describe_exit(returncode)})
  except (OSError, io_utils.WorkdirWriteError) as e:
    print(f"sweep: warning: cannot record the exit of {workdir} in {path}: {e}", file=sys.stderr)


def failure(workdir: str) -> dict | None:
  """The recorded exit of the point's last failed run (None: none recorded)."""
  try:
    info = io_utils.read_json(_failure_file(workdir))
  except (OSError, ValueError):
    return None
  return info if isinstance(info, dict) else None


def has_records(workdir: str) -> bool:
  """Whether a run has logged anything in `workdir` (or, with num_seeds, in its seed folders)."""
  return os.path.isdir(workdir) and any(os.path.exists(os.path.join(d, wd.LOG_FILE))
                                        for d in wd.output_dirs(workdir))


# -- the table of --status, and the checks before any run ----------------------------------------
STATE_NAMES = {"done": "done", "running": "running", "failed": "failed", "run": "to run",
               "refuse": "refused"}


def point_state(workdir: str, resolved: dict) -> tuple[str, str]:
  """(state, detail) of a point for --status: `status` (with locks of other hosts counted as
  running), and "failed" for a point whose last run here failed and that is not done."""
  state, why = status(workdir, resolved, any_host=True)
  if state != "run":
    return state, why
  failed = failure(workdir)
  if failed is not None:
    where = f"; its output: {failed['log']}" if failed.get("log") else ""
    return "failed", f"{failed.get('exit', 'failed')} at {failed.get('ended', '?')}{where}"
  return "run", "resumes from its records" if has_records(workdir) else ""


def print_status(root: str, runs) -> list[tuple[str, str]]:
  """Prints a table of the points' states and folders; starts nothing. Returns the (state,
  detail) of each point (`point_state`)."""
  states = [point_state(w, r) for _, w, r in runs]
  head = ("#", "state", "folder", "detail")
  rows = [head] + [(str(i + 1), STATE_NAMES[state], os.path.relpath(w, root), detail)
                   for i, ((_, w, _), (state, detail)) in enumerate(zip(runs, states))]
  widths = [max(len(r[k]) for r in rows) for k in range(3)]
  print(f"{len(runs)} points in {root}:")
  for r in rows:
    print(f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
  counts = collections.Counter(state for state, _ in states)
  print(", ".join(f"{counts[s]} {name}" for s, name in STATE_NAMES.items() if counts[s]))
  return states


def check_point(config_arg: str, flags: list[str], remote: bool) -> str | None:
  """Why the run of a point (config file and flags, as `point_args` gives them) would refuse
  its config (None: valid), by the run's own checks (`alma_jax.stream.validation.validate`, which
  loads no data). With `remote` the mesh is left to the machines that run it (this one's
  devices say nothing of theirs)."""
  try:
    config = validation.complete(config_resolve.resolve(config_arg, flags))
    if remote:
      config.mesh.num_devices, config.mesh.data, config.mesh.model = 0, 0, 1
    validation.validate(config)
  except Exception as e:  # pylint: disable=broad-except  (each invalid point is named)
    return errors.one_line(e)
  return None


def invalid_points(runs, args_of, remote: bool) -> list[tuple[int, str, str]]:
  """(index, workdir, why) of every point not done whose config its run would refuse;
  `args_of`: each point's (config file, flags)."""
  out = []
  for i, ((_, workdir, resolved), (config, flags)) in enumerate(zip(runs, args_of)):
    if status(workdir, resolved)[0] != "done" and (why := check_point(config, flags, remote)):
      out.append((i, workdir, why))
  return out
