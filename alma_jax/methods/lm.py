"""The methods on text (paper section 5 and 6.2): Switch Transformers grown or ensembled.

  lm_sm:   one Switch Transformer with E experts per block (`config.model`).
  lm_ens:  Ens E@N, N Switch Transformers trained independently (each with
           its own data order); prediction: the mean of their probabilities.
  lm_gens: gEns, one E-expert model at the first stage, one more (a copy of
           the last, or fresh) before every later stage; only the new one
           trains.
  lm_gmoe: gMoE for language models: before every later stage, every block
           copies its `grow_by` experts with the largest validation loss
           routed to them (`copy_experts`), e.g. 4 -> 6 -> 8 experts.

They share the ensemble machinery of `alma_jax.methods.ensemble` (stacked
members, frozen old members, best epoch per member); the training loss of a
model is its mean next-token cross-entropy plus `config.model.balance_weight`
times the load-balancing loss summed over blocks.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from alma_jax import fields as F
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods import ensemble
from alma_jax.methods.registry import register
from alma_jax.models import switch

EXPERT_AXES = ((r"\['expert_", ("expert",)),)  # the stacked experts of every block


def token_loss(logits, y, mask) -> jax.Array:
  """Mean next-token cross-entropy over the sequences where `mask` (b,) is true."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
  m = jnp.broadcast_to(mask[:, None], ce.shape).astype(ce.dtype)
  return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)


class LanguageModel(base.SingleBackbone):
  """Mixin: a Switch Transformer (`alma_jax.models.switch`) over sequences of L tokens."""

  task = "text"

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    if config.model.name != "switch":
      raise ConfigError(f"config.model.name={config.model.name!r} cannot model text; valid "
                        "values: ['switch']")
    self._nets: dict[int, switch.SwitchTransformer] = {}
    self._inits: dict[int, object] = {}
    self.backbone = self.net(int(config.model.num_experts))
    self.balance_weight = float(config.model.get("balance_weight", 0.01))

  def net(self, num_experts: int) -> switch.SwitchTransformer:
    """The model with `num_experts` experts per block."""
    if num_experts not in self._nets:
      self._nets[num_experts] = switch.SwitchTransformer.from_config(
          self.config.model, self.num_classes, max_len=self.input_shape[0],
          num_experts=num_experts)
    return self._nets[num_experts]

  def init_net(self, key: jax.Array, num_experts: int):
    """(params, model_state {}) of a model with `num_experts` experts (one compiled program)."""
    if num_experts not in self._inits:
      net, dummy = self.net(num_experts), np.zeros((1,) + self.input_shape, np.int32)
      self._inits[num_experts] = jax.jit(lambda k: net.init(k, dummy)["params"])
    return self._inits[num_experts](key), {}

  def init_backbone(self, key: jax.Array):
    return self.init_net(key, self.backbone.num_experts)

  def apply_backbone(self, params, model_state, x, *, train: bool, mask=None):
    """Logits (b, L, V) of the configured model (members of an ensemble)."""
    logits, _ = self.backbone.apply({"params": params}, x, train=train, mask=mask)
    return logits, model_state

  def lm_loss(self, net, params, x, y, mask) -> jax.Array:
    """Cross-entropy plus the weighted load-balancing loss of one model."""
    logits, aux = net.apply({"params": params}, x, train=True, mask=mask)
    return token_loss(logits, y, mask) + self.balance_weight * aux["balance"]


@register
class LMSingle(LanguageModel, base.Method):
  """SM: one Switch Transformer with config.model.num_experts experts per block."""

  name = "lm_sm"
  LEAF_AXES = EXPERT_AXES

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    del structure
    params, model_state = self.init_backbone(key)
    return base.Learner(params=params, model_state=model_state, structure=())

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    del structure, frozen, rng
    return self.lm_loss(self.backbone, trainable, x[0], y[0], mask[0]), model_state

  def predict(self, structure, params, model_state, x):
    del structure
    logits, _ = self.apply_backbone(params, model_state, x, train=False)
    return jax.nn.log_softmax(logits)


def _members_loss(method, structure, trainable, model_state, x, y, mask):
  """Sum over the trained members of each one's loss on its own data order."""
  del structure
  losses = ensemble.map_members(lambda p, xi, yi, mi: method.lm_loss(method.backbone, p, xi, yi, mi),
                                (trainable, x, y, mask), method.run_as)
  return jnp.sum(losses), model_state


@register
class LMEnsemble(LanguageModel, ensemble.Ensemble):
  """Ens E@N: N Switch Transformers of E experts, trained independently."""

  name = "lm_ens"
  LEAF_AXES = ((r"\['expert_", ("member", "expert")), ("", ("member",)))

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    del frozen, rng
    return _members_loss(self, structure, trainable, model_state, x, y, mask)


@register
class LMGrowingEnsemble(LanguageModel, ensemble.GrowingEnsemble):
  """gEns: one more E-expert Switch Transformer before every stage but the first."""

  name = "lm_gens"
  LEAF_AXES = LMEnsemble.LEAF_AXES

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    del frozen, rng
    return _members_loss(self, structure, trainable, model_state, x, y, mask)


# -- gMoE for language models: copy the losing experts ----------------------------------------
def _blocks(params) -> list[str]:
  return sorted((k for k in params if k.startswith("block")), key=lambda k: int(k[5:]))


def copy_experts(state: base.Learner, experts: Sequence[int] | Sequence[Sequence[int]],
                 key: jax.Array, noise: float = 0.0) -> base.Learner:
  """Appends a copy of `experts` (their weights and router columns) to every block.

  Args:
    state: a Switch Transformer learner whose structure is `(num_experts,)`
      (not modified).
    experts: the experts to copy: one list for every block, or a list per
      block (the same length for all); distinct indices.
    key: PRNG key of the perturbation.
    noise: standard deviation of a Gaussian perturbation of the copies'
      router columns (0: none).

  Returns:
    A learner with `num_experts + k` experts per block: the copies are
    appended on the expert axis. The router bias of every copied expert and
    of its copy is lowered by log 2, so the router probabilities of all other
    experts are unchanged and the pair's sum is the original's; with `noise`
    0 the pair's logits tie, so the router treats them as one expert
    (`alma_jax.models.switch.route`): the tokens keep their expert and scale,
    and the layer computes the same function.
  """
  blocks = _blocks(state.params)
  (num,) = state.structure
  per_block = [list(experts)] * len(blocks) if all(
      isinstance(e, (int, np.integer)) for e in experts) else [list(e) for e in experts]
  if len(per_block) != len(blocks) or len({len(e) for e in per_block}) != 1:
    raise ValueError(f"copy_experts: expected one list of experts, or one per block "
                     f"({len(blocks)}) of the same length; got {experts!r}")
  for e in per_block:
    if len(set(e)) != len(e) or not all(0 <= int(i) < num for i in e):
      raise ValueError(f"copy_experts: experts {e} must be distinct indices in [0, {num})")
  params = dict(state.params)
  for b, (name, idx) in enumerate(zip(blocks, per_block)):
    idx = jnp.asarray(idx, jnp.int32)
    moe = dict(params[name]["moe"])
    for leaf in [k for k in moe if k.startswith("expert_")]:
      moe[leaf] = jnp.concatenate([moe[leaf], moe[leaf][idx]], axis=0)
    kernel = moe["router_kernel"]
    cols = kernel[:, idx]
    if noise:
      cols = cols + noise * jax.random.normal(jax.random.fold_in(key, b), cols.shape, cols.dtype)
    moe["router_kernel"] = jnp.concatenate([kernel, cols], axis=1)
    bias = moe["router_bias"].at[idx].add(-math.log(2.0))
    moe["router_bias"] = jnp.concatenate([bias, bias[idx]])
    params[name] = {**params[name], "moe": moe}
  return base.Learner(params=params, model_state=state.model_state,
                      structure=(num + len(per_block[0]),))


def expert_losses(experts: jax.Array, nll: jax.Array, mask: jax.Array,
                  num_experts: int) -> jax.Array:
  """(blocks, E): the summed token NLL routed to each expert of each block.

  `experts` (blocks, b, L) the routed expert of every token, `nll` (b, L),
  `mask` (b,) the real sequences.
  """
  w = nll * mask[:, None].astype(nll.dtype)
  return jnp.einsum("nble,bl->ne", jax.nn.one_hot(experts, num_experts, dtype=nll.dtype), w)


@register
class LMGrowingMoE(LanguageModel, base.Method):
  """gMoE-LM: a flat Switch mixture that copies its losing experts before every later stage."""

  name = "lm_gmoe"
  same_growth_for_every_seed = False  # the copied experts follow each seed's data
  LEAF_AXES = EXPERT_AXES
  FIELDS = (
      F.Field("method.initial_experts", 4, F.integer(1), "experts per block at the start"),
      F.Field("method.grow_by", 2, F.integer(1),
              "k, experts copied per block at a growth (paper: 2 to 4)"),
      F.Field("method.grow_schedule", "2,2,4", F.integer_list(1),
              "k of the first growths, comma-separated; later growths copy `grow_by` "
              "(paper Table 2: '2,2,4', 4 -> 6 -> 8 -> 12 experts; '': `grow_by` always)"),
      F.Field("method.grow_every", 1, F.integer(1), "grow before every this many-th stage"),
      F.Field("method.max_experts", 0, F.integer(0),
              "never grow beyond this many experts per block (0: no limit)"),
      F.Field("method.router_noise", 0.0, F.number(0.0, math.inf),
              "standard deviation of a perturbation of the copies' router columns (0: the "
              "copy preserves the function)"),
  )

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    o = self.opts
    if o.max_experts and o.max_experts < o.initial_experts:
      raise ConfigError(f"config.method.max_experts={o.max_experts} is below "
                        f"config.method.initial_experts={o.initial_experts}; use 0 (no limit) "
                        f"or at least {o.initial_experts}")
    if bool(config.train.get("keep_optimizer_state", False)):
      raise ConfigError("config.train.keep_optimizer_state=True is not supported by lm_gmoe: "
                        "a growth changes the parameter shapes; allowed values: [False]")

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    if structure is None or structure == ():
      structure = (self.opts.initial_experts,)
    if not (isinstance(structure, tuple) and len(structure) == 1
            and isinstance(structure[0], int) and structure[0] >= 1):
      raise ValueError(f"structure {structure!r} does not fit lm_gmoe: expected (num_experts,)")
    params, model_state = self.init_net(key, structure[0])
    return base.Learner(params=params, model_state=model_state, structure=structure)

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    del frozen, rng
    return self.lm_loss(self.net(structure[0]), trainable, x[0], y[0], mask[0]), model_state

  def predict(self, structure, params, model_state, x):
    del model_state
    logits, _ = self.net(structure[0]).apply({"params": params}, x, train=False)
    return jax.nn.log_softmax(logits)

  # -- growth ---------------------------------------------------------------------------------
  def score_batch(self, structure, params, model_state, x, y, mask, task):
    """(blocks, E) validation NLL routed to each expert, for one batch."""
    del model_state, task
    logits, aux = self.net(structure[0]).apply({"params": params}, x, train=False, mask=mask)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return expert_losses(aux["experts"], nll, mask, structure[0])

  def growth(self, stage: int, num_experts: int) -> int:
    """How many experts to copy before training stage number `stage` (1 = the first)."""
    o = self.opts
    if stage <= 1 or (stage - 1) % o.grow_every:
      return 0
    i = (stage - 1) // o.grow_every - 1  # 0 for the first growth
    k = o.grow_schedule[i] if i < len(o.grow_schedule) else o.grow_by
    room = (o.max_experts - num_experts) if o.max_experts else k
    return max(0, min(k, room, num_experts))

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    """Copies, in every block, the `k` experts with the largest routed validation loss."""
    k = self.growth(ctx.stage, learner.structure[0])
    if not k:
      return learner
    scores = np.asarray(ctx.reduce(self.score_batch, learner, np.asarray(ctx.val_idx, np.int32)))
    top = [list(np.argsort(-s, kind="stable")[:k]) for s in scores]
    return copy_experts(learner, top, key, self.opts.router_noise)

  def describe(self, learner: base.Learner) -> dict:
    return {"num_params": self.num_params(learner), "experts": learner.structure[0]}
