"""Config fields declared once: path, default, check and meaning.

A `Field` names a dotted config path (`stream.wait`), its default (a value,
or `ByDataset` for defaults that differ between the MNIST and CIFAR-10
settings), a check and a line of documentation. The base fields are listed in
`alma_jax.configuration.config_lib.BASE_FIELDS`; every method declares its own
(`Method.FIELDS`). From these tables come the defaults of `base_config`, the
checks of `alma_jax.stream.validation` and the values a method reads (`resolve`),
so a default or a check is written in one place.

Every check raises `ConfigError` with the field's path and its allowed
values, e.g. `config.stream.replay=1.5 must be in [0.0, 1.0]`.

This module and the base table (`config_lib`) import nothing heavy, so that
config files load without JAX: a choice list that a heavy module owns is
named by `owned("module:ATTRIBUTE")` and read when a value is checked, and
code that reads a field of a partial config takes its default from the one
table (`get`), never from a literal of its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
from typing import Any, Callable, Iterable, Sequence

import ml_collections
from ml_collections import config_dict

from alma_jax.errors import ConfigError

_MISSING = object()
# A variant's value that leaves the field as it is for this data set (`config_lib.apply_variant`).
KEEP = object()


# -- checks: (path, value) -> value, or ConfigError --------------------------------------------
@dataclasses.dataclass(frozen=True)
class Check:
  """A check of one field's value; `kind` is the Python type of its values."""

  fn: Callable[[str, Any], Any]
  kind: type

  def __call__(self, path: str, value: Any) -> Any:
    return self.fn(path, value)


def integer(lo: int | None = None, optional: bool = False, hi: int | None = None) -> Check:
  """An integer >= `lo` (and, with `hi`, in [`lo`, `hi`])."""
  def check(path, v):
    if v is None and optional:
      return None
    if isinstance(v, bool) or not isinstance(v, int):
      raise ConfigError(f"config.{path}={v!r} must be an integer, got {type(v).__name__}")
    if hi is not None and not lo <= v <= hi:
      raise ConfigError(f"config.{path}={v} must be in [{lo}, {hi}]")
    if lo is not None and v < lo:
      raise ConfigError(f"config.{path}={v} must be >= {lo}")
    return v
  return Check(check, int)


def number(lo: float = -math.inf, hi: float = math.inf, *, open_lo: bool = False,
           open_hi: bool = False, allow_inf: bool = False, optional: bool = False) -> Check:
  """A number in the interval from `lo` to `hi`; finite (an infinite bound is open) unless
  the field opts in with `allow_inf` (a time interval where inf means never). NaN never is.
  `optional`: None passes too (a library's own default, e.g. optax.sgd's `momentum`)."""
  if not allow_inf:
    open_lo, open_hi = open_lo or lo == -math.inf, open_hi or hi == math.inf
  interval = f"{'(' if open_lo else '['}{float(lo)}, {float(hi)}{')' if open_hi else ']'}"
  none = "None or " if optional else ""

  def check(path, v):
    if v is None and optional:
      return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise ConfigError(f"config.{path}={v!r} must be {none}a number in {interval}, got "
                        f"{type(v).__name__}")
    ok_lo = v > lo if open_lo else v >= lo
    ok_hi = v < hi if open_hi else v <= hi
    if math.isnan(v) or not (ok_lo and ok_hi):
      raise ConfigError(f"config.{path}={v} must be {none}in {interval}")
    return float(v)
  return Check(check, float)


def integer_list(lo: int = 0) -> Check:
  """Comma-separated integers >= `lo` in a string ("2,2,4"; "" is the empty list); the value
  resolves to a tuple."""
  def check(path, v):
    if not isinstance(v, str):
      raise ConfigError(f"config.{path}={v!r} must be a string of comma-separated integers "
                        f"such as '2,2,4' (or '')")
    parts = [p.strip() for p in v.split(",")] if v.strip() else []
    try:
      values = tuple(int(p) for p in parts)
    except ValueError:
      raise ConfigError(f"config.{path}={v!r} must be comma-separated integers such as "
                        f"'2,2,4' (or '')") from None
    if any(x < lo for x in values):
      raise ConfigError(f"config.{path}={v!r}: every entry must be >= {lo}")
    return values
  return Check(check, str)


def boolean() -> Check:
  def check(path, v):
    if not isinstance(v, bool):
      raise ConfigError(f"config.{path}={v!r} must be true or false, got {type(v).__name__}")
    return v
  return Check(check, bool)


def owned(name: str) -> Callable[[], Iterable[str]]:
  """The choice list `ATTRIBUTE` of module `module` (`"module:ATTRIBUTE"`), read when a value is
  checked; a callable attribute (a registry's `names`) is called."""
  module, attribute = name.split(":")

  def values():
    found = getattr(importlib.import_module(module), attribute)
    return found() if callable(found) else found
  return values


def choice(values: Iterable[str] | Callable[[], Iterable[str]], what: str = "values") -> Check:
  """One of `values` (or of what the callable returns: a registry read at check time)."""
  def check(path, v):
    allowed = sorted(values() if callable(values) else values)
    if not isinstance(v, str) or v not in allowed:
      raise ConfigError(f"config.{path}={v!r} is unknown; valid {what}: {allowed}")
    return v
  return Check(check, str)


def text(what: str) -> Check:
  def check(path, v):
    if not isinstance(v, str) or not v:
      raise ConfigError(f"config.{path}={v!r} must be {what}")
    return v
  return Check(check, str)


def optional_text(what: str) -> Check:
  """A string, possibly empty (a feature turned off)."""
  def check(path, v):
    if not isinstance(v, str):
      raise ConfigError(f"config.{path}={v!r} must be {what}")
    return v
  return Check(check, str)


def optional_path() -> Check:
  def check(path, v):
    if v is not None and not isinstance(v, str):
      raise ConfigError(f"config.{path}={v!r} must be a path or None")
    return v
  return Check(check, str)


def mapping() -> Check:
  def check(path, v):
    if not isinstance(v, (dict, ml_collections.ConfigDict)):
      raise ConfigError(f"config.{path}={v!r} must be a mapping of names to values")
    return v
  return Check(check, dict)


# -- fields ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ByDataset:
  """A default that depends on the data set: `values[name]`, else `other`."""

  values: dict
  other: Any

  def get(self, dataset: str) -> Any:
    return self.values.get(dataset, self.other)


@dataclasses.dataclass(frozen=True)
class ByMethod:
  """A variant's value that depends on the method (`config.method.name`): `values[name]`, else
  `other`. Variants only: a field's default depends on the data set at most."""

  values: dict
  other: Any

  def get(self, method: str) -> Any:
    return self.values.get(method, self.other)


# `Field.was_default` of a field whose default never changed.
UNCHANGED = type("Unchanged", (), {"__repr__": lambda self: "UNCHANGED"})()
CHANGED_DEFAULTS: set[str] = set()  # the paths of fields (of any method) whose default changed


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    path: dotted path below `config`, e.g. "stream.wait".
    default: its value when absent (a `ByDataset` for dataset-dependent ones).
    check: validates a value (see the constructors above).
    doc: one line for the field table (docs/fields.md) and `--help` readers.
    resumable: the field may change when a run is resumed (it does not
      change results, e.g. where data is read from).
    was_default: the default before it changed to `default`, or `UNCHANGED`:
      a config at either default names the same folder of a sweep (its hash
      takes the old one, `alma_jax.outputs.workdir.hashed_value`).
  """

  path: str
  default: Any
  check: Check
  doc: str = ""
  resumable: bool = False
  was_default: Any = UNCHANGED

  def __post_init__(self):
    if self.was_default is not UNCHANGED:
      CHANGED_DEFAULTS.add(self.path)

  def default_for(self, dataset: str) -> Any:
    d = self.default.get(dataset) if isinstance(self.default, ByDataset) else self.default
    return dict(d) if isinstance(d, dict) else d

  @property
  def name(self) -> str:
    return self.path.rsplit(".", 1)[-1]


# -- the declared fields, by path -------------------------------------------------------------
_DECLARED: dict[str, Field] = {}
# The modules whose import declares the base fields and the tasks' fields.
_TABLES = ("alma_jax.configuration.config_lib", "alma_jax.configuration.plugins")


def declare(table: Iterable[Field]) -> None:
  """Makes the fields of `table` known by path (`declared`, `get`); a path declared twice must
  have the same default."""
  for f in table:
    known = _DECLARED.get(f.path)
    if known is not None and known.default != f.default:
      raise ValueError(f"config.{f.path} declared twice with different defaults: "
                       f"{known.default!r} and {f.default!r}")
    _DECLARED[f.path] = f


def declared(path: str) -> Field:
  """The field declared at `path` (the base fields, and those of every imported method and
  task)."""
  for module in _TABLES:
    if path not in _DECLARED:
      importlib.import_module(module)
  if path not in _DECLARED:
    raise KeyError(f"config.{path} is not a declared field")
  return _DECLARED[path]


def get(section, path: str) -> Any:
  """The value of field `path` in `section`, the config node that holds it (e.g.
  `get(config.model, "model.init")`); the declared default when absent."""
  leaf = path.rsplit(".", 1)[-1]
  if leaf in section:
    return section[leaf]
  field = declared(path)
  if isinstance(field.default, ByDataset):
    raise ConfigError(f"config.{path} is missing (its default depends on the data set)")
  return field.default_for("")


def lookup(config, path: str, default: Any = _MISSING) -> Any:
  """`config.a.b.c` for path "a.b.c"; `default` (or a ConfigError) when absent."""
  node = config
  for part in path.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      if default is not _MISSING:
        return default
      raise ConfigError(f"config.{path} is missing") from None
  return node


def value(config, field: Field) -> Any:
  """The checked value of `field` in `config` (its default when absent)."""
  dataset = lookup(config, "data.name", "")
  return field.check(field.path, lookup(config, field.path, field.default_for(dataset)))


def check_all(config, fields: Sequence[Field]) -> None:
  """Checks every field of `fields` in `config`; the first bad one raises."""
  for f in fields:
    value(config, f)


def resolve(config, fields: Sequence[Field]) -> types.SimpleNamespace:
  """The checked values of `fields`, by their last path component (`ns.num_members`)."""
  return types.SimpleNamespace(**{f.name: value(config, f) for f in fields})


def _placeholder(field: Field, dataset: str):
  d = field.default_for(dataset)
  if d is None:
    return config_dict.placeholder(field.check.kind)
  if isinstance(d, dict):
    return ml_collections.ConfigDict(d)
  return d


def fill(config: ml_collections.ConfigDict, fields: Sequence[Field], dataset: str,
         overwrite: bool = True) -> ml_collections.ConfigDict:
  """Sets every field of `fields` in `config` to its default for `dataset` (in place).

  Missing parent nodes are created; with `overwrite=False`, fields already
  present keep their values.
  """
  for f in fields:
    *parents, leaf = f.path.split(".")
    node = config
    for p in parents:
      if p not in node:
        node[p] = ml_collections.ConfigDict()
      node = node[p]
    if overwrite or leaf not in node:
      node[leaf] = _placeholder(f, dataset)
  return config
