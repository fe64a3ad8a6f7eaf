"""Crash-safe writes of the run's outputs (JSON files and the JSON-lines log).

A JSON file is replaced atomically (temp file, fsync, rename, fsync of the
directory), so readers see the old or the new content, never a mix. The
JSON-lines log is appended one fsynced line at a time; a line torn by a crash
(no trailing newline) is ignored by `read_jsonl` and cut off by the next
`append_jsonl`. `append_record` appends to the metrics log only the record
that follows its last one (t = last t + 1), so the log cannot interleave two
writers or skip a step.

Files are created with the permissions of an ordinary `open` (0o666 less the
umask). Temp files are named `.tmp-<pid>-<host tag>-...`, so that those left
by a killed writer can be recognised and removed (`remove_stale_temporaries`).

A full, read-only or forbidden file system (ENOSPC, EDQUOT, EROFS, EACCES,
EPERM) while writing a run's outputs raises `WorkdirWriteError`, one line
naming the path; the file being written is left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import threading
import time
from typing import Any, Iterable


# -- errors of a full or read-only file system ------------------------------------------------
# errno -> what the user can do about it.
_WRITE_ERRNOS = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space (or raise the disk quota)",
    errno.EROFS: "make the file system writable",
    errno.EACCES: "fix the permissions",
    errno.EPERM: "fix the permissions",
}


class WorkdirWriteError(RuntimeError):
  """A run's output could not be written: the file system is full, read-only or forbidden.

  Attributes: `path` (what was being written) and `errno`.
  """

  # Its message is complete for the user: no type name or traceback hint on the command line.
  plain_message = True

  def __init__(self, path: str, err: int, strerror: str | None = None):
    self.path = path
    self.errno = err
    fix = _WRITE_ERRNOS.get(err, "fix the file system")
    super().__init__(f"cannot write {path}: {strerror or os.strerror(err)}; the checkpoints and "
                     f"log.jsonl written so far are intact — {fix} and run the same command "
                     "again to resume")


def is_write_error(exc: BaseException) -> bool:
  """Whether `exc` is an OSError of a full, read-only or forbidden file system."""
  return isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS


@contextlib.contextmanager
def output_errors(path: str):
  """Turns an OSError of a full or read-only file system inside the block into `WorkdirWriteError`."""
  try:
    yield
  except OSError as e:
    if not is_write_error(e):
      raise
    raise WorkdirWriteError(path, e.errno, e.strerror) from e


def output_file_problem(flag: str, path: str | None) -> str | None:
  """Why the file `path` (given as `flag`), which a command writes when it ends, could not be
  written; None when it can, or when no file is asked for. Its folder is made if missing. A
  command asks when it starts, so that a long measurement does not end in an error that
  loses its results."""
  if not path:
    return None
  if os.path.isdir(path):
    return f"{flag}={path} is a directory; give the file to write"
  folder = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    above, why = folder, e.strerror or str(e)
    while os.path.dirname(above) != above:  # a file where a folder should be
      if os.path.exists(above) and not os.path.isdir(above):
        why = f"{above} is a file"
        break
      above = os.path.dirname(above)
    return f"{flag}={path}: its folder {folder} cannot be made: {why}"
  if not os.access(path if os.path.exists(path) else folder, os.W_OK):
    return f"{flag}={path} is not writable"
  return None


def check_output_file(parser, flag: str, path: str | None) -> None:
  """`output_file_problem`, reported through `parser` (an argparse parser: one line and exit
  code 2)."""
  found = output_file_problem(flag, path)
  if found:
    parser.error(found)


# -- processes, hosts, permissions --------------------------------------------------------------
def host_tag(host: str | None = None) -> str:
  """8 hex digits naming a host (of `socket.gethostname()` by default)."""
  return hashlib.sha1((host or socket.gethostname()).encode()).hexdigest()[:8]


def process_alive(pid: int) -> bool:
  """Whether a process `pid` exists on this host (of any user)."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # it exists, owned by another user
  except OSError:
    return True  # cannot tell: assume it is alive
  return True


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
  """The process's umask, read without changing it where the OS allows.

  Linux reports it in /proc/self/status; elsewhere it is read by setting and
  restoring it (under a lock; a file created by another thread in that instant
  would get the restrictive mask 0o077).
  """
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  with _UMASK_LOCK:
    mask = os.umask(0o077)
    os.umask(mask)
  return mask


def _fsync_dir(directory: str) -> None:
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


# -- temp files ------------------------------------------------------------------------------------
TEMP_PREFIX = ".tmp-"
_TEMP_NAME = re.compile(r"^\.tmp-(\d+)-([0-9a-f]{8})-")
STALE_TEMP_AGE_S = 24 * 3600.0


def remove_stale_temporaries(directory: str, max_age_s: float = STALE_TEMP_AGE_S) -> list[str]:
  """Removes the temp files of `atomic_writer` in `directory` left by writers that died.

  A temp file is stale when its writer (the pid in its name) no longer runs
  on this host, or when it is older than `max_age_s` (a writer on another
  host, or a temp file of an older naming). Returns the removed paths.
  """
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  here, now, removed = host_tag(), time.time(), []
  for name in names:
    if not name.startswith(TEMP_PREFIX):
      continue
    path = os.path.join(directory, name)
    m = _TEMP_NAME.match(name)
    try:
      dead = m is not None and m.group(2) == here and not process_alive(int(m.group(1)))
      if dead or now - os.lstat(path).st_mtime > max_age_s:
        if os.path.isfile(path) or os.path.islink(path):
          os.unlink(path)
          removed.append(path)
    except OSError:
      continue  # removed meanwhile, or not ours to remove
  return removed


@contextlib.contextmanager
def atomic_writer(path: str, mode: str = "w"):
  """Yields a file that replaces `path` (fsync + rename) when the block ends.

  If the block raises, `path` is left as it was and the temp file removed.
  The file gets the permissions of an ordinary `open` (0o666 less the umask).
  """
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{TEMP_PREFIX}{os.getpid()}-{host_tag()}-",
                             suffix=f"-{os.path.basename(path)}")
  try:
    os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp creates 0o600
    with os.fdopen(fd, mode) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  _fsync_dir(directory)


def write_text_atomic(path: str, text: str) -> None:
  """Replaces `path` with `text` through a temp file + fsync + rename.

  Raises `WorkdirWriteError` when the file system is full or read-only.
  """
  with output_errors(path), atomic_writer(path) as f:
    f.write(text)


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON to `path` atomically (sorted keys, indented)."""
  write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def _line(obj: Any) -> str:
  return json.dumps(obj, sort_keys=True) + "\n"


def write_jsonl_atomic(path: str, objs: Iterable[Any]) -> None:
  """Replaces the JSON-lines file `path` with one line per object, atomically."""
  write_text_atomic(path, "".join(_line(o) for o in objs))


def _cut_torn_tail(f) -> None:
  """Truncates an open ("r+b") file after its last newline."""
  f.seek(0, os.SEEK_END)
  size = f.tell()
  if size == 0:
    return
  f.seek(size - 1)
  if f.read(1) == b"\n":
    return
  pos = size
  while pos > 0:
    step = min(4096, pos)
    f.seek(pos - step)
    chunk = f.read(step)
    i = chunk.rfind(b"\n")
    if i >= 0:
      f.truncate(pos - step + i + 1)
      return
    pos -= step
  f.truncate(0)


def _last_line(f) -> bytes | None:
  """The last non-blank line of an open ("r+b") file that ends with a newline; None if none."""
  pos = f.seek(0, os.SEEK_END)
  tail = b""
  while pos > 0:
    step = min(4096, pos)
    pos -= step
    f.seek(pos)
    tail = f.read(step) + tail
    lines = tail.split(b"\n")
    # lines[0] may be cut at the chunk start; any later non-blank line is complete
    complete = [l for l in lines[1:] if l.strip()]
    if complete:
      return complete[-1]
  return tail.strip() or None


class LogOrderError(RuntimeError):
  """A record that does not follow the log's last record (t = last t + 1)."""


def open_regular_fd(path: str, flags: int) -> int:
  """`os.open(path, flags)` of a regular file that is neither a symbolic link nor a hard link
  (a file with another name elsewhere); raises `NotRegularFileError` otherwise (a run writes
  only files of its own). Every file a run opens to write in place (the lock, the logs it
  appends to) is opened through this; other files are replaced by rename (`atomic_writer`)."""
  try:
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
  except OSError as e:
    if e.errno in (errno.ELOOP, errno.EISDIR):
      raise NotRegularFileError(path) from None
    raise
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
    os.close(fd)
    raise NotRegularFileError(path, links=st.st_nlink if stat.S_ISREG(st.st_mode) else 0)
  return fd


def open_regular(path: str):
  """`path` opened "r+b", created if missing, through `open_regular_fd`."""
  return open(path, "r+b", opener=lambda p, flags: open_regular_fd(p, flags | os.O_CREAT))  # pylint: disable=consider-using-with


class NotRegularFileError(ValueError):
  """An output path that is a symbolic link, a hard link (`links` > 1) or not a regular file."""

  def __init__(self, path: str, links: int = 0):
    if links > 1:
      kind = f"a hard link (one of {links} names of the same file)"
    else:
      kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
    super().__init__(f"{path} is {kind}; a run writes only regular files of its own: remove it "
                     "(or choose another --workdir)")


def _append(path: str, line: bytes, check=None) -> None:
  with output_errors(path):
    with open_regular(path) as f:
      _cut_torn_tail(f)
      if check is not None:
        check(f)
      size = f.seek(0, os.SEEK_END)
      try:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
      except OSError:
        try:  # leave the file as it was, without a torn line
          f.truncate(size)
        except OSError:
          pass  # the next append cuts the torn line off
        raise


def append_jsonl(path: str, obj: Any) -> None:
  """Appends one JSON line and fsyncs, so a crash never leaves half a line.

  A torn last line left by an earlier crash is cut off first. Raises
  `WorkdirWriteError` when the file system is full or read-only (the file is
  then left as it was).
  """
  _append(path, _line(obj).encode())


def append_record(path: str, record: dict) -> None:
  """`append_jsonl` for the metrics log: `record["t"]` must follow the last record's t.

  Raises `LogOrderError` (nothing is written) unless `record["t"]` is the last
  record's t + 1, or 0 for an empty log.
  """
  t = record["t"]

  def check(f):
    last = _last_line(f)
    last_t = None if last is None else json.loads(last)["t"]
    expected = 0 if last_t is None else last_t + 1
    if t != expected:
      where = "it is empty" if last_t is None else f"its last record is t={last_t}"
      raise LogOrderError(f"refusing to append the record of t={t} to {path}: {where} (expected "
                          f"t={expected}); is another process writing to this workdir?")

  _append(path, _line(record).encode(), check)


def read_jsonl(path: str) -> list[dict]:
  """Reads complete lines; a torn last line (no newline) is ignored."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    text = f.read()
  lines = text.split("\n")
  complete = lines[:-1]  # whatever follows the last newline is incomplete
  return [json.loads(l) for l in complete if l.strip()]
