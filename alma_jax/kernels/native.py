"""The package's native XLA:CPU kernels, built on first use with the machine's C++ compiler.

XLA:CPU computes a narrow convolution's weight gradient (width 16 on 32x32
images) two to three times slower than its forward pass, and its forward
pass and input gradient spend much of their time copying image patches.
`conv3x3_forward` and `conv3x3_wgrad` are a 3x3 convolution and its weight
gradient as XLA FFI custom calls (conv3x3.cc), used by the convolution
implementations `model.conv_impl="native"` (all three passes) and
`"native_dw"` (the weight gradient; `alma_jax.models.conv`).

The source is compiled once per machine into the cache folder
(`<cache>/kernels`, `alma_jax.runtime.caches`), with `-march=native`, under a
name that hashes the source, the compiler's version, the flags, jaxlib's
version and the host's CPU (`alma_jax.runtime.host.cpu_name`), so a shared
home folder never hands one CPU another's binary. The compiler is $CXX, else
g++, else c++, else clang++. Where none works `available()` says why, and
`model.conv_impl=auto` leaves the implementation out of its candidates.
A compiled program that calls the kernel is kept in the persistent
compilation cache by the kernel's name: `register()` must run in a process
before such a program is loaded (`alma_jax.models.conv.resolve_impl` does it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import threading

import jax
import jax.numpy as jnp
from absl import logging

from alma_jax.runtime import caches
from alma_jax.runtime import host

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conv3x3.cc")
# {name in XLA's custom-call registry: the handler that the source exports}
TARGETS = {"alma_conv3x3_forward": "AlmaConv3x3Forward", "alma_conv3x3_wgrad": "AlmaConv3x3Wgrad"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 300


class NativeUnavailable(RuntimeError):
  """The native kernels cannot be built or loaded on this machine."""

  plain_message = True  # the message says all (alma_jax.errors)


def compiler() -> str | None:
  """The C++ compiler to build with: $CXX, else the first of g++, c++, clang++ on the PATH."""
  if os.environ.get("CXX"):
    return os.environ["CXX"]
  return next((path for path in map(shutil.which, ("g++", "c++", "clang++")) if path), None)


def kernels_dir() -> str:
  return os.path.join(caches.default_cache_dir(), "kernels")


_lock = threading.Lock()
_registered: list[bool] = []


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
  """(the loaded library, "") or (None, why it is not available)."""
  cxx = compiler()
  if cxx is None:
    return None, "no C++ compiler found ($CXX, g++, c++, clang++)"
  try:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60,
                             check=True).stdout.splitlines()[0]
  except (OSError, subprocess.SubprocessError, IndexError) as e:
    return None, f"the C++ compiler {cxx} does not run ({e})"
  include = jax.ffi.include_dir()
  with open(SOURCE, "rb") as f:
    source = f.read()
  digest = hashlib.sha256(b"\0".join(
      [source, version.encode(), " ".join(FLAGS).encode(), jax.lib.__version__.encode(),
       host.cpu_name().encode()])).hexdigest()[:16]
  path = os.path.join(kernels_dir(), f"conv3x3-{digest}.so")
  if not os.path.exists(path):
    os.makedirs(kernels_dir(), exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    cmd = [cxx, *FLAGS, f"-I{include}", SOURCE, "-o", partial]
    logging.info("building the native CPU kernels: %s", " ".join(cmd))
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
      return None, f"{cxx} could not build {SOURCE} ({e})"
    if proc.returncode:
      return None, f"{cxx} could not build {SOURCE}: {proc.stderr.strip()[-2000:]}"
    os.replace(partial, path)  # another process building the same file writes the same bytes
  try:
    return ctypes.CDLL(path), ""
  except OSError as e:
    return None, f"{path} does not load ({e})"


def available(backend: str | None = None) -> tuple[bool, str]:
  """(whether the native kernels can run on `backend` (None: this process's, which starts
  JAX's backend), why not). Builds them the first time on a machine (a few seconds)."""
  backend = backend or jax.default_backend()
  if backend != "cpu":
    return False, f"they run on XLA:CPU only (the backend here: {backend})"
  lib, why = _library()
  return lib is not None, why


def register(backend: str | None = None) -> None:
  """Registers the kernels with XLA:CPU (once per process); NativeUnavailable says why they
  cannot run on `backend` (None: this process's)."""
  with _lock:
    if _registered and (backend or "cpu") == "cpu":
      return
    ok, why = available(backend)
    if not ok:
      raise NativeUnavailable(f"model.conv_impl='native' and 'native_dw' cannot run here: "
                              f"{why}; valid values elsewhere: 'xla', 'chunked_dw' (or 'auto')")
    if _registered:
      return
    lib, _ = _library()
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
    _registered.append(True)


def _as_f32(*arrays):
  return tuple(a.astype(jnp.float32) for a in arrays)


def conv3x3_forward(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """A 3x3 'SAME' convolution, stride 1: NHWC `x` (N, H, W, CI), HWIO `kernel` (3, 3, CI,
  CO), in float32 (other dtypes are computed in float32 and returned in `x`'s dtype)."""
  register()
  if x.ndim != 4 or kernel.shape[:2] != (3, 3) or kernel.shape[2] != x.shape[-1]:
    raise ValueError(f"conv3x3_forward: x {x.shape} and kernel {kernel.shape} must be "
                     "(N, H, W, CI) and (3, 3, CI, CO)")
  out = jax.ShapeDtypeStruct(x.shape[:3] + kernel.shape[-1:], jnp.float32)
  y = jax.ffi.ffi_call("alma_conv3x3_forward", out, vmap_method="sequential")(
      *_as_f32(x, kernel))
  return y.astype(x.dtype)


def conv3x3_input_grad(dy: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """The input gradient of `conv3x3_forward` for the output gradient `dy` (N, H, W, CO): the
  forward convolution of `dy` with the kernel flipped in space and its channels swapped."""
  return conv3x3_forward(dy, jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2))


def conv3x3_wgrad(x: jnp.ndarray, dy: jnp.ndarray) -> jnp.ndarray:
  """The (3, 3, CI, CO) weight gradient of a 3x3 'SAME' convolution (stride 1) with NHWC
  input `x` (N, H, W, CI) and output gradient `dy` (N, H, W, CO), in float32 (other dtypes
  are computed in float32 and returned in `x`'s dtype). Under `jax.vmap` it runs once per
  mapped element."""
  register()
  if x.ndim != 4 or dy.ndim != 4 or x.shape[:3] != dy.shape[:3]:
    raise ValueError(f"conv3x3_wgrad: x {x.shape} and dy {dy.shape} must be (N, H, W, CI) and "
                     "(N, H, W, CO)")
  out = jax.ShapeDtypeStruct((3, 3, x.shape[-1], dy.shape[-1]), jnp.float32)
  dw = jax.ffi.ffi_call("alma_conv3x3_wgrad", out, vmap_method="sequential")(*_as_f32(x, dy))
  return dw.astype(x.dtype)
