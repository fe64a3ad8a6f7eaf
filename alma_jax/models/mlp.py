"""The MNIST backbone: a fully connected network 784 -> H -> H -> classes.

Firefly grows both hidden layers; gMoE makes each hidden layer a mixture of
`DenseExpert`s whose gates see the flattened layer input.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from alma_jax.configuration import fields as F
from alma_jax.models import inits
from alma_jax.models import registry


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
               init_scheme=inits.check(F.get(model_config, "model.init")))

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False, mask=None,
               active: Sequence[jnp.ndarray] | None = None) -> jnp.ndarray:
    """Logits; `active` (one (width,) mask per hidden layer, or None: all) zeroes the
    outputs of inactive units, so they contribute nothing and receive no gradient."""
    del train, mask  # no batch statistics in this backbone
    x = x.reshape((x.shape[0], -1))
    for i in range(self.depth):
      width = self.hidden if self.widths is None else self.widths[i]
      x = nn.relu(inits.dense(width, self.init_scheme, x.shape[-1], f"dense{i}")(x))
      if active is not None:
        x = x * active[i].astype(x.dtype)
      self.sow("intermediates", f"units{i}", x)  # kept only when the caller asks for them
    return inits.dense(self.num_classes, self.init_scheme, x.shape[-1], "head")(x)


class DenseExpert(nn.Module):
  """One MLP layer as an expert: flatten, Dense(features), ReLU."""

  features: int
  init_scheme: str = "lecun"  # see alma_jax.models.inits

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask
    x = x.reshape((x.shape[0], -1))
    return nn.relu(inits.dense(self.features, self.init_scheme, x.shape[-1], "dense")(x))


# The one layer of a `DenseExpert`: its channels are the mixture's output, nothing is sown.
EXPERT_UNITS = registry.WidthLayout(kernels=(("dense", "kernel"),),
                                    vectors=(((("dense", "bias"), 0.0),),), stats=((),),
                                    build=None)


def width_layout(model_config, num_classes: int) -> registry.WidthLayout:
  """Firefly grows the hidden layers: their kernels and biases."""
  depth, scheme = MLP.depth, inits.check(F.get(model_config, "model.init"))

  def build(widths: tuple[int, ...]) -> MLP:
    return MLP(hidden=widths[0], num_classes=num_classes, depth=len(widths), widths=widths,
               init_scheme=scheme)

  return registry.WidthLayout(
      kernels=tuple((f"dense{l}", "kernel") for l in range(depth)),
      vectors=tuple(((((f"dense{l}", "bias"), 0.0),) for l in range(depth))),
      stats=tuple(() for _ in range(depth)), build=build,
      units=tuple((f"units{l}",) for l in range(depth)))


def mixture(model_config, num_classes: int) -> registry.Mixture:
  """Both hidden layers are mixtures; the gates see the flattened layer input. An expert is
  one layer, so a mixture's output channels are its hidden units (`Mixture.expert_units`)."""
  del num_classes
  scheme = inits.check(F.get(model_config, "model.init"))
  experts = tuple(DenseExpert(int(model_config.width), scheme) for _ in range(MLP.depth))
  return registry.Mixture(experts, pooled_gates=False, gather_hard_eval=True,
                          expert_units=(EXPERT_UNITS,) * MLP.depth)


SPEC = registry.BackboneSpec("mlp", MLP.from_config, width_layout=width_layout,
                             mixture=mixture)
