"""Hidden units: their activity, dormant units, the effective rank of features, and the
resets of chosen units (what the plasticity diagnostics, `alma_jax.engine.plasticity`, and
the unit-reset stage policies, `alma_jax.policies.redo` and `continual_backprop`, share).

A hidden unit is one output channel of a hidden layer of the backbone (a neuron of the MLP,
a channel of a VGG convolution), as the backbone's `WidthLayout` lists them; its activity on
a batch is the mean over examples (and positions) of |h|, h its output after the
activation. Following ReDo (Sokar et al., 2023), a unit's score is its activity over the
mean activity of its layer, and the unit is dormant when its score is at most a threshold
tau (tau = 0: the units that are exactly zero on every example, dead ReLUs).

A reset draws a unit afresh: its incoming weights and its per-unit parameters and
statistics take the values of a fresh initialisation, and its outgoing weights (the next
layer's, or the classifier's, inputs from it) become zero, so that the network computes
the same function right after the reset whenever the unit was silent (its activity was
exactly zero). Methods expose their hidden layers through `Method.unit_layout` and
`Method.hidden_units`: one backbone (`sm`), the members of an ensemble side by side
(`ens`, `umix`: `Method.unit_members` > 0, every leaf stacked on a member axis; a unit's
score is then over its own member's layer mean), members in slots (`gens`: the member
slots, `Method.unit_members_of`, side by side; the padding slots are not units, and a reset
re-draws only units of the members a stage trains, `Method.unit_trained`), or a backbone
whose layers hold their channels in slots (`ff`: `Method.unit_active` says which units are
the learner's; the padding slots are neither scored nor reset), or a mixture of experts
(`gmoe`): the channels of each mixture's output (a channel is the same output of every
expert of its layer, and every kernel that reads the mixture, the next mixture's experts
and gates, at each position a gate pools, or the classifier, is an outgoing weight of it,
`WidthLayout.readers`), and on the VGG the shared stem's channels and the channels of the
experts' inner convolutions (`WidthLayout.slotted`: every expert slot's units side by side,
each read only by its own expert's next conv; a layer's units are scored against the mean
of every active expert's, the padding slots are neither scored nor reset); the Switch
Transformer has none.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.models.registry import WidthLayout, leaf_at, replace_leaves
from alma_jax.state import Learner

PyTree = Any


def activity_fn(method) -> Any:
  """A pass over data (`Passes.reduce`): (structure, params, model_state, x, y, mask, task) ->
  {"activity": per layer, the sum over the batch's real examples of each unit's mean |h|
  over positions (width,); "gram": the Gram matrix of the last hidden layer's features
  (averaged over positions) (width, width); "count": the real examples}."""

  def fn(structure, params, model_state, x, y, mask, task):
    del y, task
    hidden = method.hidden_units(structure, params, model_state, x)
    m = mask.astype(jnp.float32)
    means = [jnp.mean(jnp.abs(h.astype(jnp.float32)).reshape(h.shape[0], -1, h.shape[-1]),
                      axis=1) for h in hidden]  # (b, width) per layer
    last = jnp.mean(hidden[-1].astype(jnp.float32).reshape(
        hidden[-1].shape[0], -1, hidden[-1].shape[-1]), axis=1) * m[:, None]
    return {"activity": [m @ a for a in means], "gram": last.T @ last, "count": jnp.sum(m)}

  return fn


def mean_activity(summed: dict) -> list[np.ndarray]:
  """Each layer's per-unit mean activity from a pass of `activity_fn`."""
  n = max(float(summed["count"]), 1.0)
  return [np.asarray(a, np.float64) / n for a in summed["activity"]]


def scores(activity: Sequence[np.ndarray], members: int = 0,
           active: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
  """Each unit's activity over its layer's mean activity (0 for a layer that is all silent);
  with `members` > 0 the layer's units are that many networks' side by side, each unit
  scored against its own network's layer. `active` (`Method.unit_active`; None: all): the
  layer's mean is over its active units, and an inactive unit (a padding slot) has no score
  (NaN: never dormant, never chosen)."""
  out = []
  for l, a in enumerate(activity):
    rows = np.asarray(a, np.float64).reshape(max(members, 1), -1)
    on = (np.ones(rows.shape, bool) if active is None
          else np.asarray(active[l], bool).reshape(rows.shape))
    count = np.sum(on, axis=1, keepdims=True)
    mean = np.sum(np.where(on, rows, 0.0), axis=1, keepdims=True) / np.maximum(count, 1)
    s = np.where(mean > 0, rows / np.where(mean > 0, mean, 1.0), 0.0)
    out.append(np.where(on, s, np.nan).reshape(-1))
  return out


def dormant(activity: Sequence[np.ndarray], threshold: float, members: int = 0,
            active: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
  """Per layer, the dormant units (bool): score <= `threshold` (inactive units never are)."""
  return [s <= threshold for s in scores(activity, members, active)]


def effective_rank(gram: np.ndarray) -> float:
  """The effective rank (Roy & Vetterli, 2007) of features F from their Gram matrix F^T F:
  exp of the entropy of the normalised singular values of F (1 ... width; 0 when F = 0)."""
  eig = np.linalg.eigvalsh(np.asarray(gram, np.float64))
  sv = np.sqrt(np.clip(eig, 0.0, None))
  total = float(np.sum(sv))
  if total <= 0:
    return 0.0
  p = sv[sv > 0] / total
  return float(np.exp(-np.sum(p * np.log(p))))


def _float_leaves(tree) -> list[np.ndarray]:
  return [np.asarray(l, np.float64) for l in jax.tree.leaves(jax.device_get(tree))
          if jnp.issubdtype(np.asarray(l).dtype, jnp.floating)]


def param_norm(params: PyTree) -> float:
  """The L2 norm of all floating-point parameters."""
  return float(np.sqrt(sum(float(np.sum(np.square(l))) for l in _float_leaves(params))))


def distance(params: PyTree, other: PyTree) -> float:
  """The L2 norm of `params - other` (trees of the same structure and shapes)."""
  a, b = _float_leaves(params), _float_leaves(other)
  return float(np.sqrt(sum(float(np.sum(np.square(x - y))) for x, y in zip(a, b))))


# -- resets ------------------------------------------------------------------------------------
def reset_units(layout: WidthLayout, learner: Learner, fresh: Learner,
                masks: Sequence[np.ndarray], members: int = 0) -> Learner:
  """`learner` with the units where `masks[l]` (one bool (width,) per layer; with `members`
  > 0, (members * width,) member-major, every leaf stacked on a member axis) holds drawn
  afresh: incoming kernel, per-unit parameters and statistics from `fresh` (a fresh
  initialisation of the same structure), outgoing weights zero."""
  masks = [jnp.asarray(np.asarray(m, bool)) for m in masks]
  args = (learner.params, learner.model_state, fresh.params, fresh.model_state)
  if members:
    params, state = jax.vmap(lambda *a: _reset(layout, *a))(
        *args, [m.reshape(members, -1) for m in masks])
  else:
    params, state = _reset(layout, *args, masks)
  return learner.replace(params=params, model_state=state)


def _mask_of(m, leaf, slotted: bool, rows: bool = False):
  """A layer's unit mask `m` (units,) shaped to select in `leaf` the units' values (on its
  last axis) or, with `rows`, the rows that read the units (axis -2; k x width rows read
  the units at k positions, position-major); `slotted`: one layer per slot of the leaf's
  leading axis, `m` slot-major."""
  if slotted:
    m = m.reshape(leaf.shape[0], -1)
  lead = m.shape[:-1]
  size = leaf.shape[-2] if rows else leaf.shape[-1]
  m = jnp.tile(m, (1,) * len(lead) + (size // m.shape[-1],))
  tail = (size, 1) if rows else (size,)
  return m.reshape(lead + (1,) * (leaf.ndim - len(lead) - len(tail)) + tail)


def _reset(layout: WidthLayout, params, state, fresh_params, fresh_state, masks):
  """`reset_units` of one network: its (params, model_state)."""
  edits, stat_edits = {}, {}
  for l, m in enumerate(masks):  # incoming first: a unit re-drawn in the next layer too
    slotted = layout.is_slotted(l)
    for path in (layout.kernels[l],) + tuple(p for p, _ in layout.vectors[l]):
      old = leaf_at(params, path)
      edits[path] = jnp.where(_mask_of(m, old, slotted), leaf_at(fresh_params, path), old)
    for path, _ in layout.stats[l]:
      old = leaf_at(state, path)
      stat_edits[path] = jnp.where(_mask_of(m, old, slotted), leaf_at(fresh_state, path), old)
  for l, m in enumerate(masks):  # keeps no input from a re-drawn unit
    for out in layout.outgoing(l, params):
      kernel = edits.get(out, leaf_at(params, out))
      edits[out] = jnp.where(_mask_of(m, kernel, layout.is_slotted(l), rows=True),
                             jnp.zeros_like(kernel), kernel)
  return replace_leaves(params, edits), replace_leaves(state, stat_edits)


def outgoing_weight(layout: WidthLayout, params: PyTree, layer: int,
                    members: int = 0) -> np.ndarray:
  """Per unit of `layer`, the sum of the magnitudes of its outgoing weights: of every kernel
  that reads it (`WidthLayout.outgoing`; a reader's rows at every position), member-major
  with `members` > 0 and slot-major for a slotted layer, as `reset_units`."""
  width = np.shape(leaf_at(params, layout.kernels[layer]))[-1]
  per_slot = bool(members) or layout.is_slotted(layer)
  total = 0.0
  for path in layout.outgoing(layer, params):
    kernel = np.asarray(jax.device_get(leaf_at(params, path)), np.float64)
    kept = (0, kernel.ndim - 2) if per_slot else (kernel.ndim - 2,)
    rows = np.sum(np.abs(kernel), axis=tuple(i for i in range(kernel.ndim) if i not in kept))
    rows = rows.reshape(rows.shape[:-1] + (-1, width)).sum(axis=-2)  # positions of a unit
    total = total + rows.reshape(-1)
  return total
