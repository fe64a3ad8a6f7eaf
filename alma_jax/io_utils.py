"""Crash-safe writes of the run's outputs (JSON files and the JSON-lines log)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON to `path` through a temp file + fsync + rename."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=2, sort_keys=True)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def append_jsonl(path: str, obj: Any) -> None:
  """Appends one JSON line and fsyncs, so a crash never leaves half a line."""
  line = json.dumps(obj, sort_keys=True) + "\n"
  with open(path, "a") as f:
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
