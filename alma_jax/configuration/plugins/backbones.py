"""What a config needs to know of each backbone: the tasks it serves, whether it has experts
of its own (gMoE then grows those instead of gated mixtures), and the Switch Transformer's
preset sizes.

The backbones themselves (`alma_jax.models`) declare the same facts in their `BackboneSpec`;
`alma_jax.models.register` adds a backbone registered at run time here and refuses one whose
facts differ from those below.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Backbone:
  """A backbone's declaration: the tasks whose data it models, and whether it has experts."""

  tasks: tuple[str, ...] = ("images",)
  own_experts: bool = False


BACKBONES: dict[str, Backbone] = {
    "mlp": Backbone(),
    "vgg": Backbone(),
    "resnet": Backbone(),
    "switch": Backbone(("text",), own_experts=True),
}


# The Switch Transformer's sizes by preset (`config.model.preset`), which a config's zero size
# fields stand for: read by the backbone and by reports, which name a size without importing it.
SWITCH_PRESETS = {
    # name: (layers, model dimension, heads, feed-forward dimension, a mixture every k-th block).
    # base and large: the paper's sizes (section 5: 40M shared + 6M per expert, 96M + 28M),
    # with Switch Transformers' d_ff = 4 d and a mixture in every other block.
    "tiny": (2, 64, 2, 128, 1),
    "base": (6, 512, 8, 2048, 2),
    "large": (12, 768, 12, 3072, 2),
}
SWITCH_SIZE_FIELDS = ("num_layers", "dim", "num_heads", "ffn_dim", "moe_every")


def switch_size(preset: str, field: str, value: int) -> int:
  """A Switch Transformer's size `field` ("dim", ...): `value`, or where it is 0 the preset's."""
  return int(value) or SWITCH_PRESETS[preset][SWITCH_SIZE_FIELDS.index(field)]


def declare(name: str, backbone: Backbone) -> None:
  """Adds backbone `name`; a name declared with other facts is an error."""
  known = BACKBONES.get(name)
  if known is not None and known != backbone:
    raise ValueError(f"backbone {name!r} is declared as {known}, but registered as {backbone}")
  BACKBONES[name] = backbone


def own_experts(model_name: str) -> bool:
  """Whether backbone `model_name` has expert layers of its own (False for an unknown name)."""
  known = BACKBONES.get(model_name)
  return known is not None and known.own_experts
