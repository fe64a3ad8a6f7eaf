"""gMoE: a growing, tree-gated mixture of experts (paper section 4.2, Appendix A).

MLP: both hidden layers are mixtures (the classifier is shared). VGG: the
blocks after the first are mixtures (the first block and the classifier are
shared); a block's gate sees its input average-pooled to 4x4.

After every `grow_every`-th training stage, each mixture layer splits its
losing expert (`alma_jax.surgery.split_expert`), chosen on the stage's
validation data by `split_by`: "loss" (the largest cumulative loss of the
examples routed through it, weighted by the routing weight; the paper) or
"usage" (the largest cumulative routing weight; the released code).

Config fields (`config.method.*`; missing ones take `DEFAULTS`):
  gating: "soft" (weighted sum over all experts) or "hard" (one expert per
    example: sampled with a straight-through gradient in training, greedy at
    test time).
  tree: True (binary gating tree, function-preserving splits) or False (the
    "flat" ablation: one softmax over all experts).
  grow: False gives the fixed-MoE ablation (`initial_experts` experts).
  initial_experts: experts per layer at the start (paper: 1; released: 2).
  grow_every: grow after every this many training stages.
  split_by: "loss" or "usage".
  gate_pool: side of the average pool of a VGG block's gate input.
  max_experts: stop splitting a layer at this many experts (0: no limit).

Compute: soft gating and hard gating in training run every expert. Hard
gating at test time runs only the chosen expert of each example for the MLP
(its parameters are gathered per example, so the inference FLOPs are those
of one path); for VGG all experts run and the chosen output is selected
(per-example conv kernels would need a batch-sized grouped convolution), so
its inference FLOPs count every expert.
"""

from __future__ import annotations

from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax import growth_moe
from alma_jax import surgery
from alma_jax import validation
from alma_jax.data import augment
from alma_jax.methods import base
from alma_jax.methods import register
from alma_jax.models import moe

DEFAULTS = {"gating": "soft", "tree": True, "grow": True, "initial_experts": 1, "grow_every": 1,
            "split_by": "loss", "gate_pool": 4, "max_experts": 0}
GATINGS = ("soft", "hard")
SPLIT_BY = ("loss", "usage")

# The field checks of alma_jax.validation, so that messages read the same everywhere.
_choice = validation._choice  # pylint: disable=protected-access
_bool = validation._bool  # pylint: disable=protected-access
_int = validation._int  # pylint: disable=protected-access


def gating_tree(learner: base.Learner, layer: int) -> dict:
  """The gating tree of mixture layer `layer` as nested dicts, for drawing.

  Internal nodes are `{"gate": g, "children": [left, right]}` (flat gating:
  one node with all experts as children), leaves `{"expert": e}`.
  """
  return moe.tree_dict(learner.structure[layer][1])


def experts_per_layer(structure) -> list[int]:
  return [moe.num_experts(tree) for _, tree in structure]


@register
class GrowingMoE(base.Method):
  """Tree-gated mixture of experts that splits its losing expert after each stage."""

  name = "gmoe"

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    self.config = config
    self.input_shape = tuple(input_shape)
    self.num_classes = num_classes
    c, d = config, DEFAULTS
    self.gating = _choice(c, "method.gating", GATINGS, default=d["gating"])
    self.tree = _bool(c, "method.tree", default=d["tree"])
    self.grow = _bool(c, "method.grow", default=d["grow"])
    self.initial_experts = _int(c, "method.initial_experts", 1, default=d["initial_experts"])
    self.grow_every = _int(c, "method.grow_every", 1, default=d["grow_every"])
    self.split_by = _choice(c, "method.split_by", SPLIT_BY, default=d["split_by"])
    self.gate_pool = _int(c, "method.gate_pool", 1, default=d["gate_pool"])
    self.max_experts = _int(c, "method.max_experts", 0, default=d["max_experts"])
    if self.max_experts and self.max_experts < self.initial_experts:
      raise validation.ConfigError(
          f"config.method.max_experts={self.max_experts} is below config.method.initial_experts="
          f"{self.initial_experts}; use 0 (no limit) or at least {self.initial_experts}")
    if self.grow and bool(c.train.get("keep_optimizer_state", False)):
      raise validation.ConfigError(
          "config.train.keep_optimizer_state=True is not supported by gmoe with "
          "config.method.grow=True: a split changes the parameter shapes; allowed values: [False]")
    self.net = moe.make_net(c.model, num_classes, self.gate_pool)
    self._feat_dims: list[int] | None = None
    self._score_fns: dict[Hashable, object] = {}
    self._route_fns: dict[Hashable, object] = {}

  @property
  def hard(self) -> bool:
    return self.gating == "hard"

  # -- construction ---------------------------------------------------------------------------
  def initial_structure(self) -> tuple:
    if self._feat_dims is None:
      self._feat_dims = self.net.gate_feature_dims(self.input_shape)
    tree = moe.balanced_tree(self.initial_experts, flat=not self.tree)
    return tuple((f, tree) for f in self._feat_dims)

  def check_structure(self, structure) -> None:
    ok = isinstance(structure, tuple) and len(structure) == len(self.net.experts)
    if ok:
      for (f, tree), (f0, _) in zip(structure, self.initial_structure()):
        moe.check_tree(tree)
        ok = ok and f == f0 and moe.is_flat(tree) == (not self.tree)
    if not ok:
      raise ValueError(f"structure {structure!r} does not fit gmoe with config.model.name="
                       f"{self.config.model.name!r} and config.method.tree={self.tree}")

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    if structure is None or structure == ():
      structure = self.initial_structure()
    self.check_structure(structure)
    params, model_state = moe.jitted_init(self.net, structure, self.input_shape)(key)
    return base.Learner(params=params, model_state=model_state, structure=structure)

  # -- training and inference -------------------------------------------------------------------
  def forward(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """(logits, new model_state, [leaf weights (b, E) per mixture layer])."""
    return moe.apply(self.net, structure, params, model_state, x, train=train, hard=self.hard,
                     mask=mask, rng=rng)

  def apply_backbone(self, params, model_state, x, *, train: bool, mask=None):
    raise NotImplementedError("gmoe needs the learner's structure: use GrowingMoE.forward")

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    del frozen
    logits, new_state, _ = self.forward(structure, trainable, model_state, x[0], train=True,
                                        mask=mask[0], rng=rng)
    return base.masked_cross_entropy(logits, y[0], mask[0]), new_state

  def predict(self, structure, params, model_state, x) -> jnp.ndarray:
    logits, _, _ = self.forward(structure, params, model_state, x, train=False)
    return jax.nn.log_softmax(logits)

  # -- inspection -----------------------------------------------------------------------------
  def gating_tree(self, learner: base.Learner, layer: int) -> dict:
    return gating_tree(learner, layer)

  def routing_weights(self, learner: base.Learner, x) -> list[jnp.ndarray]:
    """Test-time leaf weights (b, E) of every mixture layer for normalised inputs `x`."""
    structure = learner.structure
    if structure not in self._route_fns:
      self._route_fns[structure] = jax.jit(lambda p, s, x: self.forward(
          structure, p, s, x, train=False)[2])
    return self._route_fns[structure](learner.params, learner.model_state, jnp.asarray(x))

  def route(self, learner: base.Learner, x, layer: int) -> np.ndarray:
    """The expert (leaf) of each example in mixture layer `layer`: the leaf reached by
    following the more probable child at every gate (for hard gating, the expert that runs at
    test time). Splits keep these assignments within the split expert's subtree, so they
    partition the inputs along the tree (early version, Fig. 5). `x`: normalised inputs."""
    tree = learner.structure[layer][1]
    return np.asarray(moe.greedy_leaf(tree, self.routing_weights(learner, x)[layer]))

  # -- growth -----------------------------------------------------------------------------------
  def _score_fn(self, structure):
    if structure not in self._score_fns:
      split_by = self.split_by

      def scores(params, model_state, data_x, data_y, mean, std, idx, mask):
        x = augment.prepare_batch(data_x[idx], mean, std, augment="none", rng=None)
        logits, _, weights = self.forward(structure, params, model_state, x, train=False)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), data_y[idx][:, None], -1)[:, 0]
        return [growth_moe.expert_scores(w, nll, mask, split_by) for w in weights]

      self._score_fns[structure] = jax.jit(scores)
    return self._score_fns[structure]

  def expert_scores(self, learner: base.Learner, trainer, idx: np.ndarray) -> list[np.ndarray]:
    """Cumulative per-expert scores (`split_by`) of every mixture layer on training examples
    `idx` (the stage's validation examples)."""
    fn = self._score_fn(learner.structure)
    d = trainer.data
    b = int(self.config.train.eval_batch_size)
    total = [np.zeros(n) for n in experts_per_layer(learner.structure)]
    for s in range(0, len(idx), b):
      part = np.zeros((b,), np.int32)
      part[:len(idx[s:s + b])] = idx[s:s + b]
      mask = np.arange(b) < len(idx[s:s + b])
      out = fn(learner.params, learner.model_state, d.train_x, d.train_y, d.mean, d.std,
               jnp.asarray(part), jnp.asarray(mask))
      total = [t + np.asarray(o, np.float64) for t, o in zip(total, out)]
    return total

  def should_grow(self, t: int) -> bool:
    """Whether to grow after the training stage at time step `t`."""
    if not self.grow:
      return False
    stage = t // int(self.config.stream.get("wait", 1))
    return stage % self.grow_every == 0

  def grow_learner(self, learner: base.Learner, scores, key: jax.Array) -> base.Learner:
    """Splits the losing expert (arg-max of `scores[l]`) of every layer below `max_experts`."""
    for layer, layer_scores in enumerate(scores):
      if self.max_experts and len(layer_scores) >= self.max_experts:
        continue
      leaf = growth_moe.losing_expert(layer_scores)
      learner = surgery.split_expert(learner, layer, leaf, jax.random.fold_in(key, layer))
    return learner

  def after_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    if not self.should_grow(ctx.t):
      return learner
    scores = self.expert_scores(learner, ctx.trainer, np.asarray(ctx.val_idx, np.int32))
    return self.grow_learner(learner, scores, key)

  # -- accounting -------------------------------------------------------------------------------
  def describe(self, learner: base.Learner) -> dict:
    structure = learner.structure
    return {"num_params": self.num_params(learner),
            "experts": experts_per_layer(structure),
            "gates": [moe.num_gates(tree) for _, tree in structure]}
