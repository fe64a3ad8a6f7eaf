"""Process-level settings that make XLA:CPU training faster.

XLA:CPU frees and re-allocates large temporary buffers on every step. With
glibc's default settings each of those goes through mmap/munmap, and the
worker threads spend a large part of a core on page faults (about 29,000 per
step for the VGG at width 16). Asking glibc to keep freed memory inside the
process removes them: measured 1.65x faster CIFAR training on a 2-core CPU.
The cost is that the process keeps its peak working set instead of returning
memory to the OS between steps.

`apply()` must run before JAX allocates anything (ideally before importing
it); `alma_jax.main` calls it first thing. It is a no-op on non-glibc systems
and when ALMA_JAX_MALLOC_TUNING=0.
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

_applied: bool | None = None


def apply() -> bool:
  """Tunes glibc's allocator for XLA:CPU; returns whether it took effect."""
  global _applied
  if _applied is not None:
    return _applied
  _applied = False
  if os.environ.get("ALMA_JAX_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
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
