"""One run per workdir: an exclusive lock on `<workdir>/.lock`, held for the whole run.

`hold(workdir)` takes the lock before anything in the workdir is read or
written and releases it when the block ends. A second run on a locked
workdir fails at once with `WorkdirLockedError` (a ValueError: exit code 2 on
the command line), whose message names the holder (host, pid, start time)
and what to do. The lock file holds those facts as JSON.

How it locks:
  * `fcntl.flock(LOCK_EX | LOCK_NB)` on `.lock`. The OS releases a flock
    when its process dies, however it dies, so the lock of a killed run is
    taken over silently. The file is removed when the lock is released; one
    left by a killed run is reused.
  * Where flock fails (ENOLCK, EOPNOTSUPP, ... on some network file systems),
    an exclusively created lock file (O_CREAT | O_EXCL): it exists while a
    run holds it. One whose holder ran on this host and is gone is stale and
    taken over; one of another host is refused, with the command that
    removes it once that run is known to be over.

Limits:
  * flock on NFS: Linux (2.6.12+) maps it to a byte-range lock of the NFS
    server, so it works across hosts when the server supports locking
    (NFSv4, or NFSv3 with lockd); otherwise it fails with ENOLCK and the
    fallback is used. Lustre needs the client mount option `-o flock`
    (with `-o localflock` locks are per client node only; without either,
    flock fails with ENOSYS and the fallback is used).
  * The fallback checks a holder's pid only on its own host (host names must
    differ between machines), trusts a pid that was reused by another process,
    and the takeover of a stale lock is not atomic: two runs that start in
    the same instant on a workdir left locked by a dead process may both get
    it. An empty lock file (a holder that died between creating and writing
    it) is stale after a minute.
  * A child process forked (not exec'ed) while the lock is held keeps the
    flock until it exits.
  * In multi-host runs only one process (process index 0) should take the
    lock: `hold(workdir, primary=jax.process_index() == 0)`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time

try:
  import fcntl
except ImportError:  # not a POSIX system: only the fallback works
  fcntl = None

from alma_jax.outputs import io_utils
from alma_jax.runtime import caches

LOCK_FILE = ".lock"
# An empty or unreadable fallback lock file older than this is stale (its
# holder writes it right after creating it).
_EMPTY_STALE_S = 60.0


class WorkdirLockedError(ValueError):
  """Another run holds the workdir."""


def _holder_info(mode: str) -> dict:
  start = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  return {"host": socket.gethostname(), "pid": os.getpid(), "start": start, "mode": mode}


def _parse(data: bytes) -> dict | None:
  try:
    info = json.loads(data.decode())
  except (UnicodeDecodeError, ValueError):
    return None
  return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


def _read(path: str) -> dict | None:
  try:
    with open(path, "rb") as f:
      return _parse(f.read())
  except OSError:
    return None


def _describe(info: dict | None) -> str:
  if info is None:
    return "a run whose host and pid are not recorded yet"
  return (f"the run with pid {info['pid']} on host {info.get('host', '?')}, started "
          f"{info.get('start', '?')}")


def _locked_error(workdir: str, info: dict | None) -> WorkdirLockedError:
  if info is None:
    stop = "stop it"
  elif info.get("host") == socket.gethostname():
    stop = f"stop it (kill {info['pid']})"
  else:
    stop = f"stop it (kill {info['pid']} on {info.get('host')})"
  return WorkdirLockedError(
      f"--workdir={workdir} is in use by {_describe(info)}; wait for it to finish, {stop}, or "
      "choose another --workdir")


# -- flock ------------------------------------------------------------------------------------
def _open_regular(path: str, flags: int) -> int:
  """`io_utils.open_regular_fd`, its refusal as `WorkdirLockedError` (the lock file is written)."""
  try:
    return io_utils.open_regular_fd(path, flags)
  except io_utils.NotRegularFileError as e:
    raise WorkdirLockedError(str(e)) from None


class _FlockUnsupported(Exception):
  pass


def _acquire_flock(workdir: str, path: str) -> int:
  """The fd of `path` locked with flock; raises `_FlockUnsupported` where flock does not work."""
  if fcntl is None:
    raise _FlockUnsupported()
  for _ in range(100):  # retried only when a releasing holder removed the file meanwhile
    fd = _open_regular(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0))
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in caches.FLOCK_BUSY:
        raise _locked_error(workdir, _read(path)) from None
      if e.errno in caches.FLOCK_UNSUPPORTED:
        raise _FlockUnsupported() from e
      raise
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
      same = False
    if same:
      return fd
    os.close(fd)  # the file was removed (its holder released it): lock the new one
  raise _locked_error(workdir, _read(path))


def _check_exclusive_holder(workdir: str, path: str, data: bytes) -> None:
  """A run holding the file through the fallback does not flock it: respect it."""
  info = _parse(data)
  if info is None or info.get("mode") != "exclusive" or info["pid"] == os.getpid():
    return  # flock is ours, so a flock holder is gone
  if info.get("host") != socket.gethostname() or io_utils.process_alive(info["pid"]):
    raise _locked_error(workdir, info)


# -- fallback: an exclusively created file ------------------------------------------------------
def _stale(path: str, info: dict | None) -> bool:
  if info is None:
    try:
      return time.time() - os.stat(path).st_mtime > _EMPTY_STALE_S
    except FileNotFoundError:
      return True
  return info.get("host") == socket.gethostname() and not io_utils.process_alive(info["pid"])


def _acquire_exclusive(workdir: str, path: str, info: dict) -> None:
  for _ in range(3):
    try:
      fd = _open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
      holder = _read(path)
      if not _stale(path, holder):
        if holder is not None and holder.get("host") != socket.gethostname():
          raise WorkdirLockedError(
              f"--workdir={workdir} is in use by {_describe(holder)}; wait for it to finish or "
              f"choose another --workdir; if that run is no longer running, remove {path} "
              f"(rm {path})")
        raise _locked_error(workdir, holder)
      with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
      continue
    try:
      os.write(fd, json.dumps(info).encode())
      os.fsync(fd)
    finally:
      os.close(fd)
    return
  raise _locked_error(workdir, _read(path))


# -- the lock ---------------------------------------------------------------------------------
@contextlib.contextmanager
def hold(workdir: str, primary: bool = True):
  """Holds the lock of `workdir` (an existing directory) during the block.

  With `primary=False` (a process other than the first of a multi-host run)
  it does nothing. Raises `WorkdirLockedError` at once when another run holds
  it.
  """
  if not primary:
    yield
    return
  path = os.path.join(workdir, LOCK_FILE)
  try:
    fd = _acquire_flock(workdir, path)
  except _FlockUnsupported:
    fd = None
  if fd is not None:
    try:
      info = _holder_info("flock")
      _check_exclusive_holder(workdir, path, os.pread(fd, 65536, 0))
      try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
      except OSError:
        pass  # a full disk: the lock holds all the same, only its message lacks the holder
    except BaseException:
      os.close(fd)
      raise
    try:
      yield
    finally:
      with contextlib.suppress(OSError):
        os.unlink(path)  # while still locked, so no run locks the file being removed
      os.close(fd)
    return
  info = _holder_info("exclusive")
  _acquire_exclusive(workdir, path, info)
  try:
    yield
  finally:
    if _read(path) == info:
      with contextlib.suppress(OSError):
        os.unlink(path)
