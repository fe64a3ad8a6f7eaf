"""glibc's allocator settings for a run's process (`train.cpu_allocator`).

XLA:CPU frees and re-allocates large temporary buffers on every step. With
glibc's default settings each of those goes through mmap/munmap, and the
worker threads spend a large part of a core on page faults (about 29,000 per
step for the VGG at width 16). Asking glibc to keep freed memory inside the
process, in one arena, removes them (`SETTINGS`). The cost is that the
process keeps its peak working set instead of returning memory to the OS
between steps, and that every thread allocates from one arena under one
lock.

That lock is what compilation and small steps pay for: XLA's compiler and
the step's executor allocate many small blocks from both cores at once.
Measured with jax 0.10.2 on a 2-core Intel Xeon (benchmarks/README.md, "The
allocator"), the settings made P1 (VGG, CIFAR-10) train 1.6x faster and
every program compile about 1.6x slower: without them the MLP runs (P3, P4,
Firefly's growth) on a cold cache took 14-27% less time, their warm runs no
more. So `auto` (the default) tunes the allocator for a convolution-heavy
backbone on a CPU and leaves glibc's defaults otherwise; `tuned` and `glibc`
force either; `ALMA_JAX_MALLOC_TUNING=0` in the environment means `glibc`
whatever the config says.

`apply()` must run before JAX starts its backend (its thread pool's first
allocations decide their arenas); `alma_jax.tuning.tune.process_flags` calls it
when the choice says `tuned`. It is a no-op on non-glibc systems.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's mallopt parameter numbers (malloc.h) and the values that helped.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
SETTINGS = (
    (_M_ARENA_MAX, 1),  # one arena: freed blocks are found again by every thread
    (_M_MMAP_MAX, 0),  # never serve large blocks by mmap (so never munmap them)
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap top back to the OS
    (_M_TOP_PAD, 256 << 20),  # grow the heap in 256 MiB steps
)

FIELD = "train.cpu_allocator"
CHOICES = ("auto", "tuned", "glibc")
ENV = "ALMA_JAX_MALLOC_TUNING"

_applied: bool | None = None


def check_env() -> None:
  """Raises ValueError for an ALMA_JAX_MALLOC_TUNING that is neither 0 nor 1."""
  value = os.environ.get(ENV, "")
  if value not in ("", "0", "1"):
    raise ValueError(f"{ENV}={value!r} in the environment: allowed values '0' (glibc's "
                     f"defaults, whatever {FIELD} says) and '1' or unset (as {FIELD} says)")


def choose(setting: str, *, conv_heavy: bool, accelerator: bool) -> tuple[str, str]:
  """(`tuned` or `glibc`, how it was decided) for the config's `train.cpu_allocator`
  `setting`, a run whose backbone is (or not) convolution-heavy, on an accelerator or not."""
  if setting not in CHOICES:
    raise ValueError(f"config.{FIELD}={setting!r}; allowed: {', '.join(CHOICES)}")
  if os.environ.get(ENV, "1") == "0":
    return "glibc", f"({ENV}=0 in the environment)"
  if setting != "auto":
    return setting, "set in the config"
  if accelerator:
    return "glibc", "by rule (an accelerator backend: the settings are for XLA:CPU's buffers)"
  if conv_heavy:
    return "tuned", "by rule (a convolution-heavy backbone on a CPU)"
  return "glibc", "by rule (a backbone that is not convolution-heavy: compiles faster)"


def apply() -> bool:
  """Tunes glibc's allocator for XLA:CPU; returns whether it took effect."""
  global _applied
  if _applied is not None:
    return _applied
  _applied = False
  if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS)
  return _applied


def is_applied() -> bool:
  return bool(_applied)
