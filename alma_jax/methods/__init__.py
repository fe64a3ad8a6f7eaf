"""Methods of the paper, registered by name (`config.method.name`)."""

from __future__ import annotations

from alma_jax.methods.base import Learner, Method

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
  """Class decorator: makes a method available under `cls.name`."""
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"method name {cls.name!r} registered twice")
  _REGISTRY[cls.name] = cls
  return cls


def _load_builtin() -> None:
  # Importing the modules registers their methods.
  from alma_jax.methods import sm  # pylint: disable=g-import-not-at-top,unused-import
  from alma_jax.methods import ensemble  # pylint: disable=g-import-not-at-top,unused-import
  from alma_jax.methods import gmoe  # pylint: disable=g-import-not-at-top,unused-import


def names() -> list[str]:
  _load_builtin()
  return sorted(_REGISTRY)


def get(name: str) -> type[Method]:
  """Returns the method class registered under `name`."""
  _load_builtin()
  if name not in _REGISTRY:
    raise ValueError(f"config.method.name={name!r} is not a method; valid names: {sorted(_REGISTRY)}")
  return _REGISTRY[name]


__all__ = ["Learner", "Method", "register", "get", "names"]
