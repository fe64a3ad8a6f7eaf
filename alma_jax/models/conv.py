"""3x3 'SAME' convolutions with a choice of gradient implementation.

`impl="xla"` is `lax.conv_general_dilated` with autodiff: XLA's own kernels
for the forward pass and both gradients.

`impl="chunked_dw"` keeps XLA's forward pass and input gradient but computes
the weight gradient as a sum of convolutions over chunks of the batch. On
XLA:CPU the weight-gradient convolution of a whole batch is the slowest part
of a training step (2.5-3.5x slower than the forward pass at width 64);
chunks of 16 images run it about 2.3x faster. Same numbers to float
round-off (the chunk sums are added in a different order).

`impl="native_dw"` keeps XLA's forward pass and input gradient and computes
the weight gradient with the package's native XLA:CPU kernel
(`alma_jax.kernels.native`, built on first use with the machine's C++
compiler): on a 2-core AMD EPYC (family 26, model 2) 3.9x faster than XLA's
for the 32x32 16 -> 16 layer of the VGG at width 16 (`benchmarks/conv_parts.py`;
benchmarks/README.md, "Native convolutions"). `impl="native"` computes the forward pass and
the input gradient (the forward convolution of the output gradient with the
kernel flipped and transposed) with the package's kernel too. CPU only; same
numbers to float round-off (the products are summed in another order).

`resolve_impl("auto", ...)` picks per backend and width, by the measurements
in `benchmarks/train_speed.py`; a run that measures its speed choices on a
CPU times every implementation of `candidates()` instead.

Inside `as_xla()` every implementation traces as XLA's convolution: the FLOP
count (`alma_jax.engine.accounting`) sees the learner's convolutions, not how a
run computes them (the native kernels are custom calls, invisible to a count;
`chunked_dw`'s gradient computes more than autodiff's), whichever method or
backbone holds them.
"""

from __future__ import annotations

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging
from jax import lax

from alma_jax.kernels import native
from alma_jax.models import inference

IMPLS = ("auto", "xla", "chunked_dw", "native_dw", "native")
NATIVE = ("native_dw", "native")  # the implementations that run the package's kernels
DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")
DW_CHUNK = 16  # images per weight-gradient chunk
CHUNKED_MIN_WIDTH = 32  # "auto" on CPU: chunked_dw from this width up
# Inside `as_xla()` (a context flag, as `alma_jax.models.inference.evaluation` is).
_AS_XLA = contextvars.ContextVar("alma_jax_convolutions_as_xla", default=False)


def resolve_impl(impl: str, width: int, backend: str | None = None) -> str:
  """The implementation to use; "auto" chooses by backend and width."""
  if impl not in IMPLS:
    raise ValueError(f"config.model.conv_impl={impl!r} is not valid; valid values: {list(IMPLS)}")
  if impl in NATIVE:
    native.register(backend)  # before a kept program that calls the kernel is loaded, too
  if impl != "auto":
    return impl
  backend = backend or jax.default_backend()
  # On CPU (glibc allocator tuned, jax 0.10.2) the chunked weight gradient
  # wins from width 32 up (whole step 1.33x at C=32, 1.25-1.3x at C=64) and
  # loses below (0.78x at C=16, 0.77x at C=4); benchmarks/train_speed.py. On
  # accelerators XLA's kernels are the ones to use.
  # The rule leaves the native kernels to measurement: it needs a C++ compiler and changes the
  # float round-off of the records that runs by rule (the `:smoke` variants) keep.
  return "chunked_dw" if backend == "cpu" and width >= CHUNKED_MIN_WIDTH else "xla"


def candidates(backend: str | None = None) -> tuple[str, ...]:
  """The implementations a run measures (`model.conv_impl=auto` with measured choices) on
  `backend` (None: this process's): the native ones where their kernels build and run
  (XLA:CPU; the reason they do not is logged)."""
  ok, why = native.available(backend)
  if not ok:
    logging.info("model.conv_impl=%s are left out of the candidates: %s", "/".join(NATIVE), why)
  return tuple(i for i in IMPLS if i != "auto" and (i not in NATIVE or ok))


def _conv(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  return lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=DIMENSION_NUMBERS)


@jax.custom_vjp
def conv_chunked_dw(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """A 3x3 SAME convolution whose weight gradient is summed over batch chunks."""
  return _conv(x, kernel)


def _fwd(x, kernel):
  return _conv(x, kernel), (x, kernel)


def _input_grad(x, kernel, g):
  """XLA's input gradient: the transpose of the convolution, linear in x, so no forward pass
  is traced (the program holds no work for XLA to discard)."""
  (dx,) = jax.linear_transpose(lambda x_: _conv(x_, kernel), x)(g)
  return dx


def _bwd(res, g):
  # The weight gradient likewise, as the transpose in the kernel, chunk by chunk.
  x, kernel = res
  dx = _input_grad(x, kernel, g)
  n = x.shape[0]
  chunk = DW_CHUNK if n % DW_CHUNK == 0 and n > DW_CHUNK else n
  dw = None
  for s in range(0, n, chunk):
    xs = x[s:s + chunk]
    (part,) = jax.linear_transpose(lambda k, xs=xs: _conv(xs, k), kernel)(g[s:s + chunk])
    dw = part if dw is None else dw + part
  return dx, dw


conv_chunked_dw.defvjp(_fwd, _bwd)


@jax.custom_vjp
def conv_native_dw(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """A 3x3 SAME convolution whose weight gradient is the native XLA:CPU kernel's."""
  return _conv(x, kernel)


def _native_bwd(res, g):
  x, kernel = res
  return _input_grad(x, kernel, g), native.conv3x3_wgrad(x, g).astype(kernel.dtype)


conv_native_dw.defvjp(_fwd, _native_bwd)


@jax.custom_vjp
def conv_native(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """A 3x3 SAME convolution whose forward pass and both gradients are the native XLA:CPU
  kernels'."""
  return native.conv3x3_forward(x, kernel)


def _native_fwd(x, kernel):
  return native.conv3x3_forward(x, kernel), (x, kernel)


def _native_all_bwd(res, g):
  x, kernel = res
  return (native.conv3x3_input_grad(g, kernel).astype(x.dtype),
          native.conv3x3_wgrad(x, g).astype(kernel.dtype))


conv_native.defvjp(_native_fwd, _native_all_bwd)

_BY_IMPL = {"xla": _conv, "chunked_dw": conv_chunked_dw, "native_dw": conv_native_dw,
            "native": conv_native}


def as_xla() -> contextlib.AbstractContextManager[None]:
  """A block whose traces compute every `conv3x3` as XLA's convolution with autodiff,
  whatever its `impl`: what a FLOP count traces."""
  return inference.raised(_AS_XLA)


def conv3x3(x: jnp.ndarray, kernel: jnp.ndarray, impl: str = "xla") -> jnp.ndarray:
  """A 3x3 'SAME' convolution, stride 1, NHWC input and HWIO kernel (XLA's inside
  `as_xla()`)."""
  if impl not in _BY_IMPL:
    raise ValueError(f"conv impl {impl!r} is not valid here; valid values: {list(_BY_IMPL)} "
                     "(resolve 'auto' first)")
  return _conv(x, kernel) if _AS_XLA.get() else _BY_IMPL[impl](x, kernel)


class Conv3x3(nn.Module):
  """Drop-in for `nn.Conv(features, (3, 3), padding="SAME", use_bias=False)`.

  Same parameter name, shape and initialiser, so parameter trees and
  checkpoints do not depend on the implementation.
  """

  features: int
  impl: str = "xla"
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    kernel = self.param("kernel", self.kernel_init, (3, 3, x.shape[-1], self.features))
    return conv3x3(x, kernel.astype(x.dtype), self.impl)

