"""A run's options: its validated config as frozen, typed values.

The run's set-up (`alma_jax.stream.run_setup`) turns the validated config into
`Options` once; everything below it (the engine, the methods, the tasks, the
policies, the backbones, the observers and the outputs) reads these, never the
`ml_collections.ConfigDict` that the command line and the config files build.
Each section (`data`, `stream`, `model`, `method`, `train`, `optimizer`,
`mesh`, `checkpoint`, `log`) is a frozen dataclass whose fields are the
section's config fields (the base fields and those its task, method and
policies declare: `alma_jax.configuration.plugins`), typed by their
declarations; a mapping field (e.g. `optimizer.kwargs`) is a read-only mapping.

A section reads as a config section does (`o.train.batch_size`,
`o.train["batch_size"]`, `"batch_size" in o.train`, `o.train.get(...)`), so
`fields.get` and `fields.lookup` serve both; it cannot be changed, only
rebuilt (`replace`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Iterator, Mapping

import ml_collections

from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError


class Section:
  """The reading interface of an options section (the base of every generated class)."""

  def __getitem__(self, name: str) -> Any:
    if name not in self.__dataclass_fields__:
      raise KeyError(name)
    return getattr(self, name)

  def __contains__(self, name: object) -> bool:
    return name in self.__dataclass_fields__

  def __iter__(self) -> Iterator[str]:
    return iter(self.__dataclass_fields__)

  def keys(self):
    return self.__dataclass_fields__.keys()

  def items(self):
    return [(k, getattr(self, k)) for k in self.__dataclass_fields__]

  def get(self, name: str, default: Any = None) -> Any:
    return getattr(self, name) if name in self.__dataclass_fields__ else default

  def to_dict(self) -> dict:
    """The section as plain Python values (dicts and lists), as JSON would hold it."""
    return {k: _plain(v) for k, v in self.items()}


def _plain(value):
  if isinstance(value, Section):
    return value.to_dict()
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


@functools.lru_cache(maxsize=None)
def _section_class(name: str, fields: tuple[tuple[str, Any], ...]) -> type:
  """One class per section name and field list, so that equal options compare equal."""
  return dataclasses.make_dataclass(name, list(fields), bases=(Section,), frozen=True)


def _frozen(value):
  if isinstance(value, ml_collections.ConfigDict):
    return types.MappingProxyType({k: _frozen(v) for k, v in _items(value)})
  if isinstance(value, dict):
    return types.MappingProxyType({k: _frozen(v) for k, v in value.items()})
  if isinstance(value, list):
    return tuple(_frozen(v) for v in value)
  return value


def _declared_kinds(config) -> dict[str, type]:
  declared = (config_lib.base_fields() + plugins.task(config).FIELDS
              + plugins.method_fields(config))
  return {f.path: f.check.kind for f in declared}


def _items(node) -> list:
  """A ConfigDict's (key, value) pairs in the order they were set, as its JSON holds them
  (its `items()` sorts them)."""
  return [(key, node[key]) for key in node._fields]  # pylint: disable=protected-access


def _build(name: str, prefix: str, node, kinds: dict[str, type]) -> Section:
  fields, values = [], {}
  for key, value in _items(node):
    path = prefix + key
    if isinstance(value, ml_collections.ConfigDict) and kinds.get(path) is not dict:
      value = _build(key.title() + "Options", path + ".", value, kinds)
      kind = type(value)
    else:
      value = _frozen(value)
      kind = Mapping if isinstance(value, Mapping) else kinds.get(path, Any)
    fields.append((key, kind))
    values[key] = value
  return _section_class(name, tuple(fields))(**values)


def of(config: ml_collections.ConfigDict) -> Section:
  """The options of a validated, completed `config` (`alma_jax.stream.validation`)."""
  if isinstance(config, Section):
    return config
  return _build("Options", "", config, _declared_kinds(config))


def replace(options: Section, **changes) -> Section:
  """`options` with the values of `changes`, given by dotted path ("train.epochs": 1)."""
  by_section: dict[str, dict] = {}
  top = {}
  for path, value in changes.items():
    head, _, rest = path.partition(".")
    if rest:
      by_section.setdefault(head, {})[rest] = value
    else:
      top[path] = value
  for head, inner in by_section.items():
    top[head] = replace(options[head], **inner)
  unknown = sorted(k for k in top if k not in options)
  if unknown:
    raise ConfigError(f"config has no field {unknown[0]!r}")
  return dataclasses.replace(options, **top)
