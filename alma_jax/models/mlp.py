"""The MNIST backbone: a fully connected network 784 -> H -> H -> classes."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from alma_jax.models import inits


class MLP(nn.Module):
  """Three-layer perceptron with ReLU units (paper section 5, H = 4 ... 64).

  `layers(...)` exposes the three dense layers separately so mixtures of
  experts can replace any of them with a mixture of the same layer.
  """

  hidden: int = 64
  num_classes: int = 10
  depth: int = 2  # number of hidden layers
  init_scheme: str = "lecun"  # see alma_jax.models.inits
  widths: Sequence[int] | None = None  # one width per hidden layer; None: `hidden` each

  @classmethod
  def from_config(cls, model_config, num_classes: int) -> "MLP":
    return cls(hidden=model_config.width, num_classes=num_classes,
               init_scheme=inits.check(model_config.get("init", "lecun")))

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False, mask=None) -> jnp.ndarray:
    del train, mask  # no batch statistics in this backbone
    x = x.reshape((x.shape[0], -1))
    for i in range(self.depth):
      width = self.hidden if self.widths is None else self.widths[i]
      x = nn.relu(inits.dense(width, self.init_scheme, x.shape[-1], f"dense{i}")(x))
    return inits.dense(self.num_classes, self.init_scheme, x.shape[-1], "head")(x)
