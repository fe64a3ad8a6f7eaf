"""gMoE on a backbone whose layers are mixtures of experts of their own (the Switch Transformer).

Such a backbone declares its expert layers (`copy_experts`, `expert_losses`
and `LEAF_AXES` on its class: `alma_jax.models.switch`), and gMoE
(`alma_jax.methods.gmoe.GrowingMoE`) grows them instead of building gated
mixtures around the backbone's layers. The learner's structure is
`(num_experts,)`: every block has that many experts (the backbone with
`num_experts` of them). Before every `grow_every`-th stage but the first,
each block copies its k experts with the largest validation loss routed to
them (the cross-entropy of the tokens whose top-1 expert they are), k from
`grow_schedule` for the first growths (the paper's Table 2: 4 -> 6 -> 8 ->
12 experts) and `grow_by` after those, never beyond `max_experts`; with
`router_noise` 0 a copy keeps every token's routing and gate, which
preserves the function only while no expert capacity binds, and only until
the first optimizer step (see `alma_jax.models.switch.copy_experts`).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import jax
import numpy as np

from alma_jax import models
from alma_jax.configuration.plugins import backbones as declared_backbones
from alma_jax.methods import base
from alma_jax.tasks import base as task_base

def has_own_experts(model_config) -> bool:
  """Whether the backbone of `config.model` declares expert layers of its own."""
  return declared_backbones.own_experts(model_config.name)


class OwnExperts:
  """The structure, forward pass and growth of gMoE on a backbone with its own experts.

  `method` is the `GrowingMoE` it serves: its config, task, options
  (`EXPERT_GROWTH_FIELDS` of its declaration), input shape and number of classes.
  """

  def __init__(self, method: base.Method):
    self.method = method
    self.opts = method.opts
    self.backbone_class = models.get_backbone(method.config.model.name)
    self._nets: dict[int, object] = {}
    self._inits: dict[int, object] = {}

  @property
  def leaf_axes(self):
    """The backbone's stacked experts (`Method.LEAF_AXES`)."""
    return base.backbone_leaf_axes(self.backbone_class)

  def net(self, num_experts: int):
    """The backbone with `num_experts` experts per block."""
    if num_experts not in self._nets:
      m = self.method
      self._nets[num_experts] = m.task.backbone(m.config.model, m.num_classes, m.input_shape,
                                                num_experts=num_experts)
    return self._nets[num_experts]

  def init(self, key: jax.Array, structure: Hashable | None) -> base.Learner:
    if structure is None or structure == ():
      structure = (self.opts.initial_experts,)
    if not (isinstance(structure, tuple) and len(structure) == 1
            and isinstance(structure[0], int) and structure[0] >= 1):
      raise ValueError(f"structure {structure!r} does not fit gmoe on "
                       f"config.model.name={self.method.config.model.name!r}: expected "
                       "(num_experts,)")
    n = structure[0]
    if n not in self._inits:  # one compiled program per number of experts
      net = self.net(n)
      dummy = np.zeros((1,) + self.method.input_shape, self.method.task.input_dtype)
      self._inits[n] = jax.jit(lambda k: base.init_variables(net, k, dummy, train=False))
    variables = self._inits[n](key)
    return base.Learner(params=variables["params"],
                        model_state={k: v for k, v in variables.items() if k != "params"},
                        structure=structure)

  def outputs(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """(logits, aux, new model_state) of the backbone with `structure[0]` experts (`rng`: the
    dropout key in training)."""
    return base.apply_module(self.net(structure[0]), params, model_state, x, train=train,
                             mask=mask, rng=rng)

  # -- growth -------------------------------------------------------------------------------------
  def score_batch(self, structure, params, model_state, x, y, mask, task):
    """(blocks, E) validation loss routed to each expert, for one batch."""
    del task
    logits, aux, _ = self.outputs(structure, params, model_state, x, train=False, mask=mask)
    nll = task_base.cross_entropy(logits, y)
    return self.backbone_class.expert_losses(aux["experts"], nll, mask, structure[0])

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
    return self.copy(learner, top, key, self.opts.router_noise)

  def copy(self, learner: base.Learner, experts: Sequence[int] | Sequence[Sequence[int]],
           key: jax.Array, noise: float = 0.0) -> base.Learner:
    """The learner with `experts` of every block copied (one list for all blocks, or one per
    block: the backbone's `copy_experts`); `learner` is not modified."""
    params = self.backbone_class.copy_experts(learner.params, experts, key, noise)
    k = len(experts) if all(isinstance(e, (int, np.integer)) for e in experts) else len(experts[0])
    return base.Learner(params=params, model_state=learner.model_state,
                        structure=(learner.structure[0] + k,))

  def describe(self, learner: base.Learner) -> dict:
    return {"num_params": base.count_params(learner.params), "experts": learner.structure[0]}
