"""Flax Linen backbones, picked by name from `config.model.name`."""

from alma_jax.models.mlp import MLP
from alma_jax.models.switch import SwitchTransformer
from alma_jax.models.vgg import VGG

BACKBONES = {"mlp": MLP, "vgg": VGG, "switch": SwitchTransformer}


def get_backbone(name: str):
  """Returns the backbone class registered under `name`."""
  if name not in BACKBONES:
    raise ValueError(f"config.model.name={name!r} is not a backbone; "
                     f"valid names: {sorted(BACKBONES)}")
  return BACKBONES[name]


def make_backbone(model_config, num_classes: int):
  """Builds the backbone module described by `config.model`."""
  cls = get_backbone(model_config.name)
  return cls.from_config(model_config, num_classes)
