"""SM: a single model fine-tuned (or retrained) on each stage's data (paper section 4.1)."""

from __future__ import annotations

from typing import Hashable

import jax
import jax.numpy as jnp

from alma_jax.methods import base
from alma_jax.methods.registry import register


@register
class SingleModel(base.SingleBackbone, base.Method):
  """One backbone trained by the configured optimizer on every stage."""

  name = "sm"

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    del structure
    params, model_state = self.init_backbone(key)
    return base.Learner(params=params, model_state=model_state, structure=())

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    del structure, frozen, rng
    logits, new_state = self.apply_backbone(trainable, model_state, x[0], train=True, mask=mask[0])
    return base.masked_cross_entropy(logits, y[0], mask[0]), new_state

  def predict(self, structure, params, model_state, x) -> jnp.ndarray:
    del structure
    logits, _ = self.apply_backbone(params, model_state, x, train=False)
    return jax.nn.log_softmax(logits)
