"""SM: a single model fine-tuned (or retrained) on each stage's data (paper section 4.1).

On text (the Switch Transformer) this is the paper's SM with E experts per block; the
task's loss adds the backbone's load-balancing loss.
"""

from __future__ import annotations

from typing import Hashable

import jax

from alma_jax.configuration.plugins import methods as declared
from alma_jax.methods import base
from alma_jax.methods.registry import register


@register
class SingleModel(declared.SM, base.SingleBackbone, base.Method):
  """One backbone trained by the configured optimizer on every stage."""

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    del structure
    params, model_state = self.init_backbone(key)
    return base.Learner(params=params, model_state=model_state, structure=())

  def outputs(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    del structure
    return self.forward_backbone(params, model_state, x, train=train, mask=mask, rng=rng)

  def hidden_units(self, structure, params, model_state, x) -> list:
    del structure
    return self.backbone_units(params, model_state, x)
