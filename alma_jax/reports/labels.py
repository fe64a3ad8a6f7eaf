"""How a group of runs is named in the report's tables and figures, and in a rerun's comparison.

A group is named by some of its config fields (flattened paths): a name (`data.name`,
`method.name`, ...) by its value alone, a Switch Transformer's size field at 0 by what it stands
for (its preset's size, or the whole vocabulary), any other field as "name=value". A group's
fields may be typed or CSV text (`results.csv`): a size field is read as the number it holds.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from alma_jax.configuration import plugins
from alma_jax.configuration.plugins import backbones as declared_backbones

# The size fields of a Switch Transformer and its vocabulary, whose 0 stands for the preset's size
# or the whole vocabulary; with the preset, the fields that set a Switch Transformer's size.
_SIZE_FIELD_PATHS = (tuple(f"model.{f}" for f in declared_backbones.SWITCH_SIZE_FIELDS)
                     + ("data.vocab_size",))
SWITCH_SIZE_PATHS = ("model.preset",) + _SIZE_FIELD_PATHS
# The fields that choose a policy, each with the declared policies it may choose.
POLICY_TABLES = {"stream.warm_start": plugins.STAGE_POLICIES,
                 "stream.wait_policy": plugins.WAIT_POLICIES}
# The older spelling of the warm start `scratch` (`stream.init_from_scratch`), which the
# config sets from `stream.warm_start`.
LEGACY_POLICY_FIELDS = ("stream.init_from_scratch",)


def unused_policy_fields(g: Mapping[str, Any]) -> set[str]:
  """The fields of the policies that `g` (a group's fields, typed or as CSV text) does not
  use, and the older spelling of its warm start: the config holds them all, but they say
  nothing of `g`'s runs."""
  used = {p for field, table in POLICY_TABLES.items()
          if (cls := table.get(str(g.get(field) or ""))) is not None for p in cls.paths()}
  return ({f.path for f in plugins.policy_fields()} - used) | set(LEGACY_POLICY_FIELDS)


def value_text(v: Any) -> str:
  """A config value as a label shows it: a float in its shortest form ("0.5", "1e-05")."""
  return f"{v:g}" if isinstance(v, float) else str(v)


def _number(v: Any) -> Any:
  """A CSV cell as the number it holds (an integral one as an int), else as it is."""
  if isinstance(v, str):
    try:
      v = float(v)
    except ValueError:
      return v
  return int(v) if isinstance(v, float) and v.is_integer() else v


def resolved_size(g: Mapping[str, Any], field: str) -> Any:
  """`g`'s value of `field` (a config path; `g` a group's fields, typed or as CSV text), a
  Switch Transformer's size field at 0 resolved to what it stands for: its preset's size, or
  the whole vocabulary ("all")."""
  v = g.get(field)
  if field not in _SIZE_FIELD_PATHS:
    return v
  v = _number(v)
  if field == "data.vocab_size":
    return v or "all"
  preset = g.get("model.preset")
  if preset in declared_backbones.SWITCH_PRESETS:
    return declared_backbones.switch_size(preset, field.split(".")[-1], v or 0)
  return v


def size_label(g: Mapping[str, Any], field: str) -> str:
  """"name=value" of `field` in `g`, by `resolved_size` ("dim=64", "vocab_size=all")."""
  return f"{field.split('.')[-1]}={value_text(resolved_size(g, field))}"


def label(g: Mapping[str, Any], fields: Sequence[str]) -> str:
  """A group's label from its `fields`: a name (`data.name`, `method.name`, ...) by its value
  alone, a Switch Transformer's size at 0 by what it stands for (`size_label`), any other field
  as "name=value" ("mnist sm width=4 wait=10", "tiny_shakespeare lm_sm dim=64")."""
  def part(f):
    if f.endswith(".name"):
      return str(g.get(f) or "")
    return size_label(g, f) if f in SWITCH_SIZE_PATHS else f"{f.split('.')[-1]}={g.get(f, '')}"
  return " ".join(p for p in map(part, fields) if p)
