"""The native XLA:CPU 3x3 convolution and its gradients (alma_jax/kernels/native.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax.kernels import native
from alma_jax.models import conv

U = 2.0**-24  # float32's unit round-off


def _exact_forward(x, k):
  """The convolution in float64, and the sum of its products' magnitudes."""
  x, k = np.asarray(x, np.float64), np.asarray(k, np.float64)
  n, h, w, _ = x.shape
  xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  y = sum(np.einsum("nhwi,io->nhwo", xp[:, i:i + h, j:j + w], k[i, j])
          for i in range(3) for j in range(3))
  mag = sum(np.einsum("nhwi,io->nhwo", abs(xp[:, i:i + h, j:j + w]), abs(k[i, j]))
            for i in range(3) for j in range(3))
  return y, mag


def _gamma(k):
  return k * U / (1 - k * U)


def _exact(x, g):
  """The weight gradient in float64, and the sum of its products' magnitudes."""
  x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
  n, h, w, _ = x.shape
  xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  taps = [[xp[:, i:i + h, j:j + w] for j in range(3)] for i in range(3)]
  dw = np.stack([np.stack([np.einsum("nhwi,nhwo->io", t, g) for t in row]) for row in taps])
  mag = np.stack([np.stack([np.einsum("nhwi,nhwo->io", abs(t), abs(g)) for t in row])
                  for row in taps])
  return dw, mag


# (N, H, W, CI, CO): a first layer's 3 channels; channel counts that are not multiples of the
# kernel's blocks (input channels in blocks of up to 16, output channels in vectors of 16, 8, 4
# and 1); a 1x1 image (the centre tap alone); enough work for 2 and for 8 blocks of images.
SHAPES = [(2, 5, 7, 3, 16), (3, 6, 5, 21, 29), (2, 1, 1, 2, 3), (16, 16, 16, 16, 16),
          (32, 32, 32, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_weight_gradient_is_the_exact_one_to_its_round_off(shape):
  """Each element sums K = N H W products (fewer at the borders), in some order: the float32
  result is within gamma_K = K u / (1 - K u) times the sum of their magnitudes of the exact
  one (Higham, Accuracy and Stability, 3.1; a fused multiply-add only rounds less)."""
  n, h, w, ci, co = shape
  kx, kg = jax.random.split(jax.random.key(sum(shape)))
  x = jax.random.normal(kx, (n, h, w, ci))
  g = jax.random.normal(kg, (n, h, w, co))
  got = np.asarray(jax.jit(native.conv3x3_wgrad)(x, g))
  exact, mag = _exact(x, g)
  k = n * h * w
  assert got.shape == (3, 3, ci, co) and got.dtype == np.float32
  assert np.all(np.abs(got - exact) <= k * U / (1 - k * U) * mag)
  # A tap that reads nothing (a 1x1 image's off-centre taps) is exactly zero.
  assert np.all(got[mag == 0] == 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_convolution_and_its_input_gradient_are_exact_to_their_round_off(shape):
  """Each output element sums 9 CI products (fewer at the borders): within gamma_{9 CI} times
  the sum of their magnitudes of the exact one; the input gradient is the convolution of dy
  with the kernel flipped and transposed, 9 CO products, checked against its definition (the
  transpose of the convolution: <conv(x, k), dy> = <x, dx> exactly, in float64)."""
  n, h, w, ci, co = shape
  kx, kk, kg = jax.random.split(jax.random.key(sum(shape) + 1), 3)
  x = jax.random.normal(kx, (n, h, w, ci))
  k = jax.random.normal(kk, (3, 3, ci, co))
  g = jax.random.normal(kg, (n, h, w, co))
  y = np.asarray(jax.jit(native.conv3x3_forward)(x, k))
  exact, mag = _exact_forward(x, k)
  assert y.shape == (n, h, w, co) and y.dtype == np.float32
  assert np.all(np.abs(y - exact) <= _gamma(9 * ci) * mag)
  dx = np.asarray(jax.jit(native.conv3x3_input_grad)(g, k))
  # The exact input gradient; it is the transpose of the convolution (the last check).
  kt = np.flip(np.asarray(k, np.float64), (0, 1)).transpose(0, 1, 3, 2)
  exact_dx, mag_dx = _exact_forward(g, kt)
  assert dx.shape == (n, h, w, ci)
  assert np.all(np.abs(dx - exact_dx) <= _gamma(9 * co) * mag_dx)
  xs = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.vdot(exact, np.asarray(g, np.float64)), np.vdot(xs, exact_dx),
                             rtol=1e-12)


def test_the_result_is_the_same_from_call_to_call_and_under_vmap():
  # Blocks of images are summed in an order that does not depend on the threads.
  kx, kg = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (2, 32, 16, 16, 16))
  g = jax.random.normal(kg, (2, 32, 16, 16, 16))
  f = jax.jit(native.conv3x3_wgrad)
  first = [np.asarray(f(x[m], g[m])) for m in range(2)]
  for _ in range(3):
    for m in range(2):
      np.testing.assert_array_equal(np.asarray(f(x[m], g[m])), first[m])
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(native.conv3x3_wgrad))(x, g)),
                                np.stack(first))
  k = jax.random.normal(kx, (2, 3, 3, 16, 16))
  fwd = jax.jit(native.conv3x3_forward)
  ys = [np.asarray(fwd(x[m], k[m])) for m in range(2)]
  np.testing.assert_array_equal(np.asarray(fwd(x[0], k[0])), ys[0])
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(native.conv3x3_forward))(x, k)),
                                np.stack(ys))


def test_other_dtypes_are_computed_in_float32():
  x = jnp.ones((2, 4, 4, 3), jnp.bfloat16)
  g = jnp.ones((2, 4, 4, 5), jnp.bfloat16)
  got = native.conv3x3_wgrad(x, g)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got[1, 1], np.float32), 32.0)  # 2 x 4 x 4 ones
  np.testing.assert_array_equal(np.asarray(got[0, 0], np.float32), 18.0)  # 2 x 3 x 3
  with pytest.raises(ValueError, match=r"must be \(N, H, W, CI\) and \(N, H, W, CO\)"):
    native.conv3x3_wgrad(x, g[:, :3])
  y = native.conv3x3_forward(x, jnp.ones((3, 3, 3, 5), jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y[0, 1, 1], np.float32), 27.0)  # 9 taps x 3
  with pytest.raises(ValueError, match=r"must be \(N, H, W, CI\) and \(3, 3, CI, CO\)"):
    native.conv3x3_forward(x, jnp.ones((3, 3, 4, 5)))


def test_where_it_cannot_build_or_run_the_error_says_why_and_auto_leaves_it_out(monkeypatch):
  monkeypatch.setattr(native, "_registered", [])
  found = native.compiler
  monkeypatch.setattr(native, "compiler", lambda: None)
  native._library.cache_clear()
  try:
    assert native.available("cpu") == (False, "no C++ compiler found ($CXX, g++, c++, clang++)")
    assert conv.candidates("cpu") == ("xla", "chunked_dw")
    for impl in conv.NATIVE:
      with pytest.raises(native.NativeUnavailable,
                         match=r"model.conv_impl='native' and 'native_dw' cannot run here: no "
                               r"C\+\+ compiler.*'xla', 'chunked_dw'"):
        conv.resolve_impl(impl, 16, "cpu")
  finally:
    monkeypatch.setattr(native, "compiler", found)
    native._library.cache_clear()
  assert conv.candidates("cpu") == ("xla", "chunked_dw", "native_dw", "native")
  assert conv.candidates("gpu") == ("xla", "chunked_dw")
  with pytest.raises(native.NativeUnavailable, match=r"XLA:CPU only \(the backend here: gpu\)"):
    conv.resolve_impl("native_dw", 16, "gpu")
  assert conv.resolve_impl("native", 16, "cpu") == "native"


def test_the_kernel_is_built_once_per_machine_into_the_cache_folder(monkeypatch, tmp_path):
  monkeypatch.setenv("ALMA_JAX_CACHE_DIR", str(tmp_path))
  native._library.cache_clear()
  try:
    lib, why = native._library()
    assert lib is not None, why
    built = os.listdir(tmp_path / "kernels")
    assert len(built) == 1 and built[0].startswith("conv3x3-") and built[0].endswith(".so")
    native._library.cache_clear()
    monkeypatch.setattr(native.subprocess, "run", _no_compiler_run(native.subprocess.run))
    assert native._library()[0] is not None  # found, not built again
    assert os.listdir(tmp_path / "kernels") == built
  finally:
    native._library.cache_clear()


def _no_compiler_run(run):
  def guarded(cmd, *args, **kwargs):
    assert "-o" not in cmd, f"built again: {cmd}"
    return run(cmd, *args, **kwargs)
  return guarded
