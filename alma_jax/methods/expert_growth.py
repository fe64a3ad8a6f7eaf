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

Slots (`method.slots`): every block's experts live in C >= E slots (the next
power of two by default), the active count E in the model state
(`routing/active_experts`), and the compiled programs are keyed by
`program_structure`, `(C, lo)`: C slots whose dispatch buffer has room for
the capacity of `lo` experts, the fewest the slots hold. Growth inside the
slots then compiles no step again. `active_view` cuts the padding slots off
(structure `(E, E)`, exact slots), for Mem and the FLOP counts.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax import models
from alma_jax.configuration.plugins import backbones as declared_backbones
from alma_jax.configuration.plugins import methods as declared_methods
from alma_jax.methods import base
from alma_jax.models import slots as slots_lib
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
    self._nets: dict[tuple[int, int], object] = {}
    self._inits: dict[int, object] = {}
    # The initial model, built now (as the other methods build theirs), so that its sizes are
    # checked with the config (a dimension its heads do not divide), not at the first program.
    self.net(self.opts.initial_experts)

  @property
  def leaf_axes(self):
    """The backbone's stacked experts (`Method.LEAF_AXES`)."""
    return base.backbone_leaf_axes(self.backbone_class)

  def net(self, num_slots: int, lowest: int | None = None):
    """The backbone with `num_slots` experts (slots) per block, its dispatch buffer sized for
    `lowest` active experts (None: all)."""
    key = (num_slots, lowest or num_slots)
    if key not in self._nets:
      m = self.method
      self._nets[key] = m.task.backbone(m.config.model, m.num_classes, m.input_shape,
                                        num_experts=num_slots, min_experts=key[1])
    return self._nets[key]

  # -- slots --------------------------------------------------------------------------------------
  @property
  def in_slots(self) -> bool:
    """Whether the experts live in slots (`method.slots` other than exact)."""
    return self.method.slot_policy != "exact"

  def slots(self, experts: int) -> int:
    """The slots of a block with `experts` experts (`method.slots`)."""
    return self.method.slots(experts)

  def program_structure(self, structure) -> tuple[int, ...]:
    """`(slots, fewest experts they hold)` in slots; `structure` itself (exact, or a view's)."""
    if not self.in_slots or len(structure) != 1:
      return structure
    num = self.slots(structure[0])
    lowest = min(n for n in range(min(self.opts.initial_experts, structure[0]), num + 1)
                 if self.slots(n) == num)
    return (num, lowest)

  def has_slots(self, learner: base.Learner) -> bool:
    """Whether `learner`'s experts are in slots (its model state holds the active count)."""
    return self.backbone_class.ROUTING in learner.model_state

  def routing(self, n: int, host: bool = False) -> dict:
    """The model state of `n` active experts in slots; `host`: its count made on the host and
    put on the device (outside a trace: no conversion program of its own)."""
    cls = self.backbone_class
    count = jax.device_put(np.asarray(n, np.int32)) if host else jnp.asarray(n, jnp.int32)
    return {cls.ROUTING: {cls.ACTIVE: count}}

  def active_view(self, learner: base.Learner) -> base.Learner:
    """The learner without padding slots (structure `(E, E)`)."""
    if not self.has_slots(learner):
      return learner
    n = learner.structure[0]
    state = {k: v for k, v in learner.model_state.items() if k != self.backbone_class.ROUTING}
    return base.Learner(params=self.backbone_class.resize_experts(learner.params, n),
                        model_state=state, structure=(n, n))

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

      def init(k):  # the exact model's initial values, in slots
        variables = base.init_variables(net, k, dummy, train=False)
        params = variables.pop("params")
        if self.in_slots:
          params = self.backbone_class.resize_experts(params, self.slots(n))
          variables.update(self.routing(n))
        return params, variables

      self._inits[n] = jax.jit(init)
    params, model_state = self._inits[n](key)
    return base.Learner(params=params, model_state=model_state, structure=structure)

  def outputs(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """(logits, aux, new model_state) of the backbone in the program structure `structure`
    (`rng`: the dropout key in training)."""
    return base.apply_module(self.net(structure[0], structure[-1]), params, model_state, x,
                             train=train, mask=mask, rng=rng)

  # -- growth -------------------------------------------------------------------------------------
  def score_batch(self, structure, params, model_state, x, y, mask, task):
    """(blocks, E) validation loss routed to each expert, for one batch."""
    del task
    logits, aux, _ = self.outputs(structure, params, model_state, x, train=False, mask=mask)
    nll = task_base.cross_entropy(logits, y)
    return self.backbone_class.expert_losses(aux["experts"], nll, mask, structure[0])

  def growth(self, stage: int, num_experts: int) -> int:
    """How many experts to copy before training stage number `stage` (1 = the first)."""
    return declared_methods.GMoE.expert_copies(self.opts, stage, num_experts)

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    """Copies, in every block, the `k` experts with the largest routed validation loss."""
    n = learner.structure[0]
    k = self.growth(ctx.stage, n)
    if not k:
      return learner
    scores = np.asarray(ctx.reduce(self.score_batch, learner, np.asarray(ctx.val_idx, np.int32)))
    top = [list(np.argsort(-s[:n], kind="stable")[:k]) for s in scores]  # active experts
    return self.copy(learner, top, key, self.opts.router_noise)

  def copy(self, learner: base.Learner, experts: Sequence[int] | Sequence[Sequence[int]],
           key: jax.Array, noise: float = 0.0) -> base.Learner:
    """The learner with `experts` of every block copied (one list for all blocks, or one per
    block: the backbone's `copy_experts`); `learner` is not modified."""
    n = learner.structure[0]
    k = len(experts) if all(isinstance(e, (int, np.integer)) for e in experts) else len(experts[0])
    slotted = self.has_slots(learner)
    params = self.backbone_class.copy_experts(learner.params, experts, key, noise, active=n,
                                              num_slots=self.slots(n + k) if slotted else None)
    state = ({**learner.model_state, **self.routing(n + k, host=True)} if slotted
             else learner.model_state)
    return base.Learner(params=params, model_state=state, structure=(n + k,))

  def describe(self, learner: base.Learner) -> dict:
    return {"num_params": self.method.num_params(learner), "experts": learner.structure[0]}
