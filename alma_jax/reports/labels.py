"""How a group of runs is named in the report's tables and figures, and in a rerun's comparison.

A group is named by some of its config fields (flattened paths): a name (`data.name`,
`method.name`, ...) by its value alone, a Switch Transformer's size field at 0 by what it stands
for (its preset's size, or the whole vocabulary), any other field as "name=value". A group's
fields may be typed or CSV text (`results.csv`): a size field is read as the number it holds.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from alma_jax.configuration.plugins import backbones as declared_backbones

# The fields that size a Switch Transformer and its vocabulary (0: the preset's size, the whole
# vocabulary).
SWITCH_SIZE_PATHS = (("model.preset",)
                     + tuple(f"model.{f}" for f in declared_backbones.SWITCH_SIZE_FIELDS)
                     + ("data.vocab_size",))


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
  if field not in SWITCH_SIZE_PATHS[1:]:
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
  v = resolved_size(g, field)
  return f"{field.split('.')[-1]}={v:g}" if isinstance(v, float) else f"{field.split('.')[-1]}={v}"


def label(g: Mapping[str, Any], fields: Sequence[str]) -> str:
  """A group's label from its `fields`: a name (`data.name`, `method.name`, ...) by its value
  alone, a Switch Transformer's size at 0 by what it stands for (`size_label`), any other field
  as "name=value" ("mnist sm width=4 wait=10", "tiny_shakespeare lm_sm dim=64")."""
  def part(f):
    if f.endswith(".name"):
      return str(g.get(f) or "")
    return size_label(g, f) if f in SWITCH_SIZE_PATHS else f"{f.split('.')[-1]}={g.get(f, '')}"
  return " ".join(p for p in map(part, fields) if p)
