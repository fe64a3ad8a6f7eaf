"""Experiment config files by name: `--config=mnist_sm:quick`.

A name stands for a file of the experiment folder: the repository's top-level
`configs/` in a source checkout or an editable install, the copy installed as
`alma_jax/configs` from a wheel. `mnist_sm`, `mnist_sm.py` and
`configs/mnist_sm.py` all name `<folder>/mnist_sm.py`; files in subfolders are
named by their relative path (`bench/p3_mnist_sm`). A variant keeps following
the colon. A path of an existing file always wins, so a command that names a
file keeps its meaning wherever a name would match too; a directory is never a
config file (a workdir named like its config, `--workdir=mnist_sm`, does not
shadow the name `mnist_sm`).

The entry point (`alma_jax.main.console`, also behind `python -m
alma_jax.main`) rewrites `--config` in argv before absl parses the flags, so
a mistyped name fails before the config loads or anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence
import difflib
import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # alma_jax/
_FLAGS = ("--config", "-config")
_CUTOFF = 0.6  # difflib similarity of a suggested name, at least
_SPREAD = 0.1  # and at most this far below the closest name's


class UnknownConfigError(ValueError):
  """A `--config` value that is neither an existing file nor a config's name."""


def configs_dir() -> str | None:
  """The folder of the experiment files, or None when neither copy exists.

  The installed copy (`alma_jax/configs`, from a wheel) comes first; a source
  checkout has none, and its top-level `configs/` sits next to the package.
  """
  for folder in (os.path.join(_PACKAGE_DIR, "configs"),
                 os.path.join(os.path.dirname(_PACKAGE_DIR), "configs")):
    if os.path.isdir(folder):
      return folder
  return None


def available(folder: str | None = None) -> list[str]:
  """Sorted names of the config files under `folder` (default: `configs_dir()`)."""
  folder = configs_dir() if folder is None else folder
  if not folder or not os.path.isdir(folder):
    return []
  found = []
  for parent, subdirs, files in os.walk(folder):
    subdirs[:] = [d for d in subdirs if not d.startswith(("_", "."))]
    for f in files:
      if f.endswith(".py") and not f.startswith(("_", ".")):
        rel = os.path.relpath(os.path.join(parent, f[:-3]), folder)
        found.append(rel.replace(os.sep, "/"))
  return sorted(found)


def _as_name(path: str) -> str:
  """`configs/mnist_sm.py`, `mnist_sm.py`, `./mnist_sm` -> `mnist_sm`."""
  name = path.replace(os.sep, "/")
  while name.startswith("./"):
    name = name[2:]
  name = name.removeprefix("configs/")
  return name.removesuffix(".py")


def suggestions(name: str, names: Sequence[str]) -> list[str]:
  """Up to three names close to `name` (difflib), the closest first.

  A file in a subfolder also matches by its basename; names much further from
  `name` than the closest one are left out.
  """
  def score(n):
    return max(difflib.SequenceMatcher(None, name, m).ratio() for m in (n, n.rsplit("/", 1)[-1]))
  scored = sorted(((score(n), n) for n in names), key=lambda p: (-p[0], p[1]))
  best = scored[0][0] if scored else 0.0
  return [n for s, n in scored[:3] if s >= max(_CUTOFF, best - _SPREAD)]


def resolve(value: str, folder: str | None = None) -> str:
  """The `--config` value `value` with a config's name replaced by its file's path.

  Args:
    value: `PATH_OR_NAME[:VARIANT]`, as given to `--config`.
    folder: where names are looked up (default: `configs_dir()`).

  Returns:
    `value` itself when its path exists (or is empty), else `<folder>/<name>.py`
    followed by the same `:VARIANT`.

  Raises:
    UnknownConfigError: the path does not exist and names no config; the
      one-line message lists the available names and any close ones.
  """
  path, colon, variant = value.partition(":")
  if not path and not colon or (os.path.exists(path) and not os.path.isdir(path)):
    return value
  folder = configs_dir() if folder is None else folder
  names = available(folder)
  if not path:
    listed = ", ".join(names) if names else "none (no configs folder found)"
    raise UnknownConfigError(f"--config={value}: no config file or name before the colon "
                             f"(e.g. --config=mnist_sm{colon}{variant}). Available names: "
                             f"{listed}")
  name = _as_name(path)
  if name in names:
    return os.path.join(folder, *name.split("/")) + ".py" + colon + variant
  if os.path.isdir(path):
    listed = ", ".join(names) if names else "none (no configs folder found)"
    raise UnknownConfigError(f"--config={value}: {path!r} is a directory, not a config file, "
                             f"and names no config. Available names: {listed}")
  close = suggestions(name, names)
  hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
  listed = ", ".join(names) if names else "none (no configs folder found)"
  raise UnknownConfigError(f"--config={value}: no config file or name {path!r}{hint} "
                           f"Available names: {listed}")


def _config_flags(argv: Sequence[str]):
  """(index, flag prefix, value) of each `--config` value in `argv` (a command line, its
  program first): `--config=VALUE` at its own index with the prefix `--config=`, `--config
  VALUE` at the value's index with no prefix; none after `--`."""
  for i in range(1, len(argv)):
    arg = argv[i]
    if arg == "--":
      break
    flag, eq, value = arg.partition("=")
    if flag in _FLAGS and eq:
      yield i, f"{flag}=", value
    elif arg in _FLAGS and i + 1 < len(argv):
      yield i + 1, "", argv[i + 1]


def config_value(argv: Sequence[str]) -> str | None:
  """The value of the last `--config` flag in `argv` as written (None: no such flag)."""
  values = [value for _, _, value in _config_flags(argv)]
  return values[-1] if values else None


def resolve_argv(argv: Sequence[str], folder: str | None = None) -> list[str]:
  """`argv` with the value of its `--config` flag resolved (see `resolve`).

  Both `--config=VALUE` and `--config VALUE` are rewritten; `--config.*`
  overrides, other flags and everything after `--` are left as they are.
  """
  out = list(argv)
  for i, prefix, value in _config_flags(argv):
    out[i] = prefix + resolve(value, folder)
  return out


def resolve_argv_or_exit(argv: Sequence[str]) -> list[str]:
  """`resolve_argv(argv)`, or a one-line error on stderr and exit code 2."""
  try:
    return resolve_argv(argv)
  except UnknownConfigError as e:
    print(f"alma_jax: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
