"""Methods by name: `config.method.name` -> a `Method` subclass.

A task may name a method on it by an alias of its own (`Task.METHOD_ALIASES`:
`lm_sm` is SM on text); an alias is a valid `config.method.name` and gives
the method it stands for.
"""

from __future__ import annotations

from alma_jax.configuration import fields
from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError

_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
  """Class decorator: makes a method available under `cls.name`."""
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"method name {cls.name!r} registered twice")
  plugins.declare_method(cls)
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  """The valid `config.method.name` values: the methods and the tasks' aliases of them."""
  return sorted(set(_REGISTRY) | set(plugins.method_aliases()))


def get(name: str) -> type:
  """The method class registered under `name` (or under the method an alias stands for)."""
  alias = plugins.method_aliases().get(name)
  if alias is not None:
    name = alias[0]
  if name not in _REGISTRY:
    raise ConfigError(f"config.method.name={name!r} is unknown; valid names: {names()}")
  return _REGISTRY[name]


def fields_for(config) -> tuple[fields.Field, ...]:
  """The config fields of `config`'s method (its declaration's `fields`)."""
  return plugins.method_fields(config)


def make(config, input_shape, num_classes):
  """Constructs the configured method (its constructor checks its own fields)."""
  cls = get(config.method.name)
  try:
    return cls(config, tuple(input_shape), int(num_classes))
  except ConfigError:
    raise
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    msg = " ".join(str(e).split())
    if "config." not in msg:
      msg = f"config.method (method {config.method.name!r}): {msg}"
    raise ConfigError(msg) from e
