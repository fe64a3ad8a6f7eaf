"""gMoE: a growing, tree-gated mixture of experts (paper section 4.2, Appendix A).

The backbone declares where it mixes (its spec's `mixture`,
`alma_jax.models.registry.Mixture`): the MLP's two hidden layers (the
classifier is shared); the VGG's blocks after the first (the first block and
the classifier are shared), a block's gate seeing its input average-pooled to
4x4. A backbone that declares none is refused.

Before every `grow_every`-th training stage but the first (Algorithm 1 of the
paper and the released code: a split expert is trained before it counts in
Mem or in the test error), each mixture layer splits its losing expert
(`split_expert`, a pure edit of the learner pytree), chosen on the new
stage's validation data by `split_by`: "loss" (the largest cumulative loss
of the examples routed through it, weighted by the routing weight; the
paper) or "usage" (the largest cumulative routing weight; the released
code). By default it grows about 10 times over the stream.
The config fields are declared in `alma_jax.configuration.plugins.methods.GMoE`.

Compute: soft gating and hard gating in training run every expert. Hard
gating at test time runs only the chosen expert of each example for the MLP
(its parameters are gathered per example, so the inference FLOPs are those
of one path); for VGG all experts run and the chosen output is selected
(per-example conv kernels would need a batch-sized grouped convolution), so
its inference FLOPs count every expert.

Slots (`method.slots`): a layer's experts live in C >= E slots (the next
power of two by default), its tree in routing arrays
(`alma_jax.models.moe`), and the compiled programs are keyed by
`program_structure` (the slots), so the splits inside one power of two reuse
them. Padding slots run in the programs but have weight 0; Mem and every
FLOP count use `active_view` (the active experts only), so they equal the
counts of an unpadded model, up to the routing arithmetic (a few FLOPs per
example per gate).

Hidden units (`unit_layout`), which the plasticity diagnostics measure and the unit-reset
policies (`redo`, `continual_backprop`) re-draw: the channels of each mixture's output
(re-drawn across the layer's experts), and on the VGG also the stem's channels and the
channels of the experts' inner convolutions, each expert slot's its own.

A backbone whose layers are mixtures of experts of their own (the Switch
Transformer of the text task) is grown instead by copying its losing experts
(`alma_jax.methods.expert_growth`, with config fields of its own: see
`GrowingMoE.fields`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax import policies
from alma_jax.configuration import config_lib
from alma_jax.configuration.plugins import methods as declared
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods import expert_growth
from alma_jax.methods.registry import register
from alma_jax.models import moe
from alma_jax.models import registry as backbones
from alma_jax.models import slots as slots_lib
from alma_jax.models import units
from alma_jax.runtime import executables
from alma_jax.runtime import fused_draws
from alma_jax.runtime import host_random

SPLIT_BY = declared.SPLIT_BY
SLOTS = declared.SLOT_POLICIES


def gating_tree(learner: base.Learner, layer: int) -> dict:
  """The gating tree of mixture layer `layer` as nested dicts, for drawing.

  Internal nodes are `{"gate": g, "children": [left, right]}` (flat gating:
  one node with all experts as children), leaves `{"expert": e}`.
  """
  return moe.tree_dict(learner.structure[layer][1])


def experts_per_layer(structure) -> list[int]:
  return [moe.num_experts(tree) for _, tree in structure]


# -- growth: which expert to split, and the split ------------------------------------------------
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
                     f"{list(SPLIT_BY)}")
  return jnp.einsum("be,b->e", weights, m)


def losing_expert(scores) -> int:
  """The expert to split: the arg-max of the cumulative scores (first one on ties)."""
  scores = np.asarray(scores)
  if scores.ndim != 1 or scores.size == 0:
    raise ValueError(f"expected a non-empty vector of expert scores, got shape {scores.shape}")
  return int(np.argmax(scores))


def _resize_gates(lp: dict, flat: bool, feat_dim: int, slots: int) -> dict:
  """Gate params of layer params `lp` (flat gating or a tree) for `slots` expert slots (new
  gate slots are zeros)."""
  out = {k: v for k, v in lp.items() if k not in ("gate", "gates")}
  if flat:
    g = lp["gate"]
    pad = max(slots - g["bias"].shape[0], 0)
    out["gate"] = {"kernel": jnp.pad(g["kernel"], ((0, 0), (0, pad)))[:, :slots],
                   "bias": jnp.pad(g["bias"], (0, pad))[:slots]}
  elif slots > 1 or "gates" in lp:  # a layer in slots cut to one expert keeps no gate rows
    g = lp.get("gates", {"kernel": jnp.zeros((0, feat_dim, 2), jnp.float32),
                         "bias": jnp.zeros((0, 2), jnp.float32)})
    pad = max(slots - 1 - g["bias"].shape[0], 0)
    out["gates"] = {"kernel": jnp.pad(g["kernel"], ((0, pad), (0, 0), (0, 0)))[:slots - 1],
                    "bias": jnp.pad(g["bias"], ((0, pad), (0, 0)))[:slots - 1]}
  return out


def resize_layer(state: base.Learner, layer: int, slots: int) -> base.Learner:
  """The learner with mixture layer `layer` held in `slots` expert slots (>= its experts);
  the function it computes is unchanged."""
  feat_dim, tree = state.structure[layer]
  if slots < moe.num_experts(tree):
    raise ValueError(f"layer {layer} has {moe.num_experts(tree)} experts; {slots} slots cannot "
                     "hold them")
  name = moe.layer_name(layer)
  lp = _resize_gates(state.params[name], moe.is_flat(tree), feat_dim, slots)
  lp["experts"] = slots_lib.resize(lp["experts"], slots)
  model_state = dict(state.model_state)
  stats = model_state.get("batch_stats", {})
  if name in stats:
    model_state["batch_stats"] = {**stats, name: slots_lib.resize(stats[name], slots)}
  model_state["routing"] = {**model_state["routing"],
                            name: jax.tree.map(jnp.asarray, moe.tree_arrays(tree, slots))}
  return state.replace(params={**state.params, name: lp}, model_state=model_state)


def num_slots(learner: base.Learner, layer: int) -> int:
  return int(learner.model_state["routing"][moe.layer_name(layer)]["active"].shape[0])


def _split_layer(lp: dict, stats, e, leaf, gate, key, *, flat: bool, feat_dim: int, scheme: str,
                 slots: int) -> tuple[dict, Any]:
  """Layer params `lp` and BatchNorm statistics `stats` (or None) of a split (see
  `split_expert`): held in `slots` slots, expert `leaf` copied into slot `e`, a new gate at
  `gate` (tree gating) or a new gate column `e` (flat)."""
  lp = _resize_gates(lp, flat, feat_dim, slots)
  lp["experts"] = slots_lib.copy_slot(slots_lib.resize(lp["experts"], slots), e, leaf)
  if stats is not None:
    stats = slots_lib.copy_slot(slots_lib.resize(stats, slots), e, leaf)
  if flat:
    g = lp["gate"]
    column, bias = moe.init_gate(key, feat_dim, 1, scheme)
    lp["gate"] = {"kernel": slots_lib.set_slot(g["kernel"].T, column[:, 0], e).T,
                  "bias": slots_lib.set_slot(g["bias"], bias[0], e)}
  else:
    kernel, bias = moe.init_gate(key, feat_dim, 2, scheme)
    g = lp["gates"]
    lp["gates"] = {"kernel": slots_lib.set_slot(g["kernel"], kernel, gate),
                   "bias": slots_lib.set_slot(g["bias"], bias, gate)}
  return lp, stats


def _split_in_slots(lps: tuple, stats: tuple, e, leaf, gate, keys, *, flat: tuple[bool, ...],
                    feat_dims: tuple[int, ...], scheme: str,
                    slots: tuple[int, ...]) -> tuple[tuple, tuple]:
  """`_split_layer` of several layers (the i-th of each argument) as one program. Slot
  indices are arguments, so every growth between the same slots runs one program."""
  out = [_split_layer(lps[i], stats[i], e[i], leaf[i], gate[i], keys[i], flat=flat[i],
                      feat_dim=feat_dims[i], scheme=scheme, slots=slots[i])
         for i in range(len(lps))]
  return tuple(o[0] for o in out), tuple(o[1] for o in out)


# The layers' new gates drawn by one hash (`fused_draws`).
_split_in_slots = executables.jit(fused_draws.fuse_draws(_split_in_slots), "_split_in_slots",
                                  once=True,
                                  static_argnames=("flat", "feat_dims", "scheme", "slots"))


def split_experts(state: base.Learner, leaves: dict[int, int], keys: dict[int, jax.Array],
                  scheme: str = "lecun", slots: dict[int, int] | None = None) -> base.Learner:
  """`split_expert` of several mixture layers at once (`leaves`: layer -> the expert it
  splits; `keys`: layer -> the key of its new gate; `slots`: layer -> its slots after the
  split, None as in `split_expert`), as one compiled program per layer shapes and slots."""
  structure, layers = list(state.structure), sorted(leaves)
  if not layers:
    return state
  args, sizes = [], []
  for layer in layers:
    if not 0 <= layer < len(structure):
      raise ValueError(f"layer {layer} is not a mixture layer; the learner has "
                       f"{len(structure)}")
    feat_dim, tree = structure[layer]
    new_tree = moe.split_leaf(tree, leaves[layer])  # checks that the expert is a leaf
    e = moe.num_experts(tree)
    size = (slots or {}).get(layer)
    if size is None:
      current = num_slots(state, layer)
      size = current if e < current else slots_lib.next_power_of_two(e + 1)
    sizes.append(max(int(size), e + 1))
    name = moe.layer_name(layer)
    args.append((dict(state.params[name]), state.model_state.get("batch_stats", {}).get(name),
                 np.int32(e), np.int32(leaves[layer]), np.int32(moe.num_gates(tree)),
                 keys[layer], int(feat_dim), moe.is_flat(tree)))
    structure[layer] = (feat_dim, new_tree)
  lps, stats, e, leaf, gate, key, feat_dims, flat = (tuple(a) for a in zip(*args))
  lps, stats = _split_in_slots(lps, stats, e, leaf, gate, key, flat=flat,
                               feat_dims=feat_dims, scheme=scheme, slots=tuple(sizes))
  params, model_state = dict(state.params), dict(state.model_state)
  routing, batch_stats = dict(model_state["routing"]), dict(model_state.get("batch_stats", {}))
  for i, layer in enumerate(layers):
    name = moe.layer_name(layer)
    params[name] = lps[i]
    if stats[i] is not None:
      batch_stats[name] = stats[i]
    routing[name] = jax.device_put(moe.tree_arrays(structure[layer][1], sizes[i]))
  model_state["routing"] = routing
  if batch_stats:
    model_state["batch_stats"] = batch_stats
  return base.Learner(params=params, model_state=model_state, structure=tuple(structure))


def split_expert(state: base.Learner, layer: int, leaf: int, key: jax.Array,
                 scheme: str = "lecun", slots: int | None = None) -> base.Learner:
  """Splits expert `leaf` of mixture layer `layer` into two (eq. 3 of the paper).

  Tree gating: the leaf becomes an internal node with a new gate (drawn from
  `key` by `scheme`: LeCun-normal kernel and zero bias, or PyTorch's Linear
  default, see `alma_jax.models.moe.init_gate`); its children are the old expert (left)
  and an exact copy of it (right), written into the next free slot together
  with a copy of its BatchNorm statistics. As the two children are equal, the
  network computes the same function before and after the split, for any
  value of the new gate, with soft and hard gating alike.

  Flat gating (ablation): the copy is added as a new output of the single
  softmax gate (a new random kernel column, zero bias); this changes the
  weights of all experts, so the function changes.

  A split inside the layer's slots edits values and routing arrays only (the
  shapes, hence the compiled programs, stay); a full layer first grows to
  `slots` slots. The edit is one compiled program per layer shapes and slots
  (`split_experts` splits several layers in one).

  Args:
    state: the learner (not modified).
    layer: index of the mixture layer (0 = the first mixture).
    leaf: the expert to split (its index on the stacked axis).
    key: PRNG key of the new gate.
    scheme: the initialisation of the new gate ("lecun" or "torch").
    slots: the layer's slots after the split (None: unchanged while one is
      free, else the next power of two).

  Returns:
    A new learner with one more expert (and one more gate) in `layer`.
  """
  return split_experts(state, {layer: leaf}, {layer: key}, scheme, {layer: slots})


def active_view(learner: base.Learner) -> base.Learner:
  """The learner with every layer cut to its active experts (no padding slots)."""
  for layer, (_, tree) in enumerate(learner.structure):
    learner = resize_layer(learner, layer, moe.num_experts(tree))
  return learner


# -- the method ------------------------------------------------------------------------------------
def planned_stages(config) -> int:
  """The stages the run's waiting policy plans over its mega-batches."""
  return len(policies.make_wait(config).planned_times(config.stream.num_megabatches))


def slot_rule(config) -> str:
  """`method.slots` when left to be chosen (`auto`): `planned` for a growing gMoE on an
  accelerator in a run of fewer than `config_lib.SHORT_RUN_STEPS` planned train steps, else
  `pow2`. In planned slots the growth keeps one structure, so the run compiles one train step
  and one evaluation instead of one per power of two. Where a compile costs most of a short
  run and padding experts next to nothing (P4's MLP on a GPU), that is the faster run;
  XLA:GPU's compile of P4's programs, run on a CPU for an H200 (benchmarks/README.md, "gMoE's
  expert slots on a GPU"), took 25.5 and 28.1 s in power-of-two slots (38 programs), 5.8 and
  5.9 s in planned ones (8). A CPU computes the padding for real and compiles fast, and a long
  run amortises its compiles: both keep pow2. Records differ from pow2's in float round-off
  only."""
  if jax.default_backend() == "cpu" or config_lib.short_run_steps(config) is None:
    return "pow2"
  grows = (expert_growth.has_own_experts(config.model)
           or declared.GMoE.growth_period(config, planned_stages(config)) is not None)
  return "planned" if grows else "pow2"


@register
class GrowingMoE(declared.GMoE, base.Method):
  """Tree-gated mixture of experts that splits its losing expert after each stage."""

  same_growth_for_every_seed = False  # splits follow each seed's data
  # The stacked experts of a mixture layer and their BatchNorm statistics.
  LEAF_AXES = ((r"\['experts'\]", ("expert",)), (r"\['batch_stats'\]\['mix\d+'\]", ("expert",)))

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    o = self.opts
    if o.max_experts and o.max_experts < o.initial_experts:
      raise ConfigError(
          f"config.method.max_experts={o.max_experts} is below config.method.initial_experts="
          f"{o.initial_experts}; use 0 (no limit) or at least {o.initial_experts}")
    if o.slots == "max" and not o.max_experts:
      raise ConfigError("config.method.slots='max' needs config.method.max_experts > 0; "
                        f"allowed values of config.method.slots: {list(SLOTS)}")
    # `auto` decided here when the run's speed choices have not decided it (a method built
    # from a config directly): the same rule.
    self.slot_policy = o.slots if o.slots != "auto" else slot_rule(config)
    self._slot_bound = (declared.GMoE.planned_experts(config, planned_stages(config))
                        if self.slot_policy == "planned" else o.max_experts)
    # The backbone's own expert layers, grown by copying experts (None: gated mixtures).
    self.own = (expert_growth.OwnExperts(self) if expert_growth.has_own_experts(config.model)
                else None)
    if self.own is not None:
      self.refuse_kept_optimizer_state("a growth changes the parameter shapes")
      self.LEAF_AXES = self.own.leaf_axes  # pylint: disable=invalid-name
      return
    if o.grow:
      self.refuse_kept_optimizer_state("a split changes the parameter shapes",
                                       " with config.method.grow=True")
    self.net = moe.make_net(config.model, num_classes, o.gate_pool)
    self._feat_dims: list[int] | None = None
    self._route_fns: dict[Hashable, object] = {}

  @property
  def hard(self) -> bool:
    return self.opts.gating == "hard"

  # -- construction ---------------------------------------------------------------------------
  def initial_structure(self) -> tuple:
    if self._feat_dims is None:
      self._feat_dims = self.net.gate_feature_dims(self.input_shape)
    tree = moe.balanced_tree(self.opts.initial_experts, flat=not self.opts.tree)
    return tuple((f, tree) for f in self._feat_dims)

  def check_structure(self, structure) -> None:
    ok = isinstance(structure, tuple) and len(structure) == len(self.net.experts)
    if ok:
      for (f, tree), (f0, _) in zip(structure, self.initial_structure()):
        moe.check_tree(tree)
        ok = ok and f == f0 and moe.is_flat(tree) == (not self.opts.tree)
    if not ok:
      raise ValueError(f"structure {structure!r} does not fit gmoe with config.model.name="
                       f"{self.config.model.name!r} ({len(self.net.experts)} mixture layers) "
                       f"and config.method.tree={self.opts.tree}")

  def slots(self, experts: int) -> int:
    """The expert slots of a layer (a block) with `experts` experts (`method.slots`:
    planned holds the planned experts as max holds max_experts, and more if a layer ever
    outgrew them)."""
    policy = "max" if self.slot_policy == "planned" else self.slot_policy
    return slots_lib.capacity(experts, policy, self._slot_bound)

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    if self.own is not None:
      return self.own.init(key, structure)
    if structure is None or structure == ():
      structure = self.initial_structure()
    self.check_structure(structure)
    slots = tuple(self.slots(n) for n in experts_per_layer(structure))
    params, model_state = moe.jitted_init(self.net, structure, self.input_shape, slots)(key)
    return base.Learner(params=params, model_state=model_state, structure=structure)

  def program_structure(self, structure) -> Hashable:
    """Each layer's gate features and slots: ("slots", C) or, flat, ("flat", C); the
    tree itself is in the routing arrays."""
    if self.own is not None:
      return self.own.program_structure(structure)
    out = []
    for f, tree in structure:
      if moe.is_flat(tree):
        out.append((f, (moe.FLAT, self.slots(tree[1]))))
      elif isinstance(tree, tuple) and tree[:1] == ("slots",):
        out.append((f, tree))
      else:
        out.append((f, ("slots", self.slots(moe.num_experts(tree)))))
    return tuple(out)

  def program_change(self, old, new) -> str:
    slots = lambda s: [tree[1] for _, tree in s if isinstance(tree, tuple) and len(tree) == 2]
    if self.own is None and len(old) == len(new) and [f for f, _ in old] == [f for f, _ in new]:
      return f"new slot count: {slots(old)} -> {slots(new)} expert slots per mixture layer"
    return super().program_change(old, new)

  def active_view(self, learner: base.Learner) -> base.Learner:
    """The learner without padding slots, as shapes (`jax.ShapeDtypeStruct` leaves)."""
    if self.own is not None:
      return jax.eval_shape(self.own.active_view, learner)
    return jax.eval_shape(active_view, learner)

  # -- hidden units (`alma_jax.models.units`) ---------------------------------------------------
  @functools.cache
  def unit_layout(self):
    """The hidden layers that the backbone's mixtures declare (`Mixture.expert_units`,
    `stem_units`), in order: the stem's, then per mixture its experts' inner layers, each
    slotted (every expert slot's units, slot-major: the next layer of an expert reads only
    its own), and the mixture's output channels (the last layer of every expert: a reset
    re-draws channel j in every slot, since a split overwrites a slot whole, and zeroes
    row j of every kernel that reads the mixture: the next mixture's experts and gates,
    at every position a gate pools, or the classifier). None where the backbone declares
    none, or its layers are experts of their own (the Switch Transformer)."""
    if self.own is not None or self.net.expert_units is None:
      return None
    parts = [] if self.net.stem_units is None else [self.net.stem_units.within(("stem",))]
    gates = {}  # the first layer of each mixture -> the kernels of its gates
    for l, layout in enumerate(self.net.expert_units):
      name = moe.layer_name(l)
      gates[sum(p.num_layers for p in parts)] = ((name, "gates", "kernel"),
                                                 (name, "gate", "kernel"))
      parts.append(dataclasses.replace(layout.within((name, "experts"), (name,)),
                                       slotted=(True,) * (layout.num_layers - 1) + (False,)))
    joined = backbones.joined(parts, head=("head", "dense", "kernel"))
    return dataclasses.replace(  # a mixture's gates read the layer before it
        joined, units=(),  # `hidden_units` reads them from the mixtures
        readers=tuple(gates.get(l + 1, ()) for l in range(joined.num_layers)))

  def hidden_units(self, structure, params, model_state, x) -> list:
    """The outputs of `unit_layout`'s layers on `x` (inference, the method's gating)."""
    if self.unit_layout() is None:
      return base.Method.hidden_units(self, structure, params, model_state, x)  # raises
    hidden = []
    moe.apply(self.net, structure, params, model_state, x, train=False, hard=self.hard,
              hidden=hidden)
    return hidden

  def unit_active(self, learner: base.Learner) -> list[np.ndarray] | None:
    """The units of active expert slots (a slotted layer's padding slots are not units);
    every channel of a stem layer or of a mixture's output."""
    layout = self.unit_layout()
    if layout is None or not any(layout.slotted):
      return None
    experts = {moe.layer_name(l): moe.num_experts(tree)
               for l, (_, tree) in enumerate(learner.structure)}
    out = []
    for l, path in enumerate(layout.kernels):
      shape = np.shape(backbones.leaf_at(learner.params, path))
      out.append(np.repeat(np.arange(shape[0]) < experts[path[0]], shape[-1])
                 if layout.is_slotted(l) else np.ones(shape[-1], bool))
    return out

  def unit_outgoing(self, learner: base.Learner, layer: int) -> np.ndarray:
    """`Method.unit_outgoing` of the active experts and gates: a mixture's output channel is
    read by the active experts and gates of the next mixture (a padding slot holds a copy of
    slot 0 that nothing reads); a slotted unit by its own slot's next layer."""
    layout = self.unit_layout()
    view = learner if layout.is_slotted(layer) else active_view(learner)
    return units.outgoing_weight(layout, view.params, layer)

  # -- training and inference -------------------------------------------------------------------
  def forward(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """(logits, new model_state, [leaf weights (b, E) per mixture layer])."""
    return moe.apply(self.net, structure, params, model_state, x, train=train, hard=self.hard,
                     mask=mask, rng=rng)

  def outputs(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    if self.own is not None:
      return self.own.outputs(structure, params, model_state, x, train=train, mask=mask,
                              rng=rng)
    logits, new_state, _ = self.forward(structure, params, model_state, x, train=train,
                                        mask=mask, rng=rng)
    return logits, {}, new_state

  # -- inspection -----------------------------------------------------------------------------
  def gating_tree(self, learner: base.Learner, layer: int) -> dict:
    return gating_tree(learner, layer)

  def routing_weights(self, learner: base.Learner, x) -> list[jnp.ndarray]:
    """Test-time leaf weights (b, E) of every mixture layer for normalised inputs `x`."""
    structure = learner.structure
    key = self.program_structure(structure)
    if key not in self._route_fns:
      self._route_fns[key] = jax.jit(lambda p, s, x: self.forward(key, p, s, x, train=False)[2])
    weights = self._route_fns[key](learner.params, learner.model_state, jnp.asarray(x))
    return [w[:, :e] for w, e in zip(weights, experts_per_layer(structure))]  # no padding

  def route(self, learner: base.Learner, x, layer: int) -> np.ndarray:
    """The expert (leaf) of each example in mixture layer `layer`: the leaf reached by
    following the more probable child at every gate (for hard gating, the expert that runs at
    test time). Splits keep these assignments within the split expert's subtree, so they
    partition the inputs along the tree (early version, Fig. 5). `x`: normalised inputs."""
    tree = learner.structure[layer][1]
    return np.asarray(moe.greedy_leaf(tree, self.routing_weights(learner, x)[layer]))

  # -- growth -----------------------------------------------------------------------------------
  def eval_aux(self, structure, params, model_state, x, y, mask, task):
    """Per-slot growth scores (`split_by`) of one batch, for every mixture layer (padding
    slots score 0). Every evaluation computes them (`evaluate_batch`, from the prediction's
    forward pass), so scoring adds no program of its own."""
    if self.own is not None:  # scored by a pass of its own (`expert_growth`)
      return ()
    return self.evaluate_batch(structure, params, model_state, x, y, mask, task)[2]

  def evaluate_batch(self, structure, params, model_state, x, y, mask, task):
    """The prediction (one unit: the whole model) and the growth scores of one forward pass."""
    if self.own is not None:
      return super().evaluate_batch(structure, params, model_state, x, y, mask, task)
    logits, _, weights = self.forward(structure, params, model_state, x, train=False)
    logp = jax.nn.log_softmax(logits)
    _, nll = task.per_example(logp, y)
    return logp, logp[None], [expert_scores(w, nll, mask, self.opts.split_by) for w in weights]

  @property
  def grow_period(self) -> int | None:
    """Stages between growths (`grow_every`, or its automatic value; None: no growth)."""
    return self.growth_period(self.config, planned_stages(self.config))

  def should_grow(self, stage: int) -> bool:
    """Whether to grow before training stage number `stage` (1 = the first: never)."""
    period = self.grow_period
    return period is not None and declared.grows_before(stage, period)

  def grow_learner(self, learner: base.Learner, scores, key: jax.Array) -> base.Learner:
    """Splits the losing expert (arg-max of `scores[l]`) of every layer below `max_experts`."""
    leaves, keys, slots = {}, {}, {}
    for layer, layer_scores in enumerate(scores):
      e = moe.num_experts(learner.structure[layer][1])
      if self.opts.max_experts and e >= self.opts.max_experts:
        continue
      leaves[layer] = losing_expert(np.asarray(layer_scores)[:e])
      keys[layer] = host_random.fold_in(key, layer)
      slots[layer] = self.slots(e + 1)
    return split_experts(learner, leaves, keys, self.net.init_scheme, slots)

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    """Splits the losing experts, scored on the new stage's validation data, before it trains."""
    if self.own is not None:
      return self.own.before_stage(learner, key, ctx)
    if not self.should_grow(ctx.stage):
      return learner
    scores = ctx.eval_aux(learner, np.asarray(ctx.val_idx, np.int32))
    return self.grow_learner(learner, [np.asarray(s, np.float64) for s in scores], key)

  # -- accounting -------------------------------------------------------------------------------
  def describe(self, learner: base.Learner) -> dict:
    if self.own is not None:
      return self.own.describe(learner)
    structure = learner.structure
    return {"num_params": self.num_params(learner),
            "experts": experts_per_layer(structure),
            "gates": [moe.num_gates(tree) for _, tree in structure]}
