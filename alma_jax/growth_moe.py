"""Growth of tree-gated mixtures of experts: splitting one expert (paper Appendix A).

`split_expert` is pure: a learner in, a new learner out. It is re-exported as
`alma_jax.surgery.split_expert`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.methods.base import Learner
from alma_jax.models import moe


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


def expert_scores(weights: jnp.ndarray, losses: jnp.ndarray, mask: jnp.ndarray,
                  split_by: str) -> jnp.ndarray:
  """Per-expert growth scores of a batch: (b, E) routing weights -> (E,).

  Args:
    weights: routing weight of each example through each expert (soft: the
      leaf probability; hard: 1 for the chosen expert, 0 otherwise).
    losses: per-example loss (b,).
    mask: which examples count (b,).
    split_by: "loss" (cumulative loss routed through the expert, weighted by
      the routing weight: the paper) or "usage" (cumulative routing weight:
      the released code).
  """
  m = mask.astype(weights.dtype)
  if split_by == "loss":
    m = m * losses.astype(weights.dtype)
  elif split_by != "usage":
    raise ValueError(f"config.method.split_by={split_by!r} is unknown; valid values: "
                     "['loss', 'usage']")
  return jnp.einsum("be,b->e", weights, m)


def losing_expert(scores) -> int:
  """The expert to split: the arg-max of the cumulative scores (first one on ties)."""
  scores = np.asarray(scores)
  if scores.ndim != 1 or scores.size == 0:
    raise ValueError(f"expected a non-empty vector of expert scores, got shape {scores.shape}")
  return int(np.argmax(scores))
