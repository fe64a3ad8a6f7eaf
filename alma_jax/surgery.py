"""Surgery: pure growth edits of the learner pytree.

Every function here takes a `Learner` (stacked parameters, model state and
static structure) and returns a new one; inputs are never modified. Members
of an ensemble are stacked on the leading axis of every leaf of `params` and
`model_state`, so growing an ensemble concatenates on axis 0 and leaves the
existing slices bitwise unchanged.

  add_member: appends k ensemble members (fresh or copies of the last one).
  split_expert: turns one expert of a tree-gated mixture layer into a gate
    over the old expert and an exact copy (gMoE growth).

Optimizer state is not kept across growth: a method that grows raises a
`ConfigError` for `config.train.keep_optimizer_state=True`, so the trainer
builds a fresh optimizer state for the grown parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from alma_jax.methods.base import Learner
from alma_jax.models import moe

PyTree = Any
MEMBER_INITS = ("copy", "fresh")


def num_members(tree: PyTree) -> int:
  """The size of the leading (member) axis shared by all leaves of `tree`."""
  sizes = {a.shape[0] for a in jax.tree.leaves(tree)}
  if len(sizes) != 1:
    raise ValueError(f"the leaves of a stacked tree must share their leading axis; got {sorted(sizes)}")
  return sizes.pop()


def stack_members(members: list[PyTree]) -> PyTree:
  """[tree_0, ..., tree_{n-1}] (same structure) -> one tree with a leading axis n."""
  return jax.tree.map(lambda *a: jnp.stack(a), *members)


def _new_members(state: Learner, key: jax.Array, init: str, k: int,
                 init_fn: Callable | None) -> tuple[PyTree, PyTree]:
  """k new members, stacked: fresh ones from `init_fn`, or copies of the last member."""
  if init == "copy":
    last = lambda a: jnp.repeat(a[-1:], k, axis=0)
    return jax.tree.map(last, state.params), jax.tree.map(last, state.model_state)
  if init_fn is None:
    raise ValueError("add_member(init='fresh') needs init_fn: key -> (params, model_state) of one member")
  members = [init_fn(jax.random.fold_in(key, j)) for j in range(k)]
  return stack_members([m[0] for m in members]), stack_members([m[1] for m in members])


def _concat(old: PyTree, new: PyTree, what: str) -> PyTree:
  if jax.tree.structure(old) != jax.tree.structure(new):
    raise ValueError(f"the new members' {what} do not have the existing members' tree structure")

  def cat(a, b):
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
      raise ValueError(f"a new member's {what} leaf {b.shape[1:]} {b.dtype} does not match the "
                       f"existing {a.shape[1:]} {a.dtype}")
    return jnp.concatenate([a, b], axis=0)

  return jax.tree.map(cat, old, new)


def add_member(state: Learner, key: jax.Array, *, init: str = "fresh", k: int = 1,
               init_fn: Callable[[jax.Array], tuple[PyTree, PyTree]] | None = None) -> Learner:
  """Appends `k` members to a stacked ensemble (gEns growth, paper section 4.2).

  Args:
    state: an ensemble learner whose structure is `(num_members, num_trainable)`
      and whose params/model_state leaves are stacked on axis 0 (not modified).
    key: PRNG key of the new members (member j of the k uses `fold_in(key, j)`).
    init: "fresh" (a new random network from `init_fn`; the paper's text) or
      "copy" (a copy of the last member; the paper's released code).
    k: how many members to add.
    init_fn: key -> (params, model_state) of one unstacked member; needed for
      "fresh".

  Returns:
    A new learner with `num_members + k` members whose first `num_members`
    slices are the old members, bitwise; its structure is
    `(num_members + k, k)`: the new members are the trainable ones.
  """
  if init not in MEMBER_INITS:
    raise ValueError(f"add_member: init={init!r} is unknown; valid values: {list(MEMBER_INITS)}")
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"add_member: k={k!r} must be an integer >= 1")
  n = num_members(state.params)
  if not (isinstance(state.structure, tuple) and len(state.structure) == 2
          and state.structure[0] == n):
    raise ValueError(f"add_member needs an ensemble learner with structure (num_members, "
                     f"num_trainable) and {n} stacked members; got structure {state.structure!r}")
  params, model_state = _new_members(state, key, init, k, init_fn)
  return Learner(params=_concat(state.params, params, "params"),
                 model_state=_concat(state.model_state, model_state, "model_state"),
                 structure=(n + k, k))


def _append_copy(tree, index: int):
  """Appends slice `index` of every stacked leaf of `tree` at the end of axis 0."""
  return jax.tree.map(lambda a: jnp.concatenate([a, a[index:index + 1]], axis=0), tree)


def split_expert(state: Learner, layer: int, leaf: int, key: jax.Array) -> Learner:
  """Splits expert `leaf` of mixture layer `layer` into two (eq. 3 of the paper).

  Tree gating: the leaf becomes an internal node with a new gate (LeCun-normal
  kernel drawn from `key`, zero bias); its children are the old expert (left)
  and an exact copy of it (right), appended to the stacked experts together
  with a copy of its BatchNorm statistics. As the two children are equal, the
  network computes the same function before and after the split, for any
  value of the new gate, with soft and hard gating alike.

  Flat gating (ablation): the copy is added as a new output of the single
  softmax gate (a new random kernel column, zero bias); this changes the
  weights of all experts, so the function changes.

  Args:
    state: the learner (not modified).
    layer: index of the mixture layer (0 = the first mixture).
    leaf: the expert to split (its index on the stacked axis).
    key: PRNG key of the new gate.

  Returns:
    A new learner with one more expert (and one more gate) in `layer`.
  """
  structure = state.structure
  if not 0 <= layer < len(structure):
    raise ValueError(f"layer {layer} is not a mixture layer; the learner has {len(structure)}")
  feat_dim, tree = structure[layer]
  new_tree = moe.split_leaf(tree, leaf)  # checks that `leaf` is a leaf
  name = moe.layer_name(layer)
  lp = dict(state.params[name])
  lp["experts"] = _append_copy(lp["experts"], leaf)
  if moe.is_flat(tree):
    g = lp["gate"]
    column = moe.init_gate_kernel(key, feat_dim, 1).astype(g["kernel"].dtype)
    lp["gate"] = {"kernel": jnp.concatenate([g["kernel"], column], axis=1),
                  "bias": jnp.concatenate([g["bias"], jnp.zeros((1,), g["bias"].dtype)])}
  else:
    kernel = moe.init_gate_kernel(key, feat_dim, 2)[None]
    bias = jnp.zeros((1, 2))
    if "gates" in lp:
      old = lp["gates"]
      kernel = jnp.concatenate([old["kernel"], kernel.astype(old["kernel"].dtype)], axis=0)
      bias = jnp.concatenate([old["bias"], bias.astype(old["bias"].dtype)], axis=0)
    lp["gates"] = {"kernel": kernel, "bias": bias}
  params = {**state.params, name: lp}
  model_state = state.model_state
  stats = model_state.get("batch_stats", {})
  if name in stats:
    model_state = {**model_state, "batch_stats": {**stats, name: _append_copy(stats[name], leaf)}}
  new_structure = structure[:layer] + ((feat_dim, new_tree),) + structure[layer + 1:]
  return Learner(params=params, model_state=model_state, structure=new_structure)
