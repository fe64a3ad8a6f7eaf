"""Crash-safe writes of the run's outputs (JSON files and the JSON-lines log).

A JSON file is replaced atomically (temp file, fsync, rename, fsync of the
directory), so readers see the old or the new content, never a mix. The
JSON-lines log is appended one fsynced line at a time; a line torn by a crash
(no trailing newline) is ignored by `read_jsonl` and cut off by the next
`append_jsonl`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterable


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


@contextlib.contextmanager
def atomic_writer(path: str, mode: str = "w"):
  """Yields a file that replaces `path` (fsync + rename) when the block ends.

  If the block raises, `path` is left as it was and the temp file removed.
  """
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
  try:
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
  """Replaces `path` with `text` through a temp file + fsync + rename."""
  with atomic_writer(path) as f:
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


def append_jsonl(path: str, obj: Any) -> None:
  """Appends one JSON line and fsyncs, so a crash never leaves half a line.

  A torn last line left by an earlier crash is cut off first.
  """
  line = _line(obj).encode()
  with open(path, "ab"):
    pass  # create the file if needed
  with open(path, "r+b") as f:
    _cut_torn_tail(f)
    f.seek(0, os.SEEK_END)
    f.write(line)
    f.flush()
    os.fsync(f.fileno())


def read_jsonl(path: str) -> list[dict]:
  """Reads complete lines; a torn last line (no newline) is ignored."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    text = f.read()
  lines = text.split("\n")
  complete = lines[:-1]  # whatever follows the last newline is incomplete
  return [json.loads(l) for l in complete if l.strip()]
