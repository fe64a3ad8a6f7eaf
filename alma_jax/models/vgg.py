"""The CIFAR backbone: a reduced VGG19 with BatchNorm (Wu et al., 2020).

16 conv3x3 layers, all of width C, in blocks of 2, 2, 4, 4, 4; each block is
followed by a 2x2 max-pool; then one linear classifier. On 32x32 inputs the
last pool leaves a 1x1xC map. `VGG.widths` gives each conv layer its own
width instead (Firefly grows them); equal widths build the same parameters.
gMoE makes every block after the first a mixture of copies of that block.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from alma_jax.configuration import fields as F
from alma_jax.models import conv
from alma_jax.models import inference
from alma_jax.models import inits
from alma_jax.models import registry

BLOCKS = (2, 2, 4, 4, 4)
BN_EPSILON = 1e-5


def max_pool_2x2(x: jnp.ndarray) -> jnp.ndarray:
  """2x2 max-pool with stride 2 written as reshape + max.

  On XLA:CPU this trains faster than `nn.max_pool`, whose gradient is a
  select-and-scatter. With ties, the gradient is shared equally among the
  equal maxima (reduce_window would pick one of them).
  """
  n, h, w, c = x.shape
  return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class ConvBlock(nn.Module):
  """`num_convs` x (conv3x3 -> BatchNorm -> ReLU), then a 2x2 max-pool.

  BatchNorm's training statistics cover the whole batch, `mask` (the real
  examples of a padded batch) is not used: the trainer fills padding slots
  with real images (`alma_jax.engine.orders.padded_orders`). Masked statistics would
  be exact for a partial batch, but XLA:CPU (jax 0.10.2) computes their
  jitted gradient inside `jax.vmap` (ensemble members, gMoE experts, seeds)
  wrongly.

  The convolutions have no bias: BatchNorm subtracts the batch mean right
  after them, so a bias would get a zero gradient in training (PyTorch's
  VGG has one, as `nn.Conv2d` does by default).
  """

  width: int | Sequence[int]  # one width for every conv, or one per conv
  num_convs: int
  conv_impl: str = "xla"  # see alma_jax.models.conv
  init_scheme: str = "lecun"  # see alma_jax.models.inits

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None, active=None):
    """`active`: one (width,) mask per conv (None: all channels) zeroing inactive channels'
    outputs after the ReLU (their BatchNorm statistics are the caller's to keep)."""
    del mask
    fold = not train and inference.folds() and not self.is_initializing()
    for i in range(self.num_convs):
      width = self.width if isinstance(self.width, int) else self.width[i]
      if fold:
        x = self._folded(i, x)
      else:
        x = conv.Conv3x3(width, impl=self.conv_impl, kernel_init=inits.kernel_init(
            self.init_scheme), name=f"conv{i}")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=BN_EPSILON,
                         name=f"bn{i}")(x)
      x = nn.relu(x)
      if active is not None:
        x = x * active[i].astype(x.dtype)
      self.sow("intermediates", f"units{i}", x)  # kept only when the caller asks for them
    return max_pool_2x2(x)

  def _folded(self, i: int, x: jnp.ndarray) -> jnp.ndarray:
    """Conv layer `i` and its BatchNorm on running statistics as one convolution and a bias,
    for an evaluation program (`alma_jax.models.inference`): conv(x, kernel * m) + (bias -
    mean * m), m = scale / sqrt(var + eps), the same function up to float round-off with one
    pass over the activations fewer (on a 2-core AMD EPYC, family 26 model 2, the C=16
    inference took 0.84-1.01 times as long as defined, `benchmarks/conv_parts.py`). Reads the
    variables of `conv{i}` and `bn{i}`."""
    params, stats = self.variables["params"], self.variables["batch_stats"][f"bn{i}"]
    bn = params[f"bn{i}"]
    m = bn["scale"] * lax.rsqrt(stats["var"] + BN_EPSILON)
    kernel = params[f"conv{i}"]["kernel"] * m
    return (conv.conv3x3(x, kernel.astype(x.dtype), self.conv_impl)
            + (bn["bias"] - stats["mean"] * m).astype(x.dtype))


class VGG(nn.Module):
  """Reduced VGG19: blocks of equal width C and a linear head."""

  width: int = 64
  num_classes: int = 10
  blocks: Sequence[int] = BLOCKS
  conv_impl: str = "xla"
  init_scheme: str = "lecun"  # see alma_jax.models.inits
  widths: Sequence[int] | None = None  # one width per conv layer; None: all `width`

  @classmethod
  def from_config(cls, model_config, num_classes: int) -> "VGG":
    impl = conv.resolve_impl(F.get(model_config, "model.conv_impl"), model_config.width)
    return cls(width=model_config.width, num_classes=num_classes, conv_impl=impl,
               init_scheme=inits.check(F.get(model_config, "model.init")))

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False, mask=None,
               active: Sequence[jnp.ndarray] | None = None) -> jnp.ndarray:
    """Logits; `active`: one (width,) channel mask per conv layer (None: all channels)."""
    for i, n in enumerate(self.blocks):
      start = sum(self.blocks[:i])
      width = self.width if self.widths is None else tuple(self.widths[start:start + n])
      x = ConvBlock(width, n, self.conv_impl, self.init_scheme, name=f"block{i}")(
          x, train, mask, None if active is None else active[start:start + n])
    x = x.reshape((x.shape[0], -1))
    return inits.dense(self.num_classes, self.init_scheme, x.shape[-1], "head")(x)


def block_layout(num_convs: int) -> registry.WidthLayout:
  """The conv layers of one `ConvBlock` (paths inside the block): kernels, BatchNorm
  parameters and statistics, and where each layer's output is sown."""
  return registry.WidthLayout(
      kernels=tuple((f"conv{i}", "kernel") for i in range(num_convs)),
      vectors=tuple((((f"bn{i}", "scale"), 1.0), ((f"bn{i}", "bias"), 0.0))
                    for i in range(num_convs)),
      stats=tuple(((("batch_stats", f"bn{i}", "mean"), 0.0), (("batch_stats", f"bn{i}", "var"),
                                                              1.0)) for i in range(num_convs)),
      build=None, units=tuple((f"units{i}",) for i in range(num_convs)))


def width_layout(model_config, num_classes: int) -> registry.WidthLayout:
  """Firefly grows the 16 conv layers: their kernels, BatchNorm parameters and statistics."""
  scheme = inits.check(F.get(model_config, "model.init"))

  def build(widths: tuple[int, ...]) -> VGG:
    impl = conv.resolve_impl(F.get(model_config, "model.conv_impl"), min(widths))
    return VGG(width=widths[0], num_classes=num_classes, conv_impl=impl, widths=widths,
               init_scheme=scheme)

  return registry.joined((block_layout(n).within((f"block{b}",)) for b, n in enumerate(BLOCKS)),
                         build=build)


def mixture(model_config, num_classes: int) -> registry.Mixture:
  """The blocks after the first are mixtures; the first block is the shared stem. Every
  conv layer is a hidden layer (`Mixture.expert_units`, `stem_units`)."""
  del num_classes
  width = int(model_config.width)
  scheme = inits.check(F.get(model_config, "model.init"))
  impl = conv.resolve_impl(F.get(model_config, "model.conv_impl"), width)
  experts = tuple(ConvBlock(width, n, impl, scheme) for n in BLOCKS[1:])
  return registry.Mixture(experts, stem=ConvBlock(width, BLOCKS[0], impl, scheme),
                          expert_units=tuple(block_layout(n) for n in BLOCKS[1:]),
                          stem_units=block_layout(BLOCKS[0]))


SPEC = registry.BackboneSpec("vgg", VGG.from_config, conv_heavy=True,
                             width_layout=width_layout, mixture=mixture,
                             side_multiple=2 ** len(BLOCKS))  # a 2x2 max-pool per block
