"""Tree-gated mixtures of experts (paper Appendix A, eq. 3, Fig. 6) and the gMoE backbones.

A mixture layer holds E experts of the same architecture, stacked on a
leading axis, and a binary tree of gates. Every internal node of the tree has
a gate, a linear map of the layer's gate features followed by a 2-way
softmax; a leaf is an expert. The weight of a leaf is the product of the gate
probabilities on its root-to-leaf path, so the leaf weights of an input sum
to 1; a layer with a single expert has no gate and weight 1.

The tree is static (it lives in the learner's `structure`) and is encoded
with nested tuples, so that it is hashable and JSON-friendly:

* a leaf is an `int`, the index of its expert on the stacked axis;
* an internal node is `(gate, left, right)`, `gate` being the index of its
  gate on the stacked gate axis; `left` takes probability 0 of the gate's
  softmax, `right` probability 1;
* the "flat" ablation (early version, section 5.2) is `("flat", E)`: one
  softmax gate with E outputs over all experts.

A layer's structure is `(gate_features, tree)`; the learner's structure is
the tuple of its mixture layers' structures.

Gating is "soft" (the weighted sum over all leaves) or "hard": in training
each gate samples a child and the straight-through estimator passes the
gradient to the probabilities (Bengio et al., 2013); at test time each gate
takes its more probable child (greedy descent from the root, as the
released code does). Greedy descent, unlike the arg-max over leaf weights,
is unchanged by a split, since the two new children are equal.

Parameters (and BatchNorm statistics under `model_state["batch_stats"]`)
are stored per layer under `mix{l}`: `{"experts": stacked expert params,
"gates": {"kernel": (G, F, 2), "bias": (G, 2)}}` (no "gates" when G = 0), or
`{"experts": ..., "gate": {"kernel": (F, E), "bias": (E,)}}` for flat gating.

Slots: the stacked axes hold C >= E expert slots (and C - 1 gate slots, or C
outputs of a flat gate); experts 0 ... E-1 are active, the others padding.
The tree is also held as arrays in `model_state["routing"][mix{l}]`
(`tree_arrays`): `active` (C,) and `path` (C, C-1), the side (1 left, 2
right, 0 none) that each expert's root-to-leaf path takes at each gate. The
compiled programs read the tree from these arrays, so a split that fits in
the slots changes values, not shapes, and reuses them. A padding slot has
weight 0, so it changes neither the output nor any gradient, and its
BatchNorm statistics are kept as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Hashable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.configuration import fields as F
from alma_jax.models import inits
from alma_jax.models import registry
from alma_jax.models import slots
from alma_jax.runtime import fused_draws

PyTree = Any
Tree = Hashable
FLAT = "flat"


# -- trees -----------------------------------------------------------------------------
def is_flat(tree: Tree) -> bool:
  return isinstance(tree, tuple) and len(tree) == 2 and tree[0] == FLAT


def balanced_tree(num_experts: int, flat: bool = False) -> Tree:
  """A tree with leaves 0 ... num_experts-1; gates numbered in pre-order."""
  if num_experts < 1:
    raise ValueError(f"a mixture needs at least one expert, got {num_experts}")
  if flat:
    return (FLAT, num_experts)
  counter = [0]

  def build(lo: int, hi: int) -> Tree:
    if hi - lo == 1:
      return lo
    gate = counter[0]
    counter[0] += 1
    mid = (lo + hi + 1) // 2
    return (gate, build(lo, mid), build(mid, hi))

  return build(0, num_experts)


def leaves(tree: Tree) -> list[int]:
  """Expert indices of the leaves, left to right."""
  if is_flat(tree):
    return list(range(tree[1]))
  if isinstance(tree, int):
    return [tree]
  return leaves(tree[1]) + leaves(tree[2])


def num_experts(tree: Tree) -> int:
  return len(leaves(tree))


def num_gates(tree: Tree) -> int:
  """Internal nodes of a tree (for flat gating: 1, the single softmax)."""
  if is_flat(tree):
    return 1
  return 0 if isinstance(tree, int) else 1 + num_gates(tree[1]) + num_gates(tree[2])


def check_tree(tree: Tree) -> None:
  """Raises ValueError unless experts and gates are numbered 0 ... n-1 exactly once."""
  if is_flat(tree):
    if not isinstance(tree[1], int) or tree[1] < 1:
      raise ValueError(f"invalid flat gating {tree!r}")
    return
  gates = []

  def walk(node):
    if isinstance(node, int) and not isinstance(node, bool):
      return
    if not (isinstance(node, tuple) and len(node) == 3 and isinstance(node[0], int)):
      raise ValueError(f"invalid gating tree node {node!r} in {tree!r}")
    gates.append(node[0])
    walk(node[1])
    walk(node[2])

  walk(tree)
  if sorted(leaves(tree)) != list(range(num_experts(tree))) or sorted(gates) != list(
      range(len(gates))):
    raise ValueError(f"gating tree {tree!r} must number its experts and gates 0, 1, ... once")


def split_leaf(tree: Tree, leaf: int) -> Tree:
  """The tree with leaf `leaf` turned into a new gate over (leaf, new expert E).

  The new gate gets index G (the number of gates) and the new expert index E
  (the number of experts): both are appended to their stacked axes. For flat
  gating one more output is added.
  """
  if leaf not in leaves(tree):
    raise ValueError(f"expert {leaf} is not a leaf of the gating tree {tree!r}; "
                     f"leaves: {leaves(tree)}")
  if is_flat(tree):
    return (FLAT, tree[1] + 1)
  new_gate, new_expert = num_gates(tree), num_experts(tree)

  def walk(node):
    if isinstance(node, int):
      return (new_gate, node, new_expert) if node == leaf else node
    return (node[0], walk(node[1]), walk(node[2]))

  return walk(tree)


def tree_dict(tree: Tree) -> dict:
  """A nested dict of the tree, for drawing: {"gate": g, "children": [...]} or {"expert": e}."""
  if is_flat(tree):
    return {"gate": 0, "children": [{"expert": e} for e in range(tree[1])]}
  if isinstance(tree, int):
    return {"expert": tree}
  return {"gate": tree[0], "children": [tree_dict(tree[1]), tree_dict(tree[2])]}


def tree_arrays(tree: Tree, slots: int) -> dict:
  """The tree as arrays for `slots` expert slots: {"active": (C,) bool, "path": (C, C-1) int8}.

  `path[e, g]` is 1 (2) when expert e's root-to-leaf path goes to the left
  (right) child of gate g, else 0. Without gates (flat gating, one slot) it
  has one column of zeros.
  """
  e = num_experts(tree)
  if slots < e:
    raise ValueError(f"{slots} slots cannot hold the {e} experts of {tree!r}")
  gates = 1 if is_flat(tree) else max(slots - 1, 1)  # a column at least: no empty array
  path = np.zeros((slots, gates), np.int8)

  def walk(node, steps):
    if isinstance(node, int):
      for g, side in steps:
        path[node, g] = side
      return
    walk(node[1], steps + [(node[0], 1)])
    walk(node[2], steps + [(node[0], 2)])

  if not is_flat(tree):
    walk(tree, [])
  return {"active": np.arange(slots) < e, "path": path}


def tree_from_arrays(active, path, flat: bool = False) -> Tree:
  """Inverse of `tree_arrays` (gate indices increase from the root to the leaves)."""
  active, path = np.asarray(active, bool), np.asarray(path)
  e = int(active.sum())
  if not active[:e].all():
    raise ValueError(f"the active experts must be the first slots; got {active.tolist()}")
  if flat:
    return (FLAT, e)

  def build(experts):
    if len(experts) == 1:
      return int(experts[0])
    # The subtree's root gate: on every path of the subtree, sending some left, some right.
    cols = path[experts]
    roots = [g for g in range(path.shape[1])
             if cols[:, g].all() and (cols[:, g] == 1).any() and (cols[:, g] == 2).any()]
    if len(roots) != 1:
      raise ValueError(f"invalid routing arrays: experts {experts} have {len(roots)} root gates")
    g = roots[0]
    return (g, build([x for x in experts if path[x, g] == 1]),
            build([x for x in experts if path[x, g] == 2]))

  return build(list(range(e)))




# -- gates -------------------------------------------------------------------------------
def adaptive_pool_size(size: int, pool: int) -> int:
  """Output side of the gate's average pool: the largest divisor of `size` <= `pool`."""
  return max(d for d in range(1, min(pool, size) + 1) if size % d == 0)


def gate_features(x: jnp.ndarray, pool: int) -> jnp.ndarray:
  """Gate input: with `pool` > 0, image maps are average-pooled to (at most) pool x pool;
  then flattened."""
  if pool and x.ndim == 4:
    n, h, w, c = x.shape
    oh, ow = adaptive_pool_size(h, pool), adaptive_pool_size(w, pool)
    x = x.reshape(n, oh, h // oh, ow, w // ow, c).mean(axis=(2, 4))
  return x.reshape((x.shape[0], -1))


def init_gate_kernel(key: jax.Array, features: int, outputs: int) -> jnp.ndarray:
  """LeCun-normal kernel (Flax Dense's default), fan-in = `features`."""
  return nn.initializers.lecun_normal()(key, (features, outputs), jnp.float32)


def init_gate(key: jax.Array, features: int, outputs: int,
              scheme: str = "lecun") -> tuple[jnp.ndarray, jnp.ndarray]:
  """(kernel (features, outputs), bias (outputs,)) of one new gate.

  "lecun": `init_gate_kernel(key, ...)` and a zero bias. "torch": PyTorch's
  `nn.Linear(features, outputs)` default, the released code's gates: kernel
  and bias U(-1/sqrt(features), 1/sqrt(features)).
  """
  return inits.linear_params(key, features, outputs, scheme)


def init_gates(key: jax.Array, tree: Tree, features: int, scheme: str = "lecun",
               slots: int | None = None) -> dict:
  """Randomly initialised gate params of a layer ({} for a single slot in a tree).

  `slots`: the expert slots (None: the tree's experts); a tree gets one
  gate per slot but one, drawn as `jax.random.split` of `key` (so the first
  gates do not depend on the slots), a flat gate one output per slot.
  """
  if is_flat(tree):
    kernel, bias = init_gate(key, features, slots or tree[1], scheme)
    return {"gate": {"kernel": kernel, "bias": bias}}
  g = num_gates(tree) if slots is None else slots - 1
  if g <= 0:
    return {}
  kernels, biases = jax.vmap(lambda k: init_gate(k, features, 2, scheme))(jax.random.split(key, g))
  return {"gates": {"kernel": kernels, "bias": biases}}


def _choose(logits, probs, *, train: bool, hard: bool, rng, per_gate: bool):
  """Gate values: probabilities (soft), or one-hots (hard; straight-through in training)."""
  if not hard:
    return probs
  if not train:
    choice = jnp.argmax(probs, -1)
  elif per_gate:
    # One uniform per (gate, example), keyed by the gate's index: a split keeps the old
    # gates' draws, so the sampled path (and the loss) is unchanged by it.
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(probs.shape[1]))
    u = jax.vmap(lambda k: jax.random.uniform(k, (probs.shape[0],)))(keys).T
    choice = (u < probs[..., 1]).astype(jnp.int32)
  else:
    choice = jax.random.categorical(rng, logits)
  one_hot = jax.nn.one_hot(choice, probs.shape[-1], dtype=probs.dtype)
  if train:  # straight-through: the forward value is the one-hot, the gradient that of probs
    return one_hot + probs - jax.lax.stop_gradient(probs)
  return one_hot


def _path_product(path, values: jnp.ndarray) -> jnp.ndarray:
  """(b, G, 2) gate values -> (b, C) products along each slot's path (`tree_arrays`).

  Gates are multiplied in index order, root first (gate indices grow from
  the root to the leaves), and off-path gates multiply by exactly 1, so an
  expert's weight is bitwise the product along its path. Every gate's value
  for every slot is chosen at once and the products run as a scan over the
  gates: a few traced operations whatever the number of gates (a Python loop
  over them traced ~8 operations per gate, in every program and FLOP count of
  every structure). The scan stays a loop in the compiled program: unrolled,
  its chain of G - 1 multiplications of slices of one array made XLA:GPU's
  fusion pass grow faster than the slots (compiled for an H200 on a CPU, P4's
  16-slot evaluation: 2.8 s of fusion in a 5.4 s compile, against 0.3 s of
  1.2 s as a loop; benchmarks/README.md, "Compiling for a GPU without one"),
  while on a CPU the loop of at most 15 small multiplications costs no
  measurable time.
  """
  g = min(path.shape[1], values.shape[1])
  side = jnp.swapaxes(path[:, :g], 0, 1)[None]  # (1, G, C)
  one = jnp.ones((), values.dtype)
  v = jnp.where(side == 1, values[:, :g, :1], jnp.where(side == 2, values[:, :g, 1:], one))
  if g == 1:
    return v[:, 0]
  w, _ = jax.lax.scan(lambda w, vg: (w * vg, None), v[:, 0], jnp.swapaxes(v[:, 1:], 0, 1))
  return w


def routed_weights(routing: dict, lp: dict, feats: jnp.ndarray, *, flat: bool = False,
                   train: bool = False, hard: bool = False,
                   rng: jax.Array | None = None) -> jnp.ndarray:
  """Weights (b, C) of a layer's expert slots from its routing arrays (`tree_arrays`): the
  products of gate values along each active expert's path; 0 for padding slots."""
  active = routing["active"]
  if active.shape[0] == 1:
    return jnp.ones((feats.shape[0], 1), feats.dtype)
  if hard and train and rng is None:
    raise ValueError("hard gating in training needs a PRNG key")
  if flat:
    logits = feats @ lp["gate"]["kernel"] + lp["gate"]["bias"]
    logits = jnp.where(active, logits, -jnp.inf)
    w = _choose(logits, jax.nn.softmax(logits, -1), train=train, hard=hard, rng=rng,
                per_gate=False)
  else:
    g = lp["gates"]
    logits = jnp.einsum("bf,gfk->bgk", feats, g["kernel"]) + g["bias"]
    values = _choose(logits, jax.nn.softmax(logits, -1), train=train, hard=hard, rng=rng,
                     per_gate=True)
    w = _path_product(routing["path"], values)
  return jnp.where(active, w, jnp.zeros((), w.dtype))


def leaf_weights(tree: Tree, lp: dict, feats: jnp.ndarray, *, train: bool = False,
                 hard: bool = False, rng: jax.Array | None = None) -> jnp.ndarray:
  """Weights (b, E) of the experts of `tree` (gates `lp` without padding) for gate features
  `feats` (b, F).

  Soft: probabilities summing to 1 per example. Hard: a one-hot vector (in
  training, with the straight-through gradient; `rng` is then required).
  """
  routing = jax.tree.map(jnp.asarray, tree_arrays(tree, num_experts(tree)))
  return routed_weights(routing, lp, feats, flat=is_flat(tree), train=train, hard=hard, rng=rng)


def greedy_leaf(tree: Tree, weights: jnp.ndarray) -> jnp.ndarray:
  """(b, E) leaf weights -> (b,) the leaf reached by descending from the root to the child
  whose subtree holds more weight (the left one on ties); flat gating: the arg-max."""
  if is_flat(tree):
    return jnp.argmax(weights, -1)

  def walk(node):
    if isinstance(node, int):
      return weights[:, node], jnp.full(weights.shape[:1], node)
    (mass_l, leaf_l), (mass_r, leaf_r) = walk(node[1]), walk(node[2])
    return mass_l + mass_r, jnp.where(mass_r > mass_l, leaf_r, leaf_l)

  return walk(tree)[1]


# -- experts -----------------------------------------------------------------------------
class Head(nn.Module):
  """The shared linear classifier on the flattened features."""

  num_classes: int
  init_scheme: str = "lecun"  # see alma_jax.models.inits

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask
    x = x.reshape((x.shape[0], -1))
    return inits.dense(self.num_classes, self.init_scheme, x.shape[-1], "dense")(x)


def _bn_mask(mask, x):
  return None if mask is None else mask.reshape((-1,) + (1,) * (x.ndim - 1))


def apply_module(module: nn.Module, params, stats, x, *, train: bool, mask=None):
  """Applies one module; returns (output, new BatchNorm stats or None)."""
  variables = {"params": params}
  if stats is not None:
    variables["batch_stats"] = stats
  if train and stats is not None:
    y, updates = module.apply(variables, x, train=True, mask=_bn_mask(mask, x),
                              mutable=["batch_stats"])
    return y, updates["batch_stats"]
  return module.apply(variables, x, train=train, mask=_bn_mask(mask, x)), stats


def sown_outputs(module: nn.Module, params, stats, x, paths: Sequence[registry.Path]):
  """(the output of `module` at inference, the outputs it sows at `paths`)."""
  variables = {"params": params} | ({} if stats is None else {"batch_stats": stats})
  y, sown = module.apply(variables, x, train=False, mutable=["intermediates"])
  return y, [registry.leaf_at(sown["intermediates"], p)[0] for p in paths]


def init_module(module: nn.Module, key: jax.Array, x_shape: Sequence[int]):
  """(params, batch_stats or None) of `module` for inputs of shape (1,) + x_shape."""
  variables = module.init(key, jnp.zeros((1,) + tuple(x_shape), jnp.float32), train=False)
  return variables["params"], variables.get("batch_stats")


# -- the backbone ----------------------------------------------------------------------------
def layer_name(layer: int) -> str:
  return f"mix{layer}"


@dataclasses.dataclass(frozen=True)
class MoENet:
  """A backbone whose middle layers are mixtures: stem -> mixtures -> head.

  Attributes:
    stem: shared layers before the first mixture (None: none).
    experts: the expert module of each mixture layer.
    head: the shared classifier.
    gate_pool: side of the average pool of image gate inputs (0: no pooling).
    gather_hard_eval: with hard gating at test time, run only the chosen
      expert of each example by gathering its parameters (cheap for dense
      layers); otherwise all experts run and the chosen output is selected.
    init_scheme: how gates are initialised ("lecun" or "torch", see
      `init_gate`); the modules carry their own scheme.
    expert_units, stem_units: `registry.Mixture.expert_units` and `stem_units` (None: no
      hidden units exposed).
  """

  stem: nn.Module | None
  experts: tuple[nn.Module, ...]
  head: nn.Module
  gate_pool: int = 0
  gather_hard_eval: bool = False
  init_scheme: str = "lecun"
  expert_units: tuple[registry.WidthLayout, ...] | None = None
  stem_units: registry.WidthLayout | None = None

  def layer_input_shapes(self, input_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Per-example input shapes of each mixture layer, then of the head."""
    key = jax.random.key(0)

    def output(module, x):
      return jax.eval_shape(lambda k, a: module.init_with_output(k, a, train=False)[0], key, x)

    x = jax.ShapeDtypeStruct((1,) + tuple(input_shape), jnp.float32)
    if self.stem is not None:
      x = output(self.stem, x)
    shapes = [tuple(x.shape[1:])]
    for module in self.experts:
      x = output(module, x)
      shapes.append(tuple(x.shape[1:]))
    return shapes

  def gate_feature_dims(self, input_shape: Sequence[int]) -> list[int]:
    dims = []
    for s in self.layer_input_shapes(input_shape)[:-1]:
      f = jax.eval_shape(lambda a: gate_features(a, self.gate_pool),
                         jax.ShapeDtypeStruct((1,) + s, jnp.float32))
      dims.append(int(f.shape[-1]))
    return dims


def make_net(model_config, num_classes: int, gate_pool: int = 4) -> MoENet:
  """The mixture version that the backbone of `config.model` declares (`registry.Mixture`).

  Its image gates see their input average-pooled to `gate_pool` x `gate_pool` when the
  backbone asks for pooled gates. `model_config.init` ("lecun" when absent) initialises
  experts, stem, head and gates alike. A backbone without one is a `ConfigError`.
  """
  scheme = inits.check(F.get(model_config, "model.init"))
  build = registry.capability(model_config.name, "mixture", "gmoe")
  m = build(model_config, num_classes)
  head = Head(num_classes, scheme) if m.head is None else m.head
  return MoENet(m.stem, tuple(m.experts), head, gate_pool if m.pooled_gates else 0,
                gather_hard_eval=m.gather_hard_eval, init_scheme=scheme,
                expert_units=m.expert_units if m.head is None else None,
                stem_units=m.stem_units if m.head is None else None)


def init(net: MoENet, key: jax.Array, structure, input_shape,
         slots: Sequence[int] | None = None) -> tuple[dict, dict]:
  """Params and model state of `net` for `structure` (experts initialised independently).

  `slots`: the expert slots of each layer (None: as many as its experts);
  slot e is drawn from `jax.random.split(key_l, C)[e]`, so the active
  experts do not depend on the slots.
  """
  shapes = net.layer_input_shapes(input_shape)
  k_stem, k_head, k_layers = jax.random.split(key, 3)
  params, stats, routing = {}, {}, {}
  x_shape = tuple(input_shape)
  if net.stem is not None:
    params["stem"], s = init_module(net.stem, k_stem, x_shape)
    if s is not None:
      stats["stem"] = s
  for l, (module, (feat_dim, tree), shape) in enumerate(zip(net.experts, structure, shapes)):
    c = num_experts(tree) if slots is None else int(slots[l])
    k_exp, k_gate = jax.random.split(jax.random.fold_in(k_layers, l))
    keys = jax.random.split(k_exp, c)
    p, s = jax.vmap(lambda k, m=module, sh=shape: init_module(m, k, sh))(keys)
    name = layer_name(l)
    params[name] = {"experts": p, **init_gates(k_gate, tree, feat_dim, net.init_scheme, c)}
    routing[name] = jax.tree.map(jnp.asarray, tree_arrays(tree, c))
    if s is not None:
      stats[name] = s
  params["head"], _ = init_module(net.head, k_head, shapes[-1])
  return params, ({"batch_stats": stats} if stats else {}) | {"routing": routing}


@functools.lru_cache(maxsize=256)
def jitted_init(net: MoENet, structure, input_shape: tuple[int, ...],
                slots: tuple[int, ...] | None = None):
  """`init` compiled for one (net, structure, input shape, slots), its draws hashed together
  (`fused_draws`); shared by equal nets."""
  return jax.jit(fused_draws.fuse_draws(lambda key: init(net, key, structure, input_shape, slots)))


def mixture(net: MoENet, layer: int, routing: dict, lp: dict, stats, x, *, flat: bool,
            train: bool, hard: bool, mask=None, rng=None, hidden: list | None = None):
  """One mixture layer: returns (output, new stacked stats, slot weights (b, C)). `hidden`
  (a list; inference only): the outputs of every expert slot's inner hidden layers
  (`net.expert_units`, all but the last: (b, ..., C * width), slot-major), then the
  mixture's output, are appended to it."""
  module = net.experts[layer]
  weights = routed_weights(routing, lp, gate_features(x, net.gate_pool), flat=flat, train=train,
                           hard=hard, rng=rng)
  units = None if hidden is None else net.expert_units[layer]
  inner = () if units is None else units.units[:units.num_layers - 1]
  if hard and not train and net.gather_hard_eval and weights.shape[-1] > 1 and not inner:
    chosen = jnp.argmax(weights, -1)
    per_example = jax.tree.map(lambda a: a[chosen], (lp["experts"], stats))
    y = jax.vmap(lambda p, s, xi: apply_module(module, p, s, xi[None], train=False)[0][0])(
        *per_example, x)
    new_stats = stats
  else:
    def run(p, s):
      if inner:
        y, sown = sown_outputs(module, p, s, x, inner)
        return y, s, sown
      return apply_module(module, p, s, x, train=train, mask=mask) + ([],)

    ys, new_stats, sown = jax.vmap(run)(lp["experts"], stats)
    y = jnp.einsum("be,eb...->b...", weights.astype(ys.dtype), ys)
    if new_stats is not None and stats is not None:  # padding slots keep their statistics
      active = routing["active"]
      new_stats = jax.tree.map(
          lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), new_stats,
          stats)
    for h in sown:  # (C, b, ..., width) -> (b, ..., C * width)
      h = jnp.moveaxis(h, 0, -2)
      hidden.append(h.reshape(h.shape[:-2] + (-1,)))
  if hidden is not None:
    hidden.append(y)
  return y, new_stats, weights


def apply(net: MoENet, structure, params, model_state, x, *, train: bool, hard: bool = False,
          mask=None, rng=None, hidden: list | None = None):
  """The whole backbone; returns (logits, new model_state, [slot weights of each layer]).

  The tree of each layer is read from `model_state["routing"]`; `structure`
  only says which layers use flat gating. `hidden` (a list; inference only): the outputs
  of the hidden layers that the net exposes (`stem_units`, `expert_units`) are appended
  to it, in order: the stem's, then per mixture its experts' inner layers and its output
  (`mixture`).
  """
  if hidden is not None and train:
    raise ValueError("hidden units are read at inference (train=False)")
  stats = model_state.get("batch_stats", {})
  new_stats = dict(stats)
  if net.stem is not None:
    if hidden is not None and net.stem_units is not None:
      x, sown = sown_outputs(net.stem, params["stem"], stats.get("stem"), x,
                             net.stem_units.units)
      hidden.extend(sown)
    else:
      x, s = apply_module(net.stem, params["stem"], stats.get("stem"), x, train=train,
                          mask=mask)
      if s is not None:
        new_stats["stem"] = s
  all_weights = []
  for l, (_, tree) in enumerate(structure):
    name = layer_name(l)
    lrng = None if rng is None else jax.random.fold_in(rng, l)
    x, s, w = mixture(net, l, model_state["routing"][name], params[name], stats.get(name), x,
                      flat=is_flat(tree), train=train, hard=hard, mask=mask, rng=lrng,
                      hidden=hidden)
    if s is not None:
      new_stats[name] = s
    all_weights.append(w)
  logits = net.head.apply({"params": params["head"]}, x)
  new_state = {"batch_stats": new_stats} if new_stats else {}
  return logits, new_state | {"routing": model_state["routing"]}, all_weights
