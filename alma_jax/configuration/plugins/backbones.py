"""What a config needs to know of each backbone: the tasks it serves and whether it has experts
of its own (gMoE then grows those instead of gated mixtures).

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
