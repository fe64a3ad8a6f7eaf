"""Grid files: Python files that define a sweep's GRID, its FINDINGS and `run_seconds`.

A grid file is named by its path, or by the name of a grid shipped with
alma_jax (`findings`, `findings_cifar`, ... in the repository's
`launch/grids/`, installed as `alma_jax/launch/grids`); the sweep, the report
and the findings read it the same way: its code runs once, and they take the
names they need from what it defines.
"""

from __future__ import annotations

import os

from alma_jax import errors
from alma_jax.configuration import fields as F

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # alma_jax/


class GridFileError(ValueError):
  """A grid file that cannot be found or run; the message names the flag that gave it."""


def grids_dir() -> str | None:
  """The folder of the grids shipped with alma_jax (the installed copy first, as for the
  config files), or None when neither exists."""
  for folder in (os.path.join(_PACKAGE_DIR, "launch", "grids"),
                 os.path.join(os.path.dirname(_PACKAGE_DIR), "launch", "grids")):
    if os.path.isdir(folder):
      return folder
  return None


def names() -> list[str]:
  """The names of the shipped grids."""
  folder = grids_dir()
  return sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py")) if folder else []


def path(value: str, flag: str = "--grid_file") -> str:
  """The file that `flag=value` names: `value` itself when it is a file, else the shipped grid
  of that name (`findings`, `findings.py` or `launch/grids/findings.py`). A folder is never a
  grid file: `findings` names the shipped grid in a folder that holds a sweep's root of that
  name (`--root=findings`)."""
  if os.path.exists(value) and not os.path.isdir(value):
    return value
  folder = grids_dir()
  name = os.path.basename(value.rstrip(os.sep)).removesuffix(".py")
  if folder and os.sep not in value.rstrip(os.sep).removeprefix("launch/grids/"):
    shipped = os.path.join(folder, name + ".py")
    if os.path.isfile(shipped):
      return shipped
  if os.path.isdir(value):
    raise GridFileError(f"{flag}={value}: a folder, not a grid file, nor the name of a grid "
                        f"of alma_jax's (names: {', '.join(names()) or 'none'})")
  raise GridFileError(f"{flag}={value}: no such file, nor a grid of alma_jax's "
                      f"(names: {', '.join(names()) or 'none'})")


def scope(file: str, flag: str = "--grid_file") -> dict:
  """The names that the grid file `file` defines (its code run once)."""
  defined = {"__file__": file, "__name__": "grid_file"}
  try:
    with open(file) as f:
      exec(compile(f.read(), file, "exec"), defined)  # pylint: disable=exec-used
  except Exception as e:  # pylint: disable=broad-except  (its code may raise anything)
    what = errors.located(e, file) or errors.one_line(e)
    raise GridFileError(f"{flag}={file}: {what}") from e
  return defined


def seconds_by_fields(time_s, config: dict) -> float | None:
  """A grid file's `run_seconds` by a table of measured times: the seconds of the first entry
  of `time_s` ((fields, seconds) pairs, fields as {dotted path: value}) whose every field has
  its value in `config` (a point's resolved config, a nested dict); None where none does."""
  return next((s for fields, s in time_s
               if all(F.lookup(config, k, None) == v for k, v in fields.items())), None)
