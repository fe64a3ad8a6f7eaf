"""Growable stacked axes held in capacity slots: ensemble members, experts, neurons.

A growing model whose parts are stacked on one axis (gEns's members on the
leading axis of every leaf, gMoE's experts on the leading axis of a layer's
leaves, Firefly's channels on the last axis of a layer's leaves) holds that
axis in C >= n slots, of which the first n are active. Growth inside the
slots writes values and the activity mask (the same shapes, hence the same
compiled programs); a growth past C moves to the next capacity.

The conventions every growing method follows:

- `capacity(n, policy, maximum)`: the slots of n parts, by `policy`: "pow2"
  (the next power of two: one compiled structure per power of two), "max"
  (`maximum` slots from the start: one structure) or "exact" (n: no padding,
  one structure per growth).
- A method's `program_structure` maps a structure to its capacities, so
  every structure inside the same slots shares the programs; its
  `active_view` cuts the learner to its n active parts as shapes
  (`cut_shapes`), and Mem (`count_params`) and every FLOP count are taken on
  that view, so they do not depend on the slots.
- Padding slots are copies of slot 0 (`resize`), never read by a prediction
  and never given a gradient; `mask` builds the activity mask.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.configuration.plugins import methods as declared_methods

PyTree = Any
POLICIES = declared_methods.SLOT_POLICIES


def next_power_of_two(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(int(n) - 1, 0).bit_length()


def capacity(n: int, policy: str = "pow2", maximum: int = 0) -> int:
  """The slots of an axis with `n` active parts under `policy` (see the module docstring);
  "max" holds max(maximum, n) slots, so a part past the maximum still fits."""
  if policy == "exact":
    return int(n)
  if policy == "max":
    return max(int(maximum), int(n))
  if policy == "pow2":
    return next_power_of_two(n)
  raise ValueError(f"slot policy {policy!r} is unknown; valid values: {list(POLICIES)}")


def mask(n: int, slots: int) -> np.ndarray:
  """(slots,) bool: the first `n` slots are active."""
  return np.arange(slots) < n


def count_params(tree: PyTree) -> int:
  """The number of entries of every leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s): Mem
  of a learner's `active_view`."""
  return int(sum(np.prod(a.shape) for a in jax.tree.leaves(tree)))


# -- the leading axis ---------------------------------------------------------------------------
def leading_size(tree: PyTree) -> int:
  """The size of the leading (slot) axis shared by all leaves of `tree`."""
  sizes = {a.shape[0] for a in jax.tree.leaves(tree)}
  if len(sizes) != 1:
    raise ValueError(f"the leaves of a stacked tree must share their leading axis; got "
                     f"{sorted(sizes)}")
  return sizes.pop()


def stack(trees: Sequence[PyTree]) -> PyTree:
  """[tree_0, ..., tree_{n-1}] (same structure) -> one tree with a leading axis n."""
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def index(tree: PyTree, i: int) -> PyTree:
  """Slot `i` of every leaf of a stacked tree."""
  return jax.tree.map(lambda a: a[i], tree)


def resize(tree: PyTree, slots: int) -> PyTree:
  """Every leaf of `tree` with its leading axis cut or padded to `slots` (padding repeats
  slot 0, so it holds finite values of the right kind)."""
  def one(a):
    n = a.shape[0]
    if slots <= n:
      return a[:slots]
    return jnp.concatenate([a, jnp.repeat(a[:1], slots - n, axis=0)], axis=0)
  return jax.tree.map(one, tree)


def cut_shapes(tree: PyTree, n: int) -> PyTree:
  """`tree`'s leaves as `jax.ShapeDtypeStruct`s with their leading axis cut to `n`: an
  active view without computing anything."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + tuple(a.shape[1:]), a.dtype), tree)


def is_traced(tree: PyTree) -> bool:
  """Whether any leaf of `tree` is a tracer (inside a transformation)."""
  return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(tree))


# Slot indices are arguments of the jitted edits: one program per shapes, whichever slots
# are edited.
@jax.jit
def _copy(tree: PyTree, dst, src) -> PyTree:
  def one(a):
    return jax.lax.dynamic_update_index_in_dim(a, jax.lax.dynamic_index_in_dim(a, src, 0), dst,
                                               0)
  return jax.tree.map(one, tree)


def _slot_index(i):
  """A slot index as a program argument: an int as int32, an array (or a tracer, inside a
  transformation) as it is."""
  return i if isinstance(i, jax.Array) else np.int32(i)


def copy_slot(tree: PyTree, dst, src) -> PyTree:
  """Every stacked leaf of `tree` with slot `dst` set to a copy of slot `src`."""
  return _copy(tree, _slot_index(dst), _slot_index(src))


@jax.jit
def _set(a, value, i):
  return jax.lax.dynamic_update_index_in_dim(a, value.astype(a.dtype)[None], i, 0)


def set_slot(a, value, i):
  """Array `a` with slot `i` of its leading axis set to `value`."""
  return _set(a, value, _slot_index(i))


@jax.jit
def _put(tree: PyTree, new: PyTree, start) -> PyTree:
  return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype),
                                                                       start, 0), tree, new)


def put(tree: PyTree, new: PyTree, start) -> PyTree:
  """`tree` with slots [start, start + k) set to the k stacked slots of `new`."""
  if is_traced((tree, new, start)):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, start, 0),
                        tree, new)
  return _put(tree, new, np.int32(start))


@functools.partial(jax.jit, static_argnums=2)
def _take(tree: PyTree, start, k: int) -> PyTree:
  return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, k), tree)


def take(tree: PyTree, start, k: int) -> PyTree:
  """Slots [start, start + k) of a stacked tree (one program per shapes)."""
  if is_traced((tree, start)):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, k), tree)
  return _take(tree, np.int32(start), k)
