"""Flax Linen backbones, picked by name from `config.model.name`.

Each backbone module declares its `BackboneSpec` (`alma_jax.models.registry`):
how it is built from `config.model` and what it can do. The lines below
register the package's backbones; `spec(name)` answers what a backbone can
do (e.g. `spec(config.model.name).conv_heavy`).
"""

from alma_jax.models import mlp
from alma_jax.models import resnet
from alma_jax.models import switch
from alma_jax.models import vgg
from alma_jax.models.registry import BACKBONES
from alma_jax.models.registry import BackboneSpec
from alma_jax.models.registry import Mixture
from alma_jax.models.registry import WidthLayout
from alma_jax.models.registry import capability
from alma_jax.models.registry import check_task
from alma_jax.models.registry import get_backbone
from alma_jax.models.registry import make_backbone
from alma_jax.models.registry import names
from alma_jax.models.registry import register
from alma_jax.models.registry import spec

register(mlp.SPEC)
register(vgg.SPEC)
register(resnet.SPEC)
register(switch.SPEC)

__all__ = ["BACKBONES", "BackboneSpec", "Mixture", "WidthLayout", "capability", "check_task",
           "get_backbone", "make_backbone", "names", "register", "spec"]
