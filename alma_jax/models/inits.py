"""Parameter initialisation schemes, picked by `config.model.init`.

* "lecun": Flax's defaults. Dense and convolution kernels are LeCun-normal
  (a normal truncated at two standard deviations, variance 1/fan_in), biases
  are zero.
* "torch": PyTorch's defaults for `nn.Linear` and `nn.Conv2d`, which the
  released code of the paper uses. Kernels are `kaiming_uniform_(a=sqrt(5))`,
  i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)); biases are U(-1/sqrt(fan_in),
  1/sqrt(fan_in)) too.

fan_in is the number of inputs of one output unit: the input features of a
dense layer, 9 * C_in for a 3x3 convolution. BatchNorm starts at scale 1 and
bias 0 under both schemes (Flax's and PyTorch's defaults agree).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

INITS = ("lecun", "torch")


def check(scheme: str) -> str:
  if scheme not in INITS:
    raise ValueError(f"config.model.init={scheme!r} is unknown; valid values: {list(INITS)}")
  return scheme


def kernel_init(scheme: str) -> nn.initializers.Initializer:
  """The kernel initialiser of dense layers and convolutions (kernels with inputs on axis -2
  and outputs on axis -1, any leading axes being the receptive field)."""
  if check(scheme) == "lecun":
    return nn.initializers.lecun_normal()
  # variance_scaling(s, "fan_in", "uniform") draws U(-sqrt(3 s / fan_in), +sqrt(3 s / fan_in)):
  # s = 1/3 gives PyTorch's bound 1/sqrt(fan_in).
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int) -> nn.initializers.Initializer:
  """U(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's bias initialisation."""
  bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def dense_kwargs(scheme: str, fan_in: int) -> dict:
  """Initialiser arguments of an `nn.Dense` with `fan_in` inputs ({} for "lecun": Flax's
  defaults, so its parameters are exactly those of a plain `nn.Dense`)."""
  if check(scheme) == "lecun":
    return {}
  return {"kernel_init": kernel_init(scheme), "bias_init": torch_bias_init(fan_in)}


def dense(features: int, scheme: str, fan_in: int, name: str) -> nn.Dense:
  """`nn.Dense(features, name=name)` initialised by `scheme`; call it inside a compact
  `__call__` so that its parameters keep their path (and their random keys)."""
  return nn.Dense(features, name=name, **dense_kwargs(scheme, fan_in))


def linear_params(key: jax.Array, features: int, outputs: int, scheme: str,
                  dtype=jnp.float32) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(kernel (features, outputs), bias (outputs,)) of a linear map outside a Flax module.

  "lecun" draws the kernel from `key` itself and a zero bias; "torch" splits
  `key` into a kernel key and a bias key.
  """
  if check(scheme) == "lecun":
    return kernel_init(scheme)(key, (features, outputs), dtype), jnp.zeros((outputs,), dtype)
  k_kernel, k_bias = jax.random.split(key)
  return (kernel_init(scheme)(k_kernel, (features, outputs), dtype),
          torch_bias_init(features)(k_bias, (outputs,), dtype))
