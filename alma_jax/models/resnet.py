"""A CIFAR backbone: ResNet-18 for 32x32 inputs (He et al., 2016), width multiplier C.

A 3x3 stem convolution of C channels (stride 1, no pooling), then 4 stages of
2 BasicBlocks with C, 2C, 4C, 8C channels and strides 1, 2, 2, 2 (32x32 ->
4x4 maps), a global average pool and one linear classifier. A BasicBlock is
conv3x3 -> BatchNorm -> ReLU -> conv3x3 -> BatchNorm, added to its input
(through a 1x1 convolution and BatchNorm where the stride or the width
changes), then ReLU. C = 64 is the usual ResNet-18 (11.2M parameters).

As in the VGG (`alma_jax.models.vgg`): `config.model.width` is C,
`config.model.init` the initialisation, convolutions have no bias (BatchNorm
follows each one), BatchNorm's training statistics cover the whole batch
(`mask` is not used; see `vgg.ConvBlock`) and its running statistics live in
`batch_stats`. The stride-1 3x3 convolutions use `config.model.conv_impl`
(`alma_jax.models.conv`); the strided ones XLA's own.

Firefly and gMoE do not take it: its spec declares neither a width layout
(residual additions tie the widths within a stage) nor mixture points.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from alma_jax.configuration import fields as F
from alma_jax.models import conv
from alma_jax.models import inits
from alma_jax.models import registry

STAGES = (2, 2, 2, 2)  # BasicBlocks per stage; stage s has 2^s C channels


def batch_norm(train: bool, name: str) -> nn.BatchNorm:
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with BatchNorm and a residual connection."""

  features: int
  stride: int = 1
  conv_impl: str = "xla"  # of the stride-1 3x3 convolutions (see alma_jax.models.conv)
  init_scheme: str = "lecun"  # see alma_jax.models.inits

  def conv(self, x, kernel: int, stride: int, name: str):
    init = inits.kernel_init(self.init_scheme)
    if kernel == 3 and stride == 1:
      return conv.Conv3x3(self.features, impl=self.conv_impl, kernel_init=init, name=name)(x)
    return nn.Conv(self.features, (kernel, kernel), strides=(stride, stride),
                   padding=((kernel // 2,) * 2,) * 2, use_bias=False, kernel_init=init,
                   name=name)(x)

  @nn.compact
  def __call__(self, x, train: bool = False):
    y = nn.relu(batch_norm(train, "bn0")(self.conv(x, 3, self.stride, "conv0")))
    y = batch_norm(train, "bn1")(self.conv(y, 3, 1, "conv1"))
    if self.stride != 1 or x.shape[-1] != self.features:
      x = batch_norm(train, "shortcut_bn")(self.conv(x, 1, self.stride, "shortcut"))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """ResNet-18 for CIFAR: stem, 4 stages of BasicBlocks, global average pool, linear head."""

  width: int = 64
  num_classes: int = 10
  stages: Sequence[int] = STAGES
  conv_impl: str = "xla"
  init_scheme: str = "lecun"  # see alma_jax.models.inits

  @classmethod
  def from_config(cls, model_config, num_classes: int) -> "ResNet":
    impl = conv.resolve_impl(F.get(model_config, "model.conv_impl"), model_config.width)
    return cls(width=model_config.width, num_classes=num_classes, conv_impl=impl,
               init_scheme=inits.check(F.get(model_config, "model.init")))

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False, mask=None) -> jnp.ndarray:
    del mask  # statistics over the whole batch, as in vgg.ConvBlock
    x = conv.Conv3x3(self.width, impl=self.conv_impl,
                     kernel_init=inits.kernel_init(self.init_scheme), name="stem")(x)
    x = nn.relu(batch_norm(train, "stem_bn")(x))
    for s, blocks in enumerate(self.stages):
      for b in range(blocks):
        stride = 2 if s > 0 and b == 0 else 1
        x = BasicBlock(self.width * 2**s, stride, self.conv_impl, self.init_scheme,
                       name=f"stage{s}_block{b}")(x, train)
    x = x.mean(axis=(1, 2))
    return inits.dense(self.num_classes, self.init_scheme, x.shape[-1], "head")(x)


SPEC = registry.BackboneSpec("resnet", ResNet.from_config, conv_heavy=True)
