"""This process's `XLA_FLAGS`: the values a flag is given, and flags replaced.

XLA reads the variable once, when JAX starts its backend, so a flag set here
counts only before that; where a flag is given more than once, XLA takes the
last value.
"""

from __future__ import annotations

import os
from typing import Iterable

ENV = "XLA_FLAGS"


def current() -> str:
  """This process's `XLA_FLAGS` ("" when unset)."""
  return os.environ.get(ENV, "")


def _name(flag: str) -> str:
  return flag.split("=", 1)[0]


def values(name: str, flags: str | None = None) -> list[str]:
  """The values given to the flag `name` (e.g. "--xla_gpu_autotune_level") in `flags`
  (default: this process's `XLA_FLAGS`), in order: the last one is the one XLA takes."""
  flags = current() if flags is None else flags
  return [f.split("=", 1)[1] if "=" in f else "" for f in flags.split() if _name(f) == name]


def replaced(flags: str, names: Iterable[str], new: Iterable[str]) -> str:
  """`flags` without any flag named in `names`, followed by the flags `new`."""
  names = set(names)
  return " ".join([f for f in flags.split() if _name(f) not in names] + list(new))


def replace(names: Iterable[str], new: Iterable[str]) -> None:
  """Replaces, in this process's `XLA_FLAGS`, the flags named in `names` by `new`."""
  os.environ[ENV] = replaced(current(), names, new)
