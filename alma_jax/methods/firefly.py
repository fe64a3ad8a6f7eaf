"""FF: Firefly, growing the width of every layer by splitting and adding neurons (paper
section 4.2; Wu et al., 2020).

The learner is one backbone whose spec declares a `WidthLayout` (`alma_jax.models.registry`:
the reduced VGG19 with BatchNorm, the MLP); its structure is the tuple of its per-layer widths.
Before every `grow_every`-th stage but the first it grows:

1. Candidates, per growable layer l of width C_l (the layout's layers: the VGG's 16 conv
   layers, the MLP's hidden layers): a split of each neuron j, whose two halves get incoming
   weights w_j + eps v_j and w_j - eps v_j and half of the old outgoing weights each; and K
   (`num_new`) new neurons with incoming weights a and outgoing weights eps b. Initial scales
   (released code): v ~ U(-0.1, 0.1), a ~ N(0, 0.1^2), b ~ U(-0.01, 0.01).
2. Fit: one pass over the stage's training data (unaugmented, shuffled) of RMSprop (lr 1e-3,
   decay 0.9, momentum 0.1), one step per batch of the pass (`ctx.scan`, batches of
   `train.eval_batch_size`; the FF configs set it to 128, the released code's step), on v, a
   and b, minimising the loss of the *candidate network* plus 1e-2 |v|^2 + 1e-4 |a|^2. The
   candidate network is `grow_width` with every candidate taken and the candidates at full
   size (eps = 1), with BatchNorm on its running statistics, as in the released code.
   (Smaller steps inside a compiled batch would need a loop: XLA:CPU runs convolution
   gradients inside `lax.scan` 30-60x slower than unrolled, measured with jax 0.10.2.)
3. Score: a second pass; candidate c's score is the derivative of the mean loss with respect to
   a zero-initialised relative scale s_c on it (its split perturbation becomes (1 + s_c) v_j,
   its outgoing weights (1 + s_c) b_k): `jax.grad` at s = 0, averaged over the examples.
4. Select the `n_grow` most negative scores over all layers and both kinds, where n_grow =
   int(growth_rate x initial total width): total width grows linearly with the stages.
5. `grow_width`: the pure surgery, with eps = `epsilon`. eps = 0 computes exactly the old
   function (split halves are copies; new neurons' outgoing weights are 0).

Decisions (README fidelity notes): growth_rate 0.25 (paper B.1; the released CIFAR config
uses 0.6, and its ratio schedule also adds a fixed number of neurons per growth); K = 70,
the scales, penalties and RMSprop settings of the released code; eps = 1e-2 (the released
layers' `epsilon`) instead of the released unscaled +-v, so that a growth changes the
function by O(eps) and never adds extra classifier outputs. Split neurons keep copies of
their BatchNorm parameters and statistics, new neurons get scale 1, bias 0, mean 0, var 1.

Compute: both passes run the candidate network, of width 2 C_l + K per layer, through
`ctx.scan` (counted by the core as growth compute); `fit_examples` bounds the examples used.

Slots (`method.slots`, `alma_jax.models.slots`): with "pow2" every growable layer holds its
C_l channels in S channel slots, S the next power of two of the widest layer's width (or
`method.min_slots`, if larger: fewer structures, more padding computed), the first C_l active
(`model_state["slots"]["active"]`, one (S_l,) mask per layer). Inactive channels output
exactly 0 (the backbone multiplies them by their mask), so they receive no gradient; their
BatchNorm statistics are kept as they are in training; padding values are zeros. The
compiled programs are keyed by the slots (`program_structure`), so growths inside one power
of two of the widest layer reuse them; the candidate network holds 2 S + K channels, its
candidates on inactive channels masked too and never selected. The candidates' draw and the
growth are programs of the slots too (`draw_in_slots`, `grow_in_slots`: the widths and the
plan are arrays), with the values of drawing and growing on the active channels and writing
the result into the slots, so a run gives the records of "exact" (no slots: one structure per
growth) up to float summation order. Mem and every FLOP count are
taken on `active_view` (the active channels alone, no masks): they do not depend on the
slots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from alma_jax import models
from alma_jax.configuration.plugins import methods as declared
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods.registry import register
from alma_jax.models import registry as backbones
from alma_jax.models import slots as slots_lib
from alma_jax.runtime import executables
from alma_jax.runtime import fused_draws
from alma_jax.runtime import host_random

PyTree = Any
Path = tuple[str, ...]
Layout = models.WidthLayout  # where the growable layers' weights live
SLOTS_KEY = "slots"  # model_state[SLOTS_KEY]["active"]: one channel mask per growable layer


# Leaves by path.
_get, _replace = backbones.leaf_at, backbones.replace_leaves


# -- channel slots --------------------------------------------------------------------------------
def _fit_axis(a, axis: int, n: int):
  """`a` with axis `axis` cut or zero-padded to size `n`."""
  size = a.shape[axis]
  if n <= size:
    return jax.lax.slice_in_dim(a, 0, n, axis=axis)
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, n - size)
  return jnp.pad(a, pad)


def layer_widths(layout: Layout, params: PyTree) -> tuple[int, ...]:
  """The channels (active or not) each growable layer's arrays hold."""
  return tuple(int(_get(params, k).shape[-1]) for k in layout.kernels)


def resize_channels(layout: Layout, params: PyTree, model_state: PyTree,
                    widths: Sequence[int]) -> tuple[PyTree, PyTree]:
  """(params, model_state) with every growable layer's channels cut or zero-padded to
  `widths` (its kernel's outputs, per-channel vectors and statistics, and the next kernel's
  inputs); the slot masks, if any, are left out."""
  old = layer_widths(layout, params)
  edits, stat_edits = {}, {}
  for l, n in enumerate(widths):
    if old[l] == n:
      continue
    path = layout.kernels[l]
    edits[path] = _fit_axis(edits.get(path, _get(params, path)), -1, n)
    nxt = layout.next_kernel(l)
    edits[nxt] = _fit_axis(edits.get(nxt, _get(params, nxt)), -2, n)
    for p, _ in layout.vectors[l]:
      edits[p] = _fit_axis(_get(params, p), -1, n)
    for p, _ in layout.stats[l]:
      stat_edits[p] = _fit_axis(_get(model_state, p), -1, n)
  state = {k: v for k, v in model_state.items() if k != SLOTS_KEY}
  return _replace(params, edits), _replace(state, stat_edits)


def in_slots(layout: Layout, params: PyTree, model_state: PyTree, widths: Sequence[int],
             slots: Sequence[int]) -> tuple[PyTree, PyTree]:
  """(params, model_state) of `widths` active channels held in `slots` channel slots, with
  the masks (`SLOTS_KEY`); the active values are those of the input."""
  params, model_state = resize_channels(layout, params, model_state, slots)
  masks = [jnp.asarray(slots_lib.mask(c, s)) for c, s in zip(widths, slots)]
  return params, {**model_state, SLOTS_KEY: {"active": masks}}


def active_masks(model_state: PyTree):
  """The per-layer channel masks, or None for a learner without slots."""
  if isinstance(model_state, dict) and SLOTS_KEY in model_state:
    return model_state[SLOTS_KEY]["active"]
  return None


def resize_candidates(tree: PyTree, old: Sequence[int], new: Sequence[int]) -> PyTree:
  """Candidate-shaped leaves (`init_candidates`' {"v", "a", "b"}, scores' {"split", "new"},
  and optimizer states of them: any leaf whose path ends in a layer index and one of those
  keys) moved from `old` to `new` channel slots per layer, cut or zero-padded; the columns
  of "b" keep their K new-neuron columns last."""
  num = len(old)

  def one(path, a):
    if len(path) < 2 or not isinstance(path[-2], jax.tree_util.SequenceKey):
      return a
    l, name = path[-2].idx, getattr(path[-1], "key", None)
    if name in ("v", "split"):
      a = _fit_axis(a, -1, new[l])
    if name in ("v", "a") and l > 0:
      a = _fit_axis(a, -2, new[l - 1])
    if name == "b" and l + 1 < num:
      a = jnp.concatenate([_fit_axis(a[..., :old[l + 1]], -1, new[l + 1]),
                           a[..., old[l + 1]:]], axis=-1)
    return a

  if tuple(old) == tuple(new):
    return tree
  return jax.tree_util.tree_map_with_path(one, tree)


# -- candidates -----------------------------------------------------------------------------------
def init_candidates(key: jax.Array, layout: Layout, params: PyTree, widths: Sequence[int],
                    num_new: int, scales: tuple[float, float, float]) -> list[dict]:
  """Per layer {"v": split directions, like the kernel; "a": incoming weights of K new neurons
  (..., inputs, K); "b": their outgoing weights (..., K, next outputs [+ K])}."""
  sv, sa, sb = scales
  out = []
  for l in range(len(widths)):
    kv, ka, kb = jax.random.split(jax.random.fold_in(key, l), 3)
    w, nxt = _get(params, layout.kernels[l]), _get(params, layout.next_kernel(l))
    grows = 1 if l + 1 < len(widths) else 0  # the next layer has new-neuron candidates too
    out.append({
        "v": jax.random.uniform(kv, w.shape, w.dtype, -sv, sv),
        "a": sa * jax.random.normal(ka, w.shape[:-1] + (num_new,), w.dtype),
        "b": jax.random.uniform(kb, nxt.shape[:-2] + (num_new, nxt.shape[-1] + grows * num_new),
                                w.dtype, -sb, sb)})
  return out


def _at(scale, idx):
  return scale if np.ndim(scale) == 0 else scale[idx]


def _grow_columns(w, cand, split: np.ndarray, new: np.ndarray, eps):
  """Layer kernel (..., I, C) -> (..., I, C + |split| + |new|): w_j + eps v_j for split j,
  then the other halves w_j - eps v_j, then the new neurons' incoming weights."""
  chosen = np.zeros(w.shape[-1], np.float32)
  chosen[split] = 1.0
  v = cand["v"]
  plus = w + v * (jnp.asarray(chosen, w.dtype) * eps)
  minus = w[..., split] - v[..., split] * _at(eps, split)
  return jnp.concatenate([plus, minus, cand["a"][..., new]], axis=-1)


def _grow_rows(w, out_cand, split: np.ndarray, new: np.ndarray, eps, columns: np.ndarray):
  """Next kernel (..., I, O') -> (..., I + |split| + |new|, O'): the rows of split inputs
  halved and repeated, then eps b of the new inputs (`columns` picks b's output columns)."""
  half = np.ones(w.shape[-2], np.float32)
  half[split] = 0.5
  w = w * jnp.asarray(half, w.dtype)[:, None]
  b = out_cand["b"][..., new, :] * jnp.reshape(_at(eps, new), (-1, 1))
  return jnp.concatenate([w, w[..., split, :], b[..., columns]], axis=-2)


def _grow_vector(x, split: np.ndarray, num_new: int, fill: float):
  return jnp.concatenate([x, x[..., split], jnp.full(x.shape[:-1] + (num_new,), fill, x.dtype)],
                         axis=-1)


def grown_trees(layout: Layout, params, model_state, widths, split, new, candidates, eps_split,
                eps_new):
  """(params, model_state) after the growth `split`/`new` of every layer (see `grow_width`).

  `eps_split[l]` and `eps_new[l]` scale layer l's split perturbations and new outgoing
  weights: a number, or one value per candidate ((C_l,) and (K,)) for scoring.
  """
  num = len(widths)
  edits, stat_edits = {}, {}
  for l in range(num + 1):
    path = layout.kernels[l] if l < num else layout.head
    w = _get(params, path)
    if l < num:
      w = _grow_columns(w, candidates[l], split[l], new[l], eps_split[l])
    if l > 0:
      if l < num:  # b's columns: the old outputs, then the candidates [C_l old | K new]
        columns = np.concatenate([np.arange(widths[l]), split[l], widths[l] + new[l]])
      else:
        columns = np.arange(w.shape[-1])
      if l == num and w.shape[-2] != widths[-1]:
        raise ValueError(f"the classifier sees {w.shape[-2]} features, not the last layer's "
                         f"{widths[-1]} channels: Firefly needs a 1x1 map before it")
      w = _grow_rows(w, candidates[l - 1], split[l - 1], new[l - 1], eps_new[l - 1], columns)
    edits[path] = w
  for l in range(num):
    for p, fill in layout.vectors[l]:
      edits[p] = _grow_vector(_get(params, p), split[l], len(new[l]), fill)
    for p, fill in layout.stats[l]:
      stat_edits[p] = _grow_vector(_get(model_state, p), split[l], len(new[l]), fill)
  return _replace(params, edits), _replace(model_state, stat_edits)


@dataclasses.dataclass(frozen=True)
class GrowthPlan:
  """What `grow_width` does to each layer.

  Attributes:
    split: per layer, the (sorted, distinct) neurons to split.
    new: per layer, which of the K new-neuron candidates to add.
    candidates: per layer, {"v", "a", "b"} (`init_candidates`, fitted).
    epsilon: split halves get w_j +- epsilon v_j, new neurons outgoing weights epsilon b.
  """

  split: tuple[np.ndarray, ...]
  new: tuple[np.ndarray, ...]
  candidates: tuple[dict, ...]
  epsilon: float = 0.0

  def added(self) -> list[int]:
    return [len(s) + len(n) for s, n in zip(self.split, self.new)]


def grow_width(state: base.Learner, plan: GrowthPlan, layout: Layout,
               slots: Sequence[int] | None = None) -> base.Learner:
  """The learner with `plan` applied to the layers of `layout`: a pure edit of its pytrees
  (the input is untouched).

  Layer l's output channels become [old (split ones perturbed by +eps v) | the other halves
  of the split neurons (-eps v), in `split` order | the new neurons, in `new` order], with
  copies of the split neurons' biases, BatchNorm parameters and statistics and, for new
  neurons, bias 0, BatchNorm scale 1, bias 0, mean 0, variance 1. The next layer's (or the
  classifier's) input rows of split neurons are halved for both halves; those of new neurons
  are eps b. With eps = 0 the grown network computes the old function, in training and
  evaluation mode alike; the structure becomes the grown widths.

  A learner in channel slots (`in_slots`) stays in slots: the grown channels go to the free
  slots after the active ones (in the order above), in `slots` channel slots per layer (None:
  the current slots where the grown width fits, else its next power of two); `plan` is in
  active channels.
  """
  widths = tuple(state.structure)
  if active_masks(state.model_state) is not None:
    old_slots = layer_widths(layout, state.params)
    params, model_state = resize_channels(layout, state.params, state.model_state, widths)
    grown = grow_width(base.Learner(params, model_state, widths), plan, layout)
    if slots is None:
      slots = tuple(s if c <= s else slots_lib.next_power_of_two(c)
                    for c, s in zip(grown.structure, old_slots))
    slots = tuple(max(int(s), c) for s, c in zip(slots, grown.structure))
    params, model_state = in_slots(layout, grown.params, grown.model_state, grown.structure,
                                   slots)
    return base.Learner(params=params, model_state=model_state, structure=grown.structure)
  if len(plan.candidates) != len(widths):
    raise ValueError(f"a growth plan needs one entry per layer ({len(widths)})")
  split, new = check_plan(widths, plan.split, plan.new)
  eps = [plan.epsilon] * len(widths)
  params, model_state = grown_trees(layout, state.params, state.model_state, widths, split,
                                    new, plan.candidates, eps, eps)
  grown = tuple(c + a for c, a in zip(widths, plan.added()))
  return base.Learner(params=params, model_state=model_state, structure=grown)


# -- selection --------------------------------------------------------------------------------
def select(scores: Sequence[dict], n_grow: int) -> tuple[tuple[np.ndarray, ...], ...]:
  """(split, new) per layer: the `n_grow` candidates with the most negative scores.

  `scores[l]` = {"split": (C_l,), "new": (K,)}; ties go to the earlier layer and kind.
  """
  flat = np.concatenate([np.concatenate([np.asarray(s["split"], np.float64).ravel(),
                                         np.asarray(s["new"], np.float64).ravel()])
                         for s in scores])
  if not np.all(np.isfinite(flat)):
    raise FloatingPointError("Firefly candidate scores are not finite")
  take = np.zeros(flat.size, bool)
  take[np.argsort(flat, kind="stable")[:n_grow]] = True
  split, new, start = [], [], 0
  for s in scores:
    c, k = np.size(s["split"]), np.size(s["new"])
    split.append(np.flatnonzero(take[start:start + c]))
    new.append(np.flatnonzero(take[start + c:start + c + k]))
    start += c + k
  return tuple(split), tuple(new)


# -- the draw and the growth as programs of the slots ---------------------------------------------
# A draw of a shape is the prefix of a flat draw of any larger size with the same key (JAX's
# partitionable threefry, its default: element k always takes counter k), and flat draws compile
# several times faster on a CPU than shaped ones. So the candidates of the active channels, and
# the growth of a plan, are computed by programs that take the widths and the plan as arrays:
# one program per slot structure, with the values of `init_candidates` and `grow_width`.
def _flat_take(flat, lead: tuple[int, ...], rows: int, rows_exact, col_src, col_valid,
               cols_exact):
  """(lead..., rows, len(col_src)): element (s, i, d) is flat[(s rows_exact + i) cols_exact +
  col_src[d]] where i < rows_exact and col_valid[d], else 0; i.e. the draw of shape (lead...,
  rows_exact, cols_exact) with its rows and columns moved into slots."""
  s = jnp.arange(int(np.prod(lead, dtype=np.int64)), dtype=jnp.int32)[:, None, None]
  i = jnp.arange(rows, dtype=jnp.int32)[None, :, None]
  idx = (s * rows_exact + i) * cols_exact + col_src[None, None, :]
  valid = (i < rows_exact) & col_valid[None, None, :]
  out = jnp.where(valid, flat[jnp.where(valid, idx, 0)], jnp.zeros((), flat.dtype))
  return out.reshape(tuple(lead) + (rows, col_src.shape[0]))


def draw_in_slots(key: jax.Array, layout: Layout, params: PyTree, widths, num_new: int,
                  scales: tuple[float, float, float]) -> list[dict]:
  """`init_candidates` of the active channels `widths` ((L,) integers, may be traced) of a
  learner in channel slots, moved into its slots as `resize_candidates` does: the same values
  (zero padding), from a program that depends on the slots alone."""
  sv, sa, sb = scales
  num, k = len(widths), num_new
  out = []
  for l in range(num):
    kv, ka, kb = jax.random.split(jax.random.fold_in(key, l), 3)
    w, nxt = _get(params, layout.kernels[l]), _get(params, layout.next_kernel(l))
    lead, p_in, p_l = tuple(w.shape[:-2]), int(w.shape[-2]), int(w.shape[-1])
    rows, c = (widths[l - 1] if l > 0 else p_in), widths[l]
    grows = 1 if l + 1 < num else 0
    p_next = int(nxt.shape[-1])
    o = widths[l + 1] if grows else p_next  # the next layer's active outputs
    size = lambda *d: int(np.prod(d, dtype=np.int64))  # pylint: disable=unnecessary-lambda-assignment
    v = jax.random.uniform(kv, (size(*lead, p_in, p_l),), w.dtype, -sv, sv)
    a = sa * jax.random.normal(ka, (size(*lead, p_in, k),), w.dtype)
    lead_b = tuple(nxt.shape[:-2])
    b = jax.random.uniform(kb, (size(*lead_b, k, p_next + grows * k),), w.dtype, -sb, sb)
    cols, kcols = jnp.arange(p_l), jnp.arange(k)
    d = jnp.arange(p_next + grows * k)  # b's slots: [the next layer's slots | K new]
    out.append({
        "v": _flat_take(v, lead, p_in, rows, cols, cols < c, c),
        "a": _flat_take(a, lead, p_in, rows, kcols, kcols >= 0, k),
        "b": _flat_take(b, lead_b, k, k, jnp.where(d < p_next, d, o + d - p_next),
                        (d < o) | (d >= p_next), o + grows * k)})
  return out


KEEP, SPLIT, NEW, EMPTY = 0, 1, 2, 3  # where a grown channel comes from (`growth_indices`)


def check_plan(widths: Sequence[int], split, new) -> tuple[tuple[np.ndarray, ...], ...]:
  """(split, new) as flat integer arrays, refused unless one entry per layer with distinct
  split neurons of the layer."""
  if not len(split) == len(new) == len(widths):
    raise ValueError(f"a growth plan needs one entry per layer ({len(widths)})")
  split = tuple(np.asarray(s, np.int64).reshape(-1) for s in split)
  new = tuple(np.asarray(n, np.int64).reshape(-1) for n in new)
  for l, (s, c) in enumerate(zip(split, widths)):
    if len(np.unique(s)) != len(s) or (len(s) and not 0 <= s.min() <= s.max() < c):
      raise ValueError(f"layer {l}: split neurons {s.tolist()} must be distinct, in [0, {c})")
  return split, new


def growth_indices(widths: Sequence[int], split, new, old_slots: Sequence[int],
                   new_slots: Sequence[int]) -> list[dict[str, np.ndarray]]:
  """Per layer, where each of its `new_slots` channels after the growth comes from: "kind"
  (KEEP: old channel "src", SPLIT: the other half of split neuron "src", NEW: new-neuron
  candidate "src", EMPTY: a free slot), "chosen" (1 on split neurons, over the new slots) and
  "half" (0.5 on split neurons, over the old slots: their outgoing rows)."""
  out = []
  for c, s, n, p_old, p in zip(widths, split, new, old_slots, new_slots):
    grown = c + len(s) + len(n)
    if grown > p:
      raise ValueError(f"{grown} channels do not fit in {p} slots")
    kind, src = np.full(p, EMPTY, np.int32), np.zeros(p, np.int32)
    kind[:c], src[:c] = KEEP, np.arange(c)
    kind[c:c + len(s)], src[c:c + len(s)] = SPLIT, s
    kind[c + len(s):grown], src[c + len(s):grown] = NEW, n
    chosen, half = np.zeros(p, np.float32), np.ones(p_old, np.float32)
    chosen[s], half[s] = 1.0, 0.5
    out.append({"kind": kind, "src": src, "chosen": chosen, "half": half})
  return out


def _take_new(x, idx, axis: int):
  """`jnp.take(x, idx, axis)` of the new neurons' candidates; zeros where there are none
  (`num_new` = 0: no slot takes one, and `take` refuses an empty axis)."""
  if x.shape[axis] == 0:
    shape = list(x.shape)
    shape[axis] = idx.shape[0]
    return jnp.zeros(shape, x.dtype)
  return jnp.take(x, idx, axis=axis)


def grow_in_slots(layout: Layout, params: PyTree, model_state: PyTree, indices: list[dict],
                  candidates: Sequence[dict], eps) -> tuple[PyTree, PyTree]:
  """(params, model_state) of `grow_width` for a learner whose candidates (`draw_in_slots`)
  are in its slots, the plan given as `growth_indices` arrays (may be traced): the same values
  (padding zeros), one program per old and new slots. The slot masks, if any, become the
  grown channels."""
  num = len(indices)
  pick = lambda g: jnp.where(g["kind"] < NEW, g["src"], 0)  # pylint: disable=unnecessary-lambda-assignment
  edits, stat_edits = {}, {}
  for l in range(num + 1):
    path = layout.kernels[l] if l < num else layout.head
    w = _get(params, path)
    if l < num:  # the layer's outputs (as `_grow_columns`)
      g, cand = indices[l], candidates[l]
      wg, vg = jnp.take(w, pick(g), axis=-1), jnp.take(cand["v"], pick(g), axis=-1)
      added = _take_new(cand["a"], jnp.where(g["kind"] == NEW, g["src"], 0), -1)
      w = jnp.where(g["kind"] == KEEP, wg + vg * (g["chosen"] * eps),
                    jnp.where(g["kind"] == SPLIT, wg - vg * eps,
                              jnp.where(g["kind"] == NEW, added, jnp.zeros((), w.dtype))))
    if l > 0:  # the previous layer's outputs, this kernel's inputs (as `_grow_rows`)
      g, b = indices[l - 1], candidates[l - 1]["b"]
      rows = jnp.take(w * g["half"][:, None], pick(g), axis=-2)
      b = _take_new(b, jnp.where(g["kind"] == NEW, g["src"], 0), -2) * eps
      if l < num:  # b's columns: the grown outputs, [old slots | K new] in b
        c = indices[l]
        old = b.shape[-1] - candidates[l]["a"].shape[-1]
        cols = jnp.where(c["kind"] == NEW, old + c["src"], c["src"])
        b = jnp.where(c["kind"] < EMPTY, jnp.take(b, cols, axis=-1), jnp.zeros((), b.dtype))
      kind = g["kind"][:, None]
      w = jnp.where(kind < NEW, rows, jnp.where(kind == NEW, b, jnp.zeros((), w.dtype)))
    edits[path] = w

  def vector(x, g, fill):  # as `_grow_vector`
    return jnp.where(g["kind"] < NEW, jnp.take(x, pick(g), axis=-1),
                     jnp.where(g["kind"] == NEW, jnp.asarray(fill, x.dtype),
                               jnp.zeros((), x.dtype)))

  for l in range(num):
    for p, fill in layout.vectors[l]:
      edits[p] = vector(_get(params, p), indices[l], fill)
    for p, fill in layout.stats[l]:
      stat_edits[p] = vector(_get(model_state, p), indices[l], fill)
  state = _replace({k: v for k, v in model_state.items() if k != SLOTS_KEY}, stat_edits)
  if active_masks(model_state) is not None:
    state[SLOTS_KEY] = {"active": [g["kind"] < EMPTY for g in indices]}
  return _replace(params, edits), state


# -- the method ------------------------------------------------------------------------------------
@register
class Firefly(declared.FF, base.Method):
  """One backbone whose layers grow wider before every `grow_every`-th later stage."""

  same_growth_for_every_seed = False  # candidates are fitted and scored on each seed's data

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    self.refuse_kept_optimizer_state("a growth changes the parameter shapes")
    if self.opts.slots == "exact" and self.opts.min_slots:
      raise ValueError(f"method.min_slots={self.opts.min_slots} holds channels in slots, which "
                       "method.slots='exact' does not use; set method.slots='pow2' or "
                       "method.min_slots=0")
    self.layout: Layout = models.capability(config.model.name, "width_layout", self.name)(
        config.model, num_classes)
    self.num_layers = self.layout.num_layers
    if self.opts.growth_rate > 0 and self.n_grow == 0:
      rate, total = self.opts.growth_rate, sum(self.initial_structure())
      least = math.ceil(1e6 / total) / 1e6  # printed as is, and adds one neuron
      raise ConfigError(
          f"config.method.growth_rate={rate} adds int({rate} x {total}) = 0 neurons per growth "
          f"to the initial total width {total} (config.model.width={self.config.model.width} "
          f"x {self.num_layers} layers), so Firefly would never grow; allowed values: "
          f">= {least:g} at this width, or 0 for no growth")
    self.fit_tx = optax.rmsprop(self.opts.fit_lr, decay=0.9, eps=1e-8, eps_in_sqrt=False,
                                momentum=0.1)
    self._modules: dict[tuple[int, ...], Any] = {}
    self._programs: dict[tuple, Any] = {}  # compiled init and growth, by their static inputs

  # -- construction ---------------------------------------------------------------------------
  def initial_structure(self) -> tuple[int, ...]:
    return (int(self.config.model.width),) * self.num_layers

  @property
  def n_grow(self) -> int:
    """Neurons added per growth: growth_rate x the initial total width."""
    return int(self.opts.growth_rate * sum(self.initial_structure()))

  def module(self, widths: tuple[int, ...]):
    """The backbone with these per-layer widths (equal widths: the SM backbone's params)."""
    if widths not in self._modules:
      self._modules[widths] = self.layout.build(widths)
    return self._modules[widths]

  def slots(self, widths: Sequence[int]) -> tuple[int, ...]:
    """The channel slots of layers of these widths (`method.slots`): with pow2 every layer
    has the slots of the widest one, so a run compiles one structure per power of two of its
    widest layer (layers that grow unevenly would otherwise cross powers of two at different
    growths)."""
    if self.opts.slots == "exact":
      return tuple(widths)
    return (max(int(self.opts.min_slots), slots_lib.capacity(max(widths), self.opts.slots)),
            ) * len(widths)

  def program_structure(self, structure) -> tuple[int, ...]:
    """The channel slots of every growable layer (which are active is in the masks)."""
    return self.slots(tuple(structure))

  def active_view(self, learner: base.Learner) -> base.Learner:
    """The learner cut to its active channels, without masks, as shapes."""
    if active_masks(learner.model_state) is None:
      return learner

    def cut(params, model_state):
      return resize_channels(self.layout, params, model_state, learner.structure)

    params, model_state = jax.eval_shape(cut, learner.params, learner.model_state)
    return learner.replace(params=params, model_state=model_state)

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    widths = self.initial_structure() if structure in (None, ()) else tuple(structure)
    if len(widths) != self.num_layers or not all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in widths):
      raise ValueError(f"structure {structure!r} does not fit ff with config.model.name="
                       f"{self.config.model.name!r}: expected {self.num_layers} widths >= 1")
    dummy = np.zeros((1,) + self.input_shape, np.float32)  # numpy: safe inside transforms
    module = self.module(widths)
    variables = self._compiled(("init", widths), fused_draws.fuse_draws(
        lambda k: module.init(k, dummy, train=False)))(key)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    if self.opts.slots != "exact":  # the active channels are those of an exact learner
      params, model_state = in_slots(self.layout, params, model_state, widths,
                                     self.slots(widths))
    return base.Learner(params=params, model_state=model_state, structure=widths)

  # -- training and inference ----------------------------------------------------------------------
  def logits(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """The backbone of the arrays' widths (slots or active channels); inactive channels
    masked, their BatchNorm statistics unchanged by training."""
    del structure, rng
    module, state, active = self._backbone(params, model_state)
    variables = {"params": params, **state}
    if not (train and state):
      return module.apply(variables, x, train=train, mask=mask, active=active), model_state
    logits, updates = module.apply(variables, x, train=True, mask=mask, active=active,
                                   mutable=list(state))
    updates = dict(updates)
    if active is not None:
      edits = {p: jnp.where(active[l], _get(updates, p), _get(state, p))
               for l in range(self.num_layers) for p, _ in self.layout.stats[l]}
      updates = {**_replace(updates, edits), SLOTS_KEY: model_state[SLOTS_KEY]}
    return logits, updates

  def _backbone(self, params, model_state):
    """(the backbone of the arrays' widths, its model state without the slot masks, the
    active channels' masks or None): what applying a learner takes."""
    state = {k: v for k, v in model_state.items() if k != SLOTS_KEY}
    return self.module(layer_widths(self.layout, params)), state, active_masks(model_state)

  # -- hidden units (`alma_jax.models.units`) ----------------------------------------------------
  def unit_layout(self):
    """The growable layers, where the backbone sows its units (None: a backbone without)."""
    return self.layout if self.layout.units else None

  def hidden_units(self, structure, params, model_state, x) -> list:
    """`Method.hidden_units` of the backbone of the arrays' widths: in slots, every slot's
    channel, the inactive ones exactly zero (`unit_active` says which are the learner's)."""
    del structure
    if self.unit_layout() is None:
      return base.Method.hidden_units(self, (), params, model_state, x)  # raises
    module, state, active = self._backbone(params, model_state)
    _, sown = module.apply({"params": params, **state}, x, train=False, active=active,
                           mutable=["intermediates"])
    return [_get(sown["intermediates"], path)[0] for path in self.layout.units]

  def unit_active(self, learner: base.Learner) -> list[np.ndarray] | None:
    """The active channels of each layer (None: a learner without slots)."""
    masks = active_masks(learner.model_state)
    return None if masks is None else [np.asarray(m, bool) for m in masks]

  # -- growth ---------------------------------------------------------------------------------------
  def should_grow(self, ctx) -> bool:
    return self.n_grow > 0 and declared.grows_before(ctx.stage, self.opts.grow_every)

  def candidate_logits(self, structure, params, model_state, candidates, scales, x):
    """Logits of the candidate network: every candidate taken, at size 1 + its scale (in
    slots: the candidates of inactive channels masked)."""
    del structure
    widths, k = layer_widths(self.layout, params), self.opts.num_new
    active = active_masks(model_state)
    state = {k_: v for k_, v in model_state.items() if k_ != SLOTS_KEY}
    split = tuple(np.arange(c) for c in widths)
    new = tuple(np.arange(k) for _ in widths)
    p, s = grown_trees(self.layout, params, state, widths, split, new, candidates,
                       [1.0 + sc["split"] for sc in scales], [1.0 + sc["new"] for sc in scales])
    if active is not None:
      active = [jnp.concatenate([m, m, jnp.ones((k,), bool)]) for m in active]
    module = self.module(tuple(2 * c + k for c in widths))
    return module.apply({"params": p, **s}, x, train=False, active=active)

  def zero_scales(self, structure, dtype=jnp.float32, host: bool = False) -> list[dict]:
    """Zero scales of every candidate; `host`: numpy arrays (a pass's initial carry, which
    then builds no program of its own)."""
    xp = np if host else jnp
    return [{"split": xp.zeros((c,), dtype), "new": xp.zeros((self.opts.num_new,), dtype)}
            for c in structure]

  def _carry_at(self, carry, params):
    """A pass's carry cut to the widths of `params` (the active view that FLOP counts
    trace); unchanged in the compiled passes, whose params are in the carry's slots."""
    cands = carry[0]
    have = tuple(int(c["v"].shape[-1]) for c in cands)
    return resize_candidates(carry, have, layer_widths(self.layout, params))

  def fit_batch(self, structure, params, model_state, x, y, mask, carry, task):
    """One RMSprop step of the candidates on one batch of the pass (a `ctx.scan` body): on the
    task's loss (summed, over the batch's examples) plus the penalties."""
    o = self.opts
    carry = self._carry_at(carry, params)
    scales = self.zero_scales(layer_widths(self.layout, params), x.dtype)

    def objective(cands):
      logits = self.candidate_logits(structure, params, model_state, cands, scales, x)
      ce = task.summed_loss(logits, y, mask) / jnp.maximum(jnp.sum(mask), 1)
      penalty = sum(o.split_penalty * jnp.sum(c["v"] ** 2) + o.new_penalty * jnp.sum(c["a"] ** 2)
                    for c in cands)
      return ce + penalty

    cands, opt_state = carry
    updates, opt_state = self.fit_tx.update(jax.grad(objective)(cands), opt_state, cands)
    return optax.apply_updates(cands, updates), opt_state

  def score_batch(self, structure, params, model_state, x, y, mask, carry, task):
    """Adds each candidate's d(summed loss)/d(scale) at scale 0 on one batch (`ctx.scan`)."""
    cands, sums = self._carry_at(carry, params)
    loss = lambda s: task.summed_loss(  # pylint: disable=unnecessary-lambda-assignment
        self.candidate_logits(structure, params, model_state, cands, s, x), y, mask)
    grads = jax.grad(loss)(self.zero_scales(layer_widths(self.layout, params), x.dtype))
    return cands, jax.tree.map(jnp.add, sums, grads)

  def fit_indices(self, train_idx, key: jax.Array) -> np.ndarray:
    """The stage's examples in a random order (`jax.random.permutation`'s, drawn on the host by
    `host_random.permutation`, else by one compiled program per number of examples), at most
    `fit_examples` of them."""
    idx = np.asarray(train_idx, np.int32)
    n = len(idx)
    perm = host_random.permutation(key, n)
    if perm is None:

      def order(key):
        return jax.random.permutation(key, n)

      perm = np.asarray(self._compiled(("order", n), order)(key))
    idx = idx[perm]
    return idx[:self.opts.fit_examples] if self.opts.fit_examples else idx

  def plan_growth(self, learner: base.Learner, key: jax.Array, ctx) -> GrowthPlan:
    """Candidates fitted and scored on the stage's data (two `ctx.scan` passes), selected; the
    plan's candidates are in the learner's slots (`draw_in_slots`)."""
    o = self.opts
    widths = tuple(learner.structure)
    slots = layer_widths(self.layout, learner.params)

    def draw(params, key, widths):
      cands = draw_in_slots(key, self.layout, params, widths, o.num_new,
                            (o.split_init, o.new_in_init, o.new_out_init))
      return cands, self.fit_tx.init(cands)

    fused = fused_draws.fuse_draws(draw)

    def draw_and_order_key(params, key, widths):  # the key split in the program, not eagerly
      k_init, k_order = jax.random.split(key)
      return fused(params, k_init, widths), k_order

    draw_program = self._compiled(("draw", slots), draw_and_order_key)
    fitting, k_order = draw_program(learner.params, key, np.asarray(widths, np.int32))
    idx = self.fit_indices(ctx.train_idx, k_order)
    cands, _ = ctx.scan(self.fit_batch, fitting, learner, idx)
    _, sums = ctx.scan(self.score_batch, (cands, self.zero_scales(slots, host=True)),
                       learner, idx)
    scores = [{"split": np.asarray(s["split"], np.float64)[..., :c] / len(idx),
               "new": np.asarray(s["new"], np.float64) / len(idx)}
              for s, c in zip(sums, widths)]  # the active channels' scores
    split, new = select(scores, self.n_grow)
    return GrowthPlan(split, new, tuple(cands), o.epsilon)

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    if not self.should_grow(ctx):
      return learner
    plan = self.plan_growth(learner, key, ctx)
    widths = tuple(learner.structure)
    split, new = check_plan(widths, plan.split, plan.new)
    grown = tuple(c + a for c, a in zip(widths, plan.added()))
    old_slots = layer_widths(self.layout, learner.params)
    new_slots = grown if active_masks(learner.model_state) is None else self.slots(grown)
    indices = growth_indices(widths, split, new, old_slots, new_slots)

    def grow(params, model_state, candidates, indices, eps):
      return grow_in_slots(self.layout, params, model_state, indices, candidates, eps)

    fn = self._compiled(("grow", old_slots, new_slots), grow)
    params, model_state = fn(learner.params, learner.model_state, plan.candidates, indices,
                             np.asarray(plan.epsilon, np.float32))
    return base.Learner(params=params, model_state=model_state, structure=grown)

  def _compiled(self, key: tuple, fn: Callable) -> Callable:
    """`jax.jit(fn)`, kept under `key` (the static inputs `fn` closes over; also across
    processes: `executables`): initialisation and growth run as a few compiled programs, not
    as an operation at a time, each compiled for a short compile (it runs once)."""
    if key not in self._programs:
      self._programs[key] = executables.jit(fn, f"firefly_{key[0]}", key, once=True)
    return self._programs[key]

  # -- accounting -------------------------------------------------------------------------------
  def describe(self, learner: base.Learner) -> dict:
    return {"num_params": self.num_params(learner), "widths": list(learner.structure)}
