"""PRNG keys, folds and permutations of `jax.random` computed on the host: the same bits,
no compiled program.

A run derives its keys eagerly, outside its programs: the seeds' root keys, a fold of a
key per stage, member, policy and growth, and Firefly's order of the examples it fits its
candidates on. Each of those JAX operations is a small program of its own (the seeds' keys
once per set of seeds, the fold once per process, a permutation once per number of
examples): a compile and, on an accelerator, a load, for a few integers. Here they are the
same integer arithmetic in numpy:

- `jax.random.key(seed)`'s data is the seed's two 32-bit words (the high one 0 for the
  seeds a config takes, 0 .. 2^32-1);
- `jax.random.fold_in(key, i)` is the Threefry-2x32 hash (20 rounds; Salmon et al., "Parallel
  random numbers: as easy as 1, 2, 3", SC 2011) of the counter (0, i) under the key;
- with `jax_threefry_partitionable` (JAX's default), a split's key j and a draw's element j
  hash the counter (0, j), a draw's 32 bits being the two hashed words' xor;
- `jax.random.permutation(key, n)` sorts 0..n-1 stably by fresh random words in as many
  rounds as `ceil(3 ln n / ln(2^32 - 1))` (one up to n = 1625), each round splitting its key
  in two and drawing the words from the second.

Where they cannot answer on the host (a traced key, one that is not fully addressable,
another key implementation, the non-partitionable Threefry for a permutation's splits and
draws), `fold_in` folds with `jax.random` and the others return None for the caller to use
its program; tests/runtime/test_host_random.py checks every answer against `jax.random`.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

try:  # `jax.extend` may rename this between releases: then JAX makes every key
  from jax.extend.random import threefry_prng_impl as _THREEFRY
except ImportError:  # pragma: no cover (a JAX other than the pinned one)
  _THREEFRY = None

# Threefry-2x32's rotation distances: the first four rounds of every eight, then the next four.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # the key schedule's third word is k0 ^ k1 ^ this constant
_U32 = np.uint32


def _rotate_left(x: np.ndarray, r: int) -> np.ndarray:
  return (x << _U32(r)) | (x >> _U32(32 - r))


def threefry2x32(k0, k1, x0, x1) -> tuple[np.ndarray, np.ndarray]:
  """The Threefry-2x32 hash (20 rounds) of the counters (x0, x1) under the keys (k0, k1),
  element by element (numpy uint32 arrays, broadcast together)."""
  k0, k1, x0, x1 = np.broadcast_arrays(*(np.asarray(a, _U32) for a in (k0, k1, x0, x1)))
  keys = (k0, k1, k0 ^ k1 ^ _U32(_PARITY))
  with np.errstate(over="ignore"):  # additions modulo 2^32 (numpy warns of 0-d ones)
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for block in range(5):  # five blocks of four rounds, the key injected after each
      for r in _ROTATIONS[block % 2]:
        x0 = x0 + x1
        x1 = _rotate_left(x1, r) ^ x0
      x0 = x0 + keys[(block + 1) % 3]
      x1 = x1 + keys[(block + 2) % 3] + _U32(block + 1)
  return np.asarray(x0, _U32), np.asarray(x1, _U32)


def _host_data(key) -> np.ndarray | None:
  """The data (2,) of a single concrete Threefry key held by this process, else None."""
  if isinstance(key, jax.core.Tracer) or not isinstance(key, jax.Array) or key.shape:
    return None
  if _THREEFRY is None or getattr(key.dtype, "_impl", None) is not _THREEFRY:
    return None  # another implementation, or raw key data (uint32) rather than a typed key
  if not key.is_fully_addressable:
    return None
  return np.asarray(jax.random.key_data(key), _U32)


def _wrap(data: np.ndarray) -> jax.Array:
  return jax.random.wrap_key_data(np.ascontiguousarray(data, _U32), impl="threefry2x32")


def seed_keys(seeds: Sequence[int]) -> jax.Array | None:
  """`jax.random.key(s)` for every seed, stacked (seeds 0 .. 2^32-1, JAX's default Threefry
  keys); None where JAX would make other keys."""
  seeds = [int(s) for s in seeds]
  if (_THREEFRY is None or not seeds
      or getattr(jax.config, "jax_default_prng_impl", None) != "threefry2x32"
      or not all(0 <= s < 2 ** 32 for s in seeds)):
    return None
  return _wrap(np.array([[0, s] for s in seeds], _U32))


def fold_in(key: jax.Array, i: int) -> jax.Array:
  """`jax.random.fold_in(key, i)` of a single key (0 <= i < 2^32: `i` is converted to uint32,
  as JAX converts it)."""
  i = np.asarray(i, _U32)
  data = _host_data(key)
  if data is None:
    return jax.random.fold_in(key, i)  # where every fold shares one program
  y0, y1 = threefry2x32(data[0], data[1], 0, i)
  return _wrap(np.stack([y0, y1]))


def _hash_indices(data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
  """The hashed words of the counters 0 .. n-1 under a single key's data: a split's keys
  (the two words of each) and a draw's 32-bit words (their xor), partitionable Threefry."""
  return threefry2x32(data[0], data[1], 0, np.arange(n, dtype=_U32))


def permutation(key: jax.Array, n: int) -> np.ndarray | None:
  """`jax.random.permutation(key, n)` of a single key, as a numpy int32 array; None where it
  cannot be made on the host (the caller then draws it with JAX)."""
  data = _host_data(key)
  if data is None or not jax.config.jax_threefry_partitionable or not 0 <= n < 2 ** 31:
    return None
  order = np.arange(n, dtype=np.int32)
  rounds = math.ceil(3 * math.log(max(1, n)) / math.log(2 ** 32 - 1))
  for _ in range(rounds):
    data, sub = np.stack(_hash_indices(data, 2), axis=-1)  # the key split in two
    words = np.bitwise_xor(*_hash_indices(sub, n))  # the second key's draw of n words
    order = order[np.argsort(words, kind="stable")]
  return order
