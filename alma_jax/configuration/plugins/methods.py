"""The methods' declarations: each method's name and config fields, read without JAX.

A method's class (`alma_jax.methods`) derives from its declaration here, so the
fields are written once; a config built by `base_config` takes them from here
(`method_fields`), before any method code is loaded.
"""

from __future__ import annotations

import math

from alma_jax.configuration import fields as F
from alma_jax.configuration.plugins import backbones

MEMBER_INITS = ("copy", "fresh")
GATINGS = ("soft", "hard")
SPLIT_BY = ("loss", "usage")
# How growing structures are allocated in slots (`alma_jax.models.slots`): the next power of
# two, the maximum from the start, or exactly.
SLOT_POLICIES = ("pow2", "max", "exact")
MEMBER_SLOTS = ("pow2", "exact")
# gMoE's: also every expert its growth plans from the start (planned), or the choice of a rule
# made with the run's other speed choices (auto: `alma_jax.methods.gmoe.slot_rule`).
GMOE_SLOTS = ("auto", "planned") + SLOT_POLICIES
_GMOE_SLOTS_HELP = ("{parts} slots: auto (default; planned for a short run on an accelerator, "
                    "pow2 elsewhere; chosen with the run's other speed choices, and kept as "
                    "a resumed run ran), pow2 (the next power of two: one compiled structure "
                    "per power of two; the default before auto), planned (as many as the "
                    "growth plans over the run's stages, from the start: one compiled "
                    "structure), max (max_experts slots from the start: one structure) or "
                    "exact (no padding: one structure per growth)")

STRATEGY = F.Field("method.strategy", "auto", F.choice(("auto", "loop", "vmap")),
                   "how members run in a compiled step: vmap, loop, or auto (chosen: see "
                   "train.autotune; the rule: loop for convolution-heavy backbones on CPU, vmap "
                   "elsewhere)")


MIXTURE_UNITS = "mixture"


def grows_before(stage: int, period: int) -> bool:
  """Whether a method that grows every `period` training stages grows before stage number
  `stage`: never before the first (1), then before stages 1 + period, 1 + 2 period, ..."""
  return stage > 1 and (stage - 1) % period == 0


class Declaration:
  """A method's name and config fields (paths "method.<name>")."""

  name = ""
  FIELDS: tuple[F.Field, ...] = ()
  # Whether the method exposes hidden units on a backbone that sows them (`Method.unit_layout`):
  # what the plasticity diagnostics' unit fields and the unit-reset stage policies need;
  # MIXTURE_UNITS: on a backbone whose mixtures declare them (`Mixture.expert_units`).
  HIDDEN_UNITS: bool | str = False

  @classmethod
  def fields(cls, config) -> tuple[F.Field, ...]:
    """The method's config fields for `config` (by default `FIELDS`)."""
    del config
    return cls.FIELDS

  @classmethod
  def growth_period(cls, config, planned_stages: int) -> int | None:
    """Training stages between the method's growths under `config` (see `grows_before`), given
    the `planned_stages` its waiting policy plans; None: it does not grow, or was asked not
    to."""
    del config, planned_stages
    return None


class SM(Declaration):
  name = "sm"
  HIDDEN_UNITS = True


class Ens(Declaration):
  name = "ens"
  HIDDEN_UNITS = True
  FIELDS = (F.Field("method.num_members", 5, F.integer(1), "N (paper: 5; released code: 3)"),
            STRATEGY)


class UMix(Ens):
  name = "umix"
  FIELDS = Ens.FIELDS + (
      F.Field("method.combine", "mean", F.choice(("mean", "sum")),
              "the members' logits are averaged (the paper) or summed (the released code; "
              "with SGD a sum gives every member N times the gradient)"),)


class GEns(Ens):
  name = "gens"
  HIDDEN_UNITS = True  # members in slots: `Method.unit_active` says which are the learner's
  FIELDS = (F.Field("method.initial_members", 1, F.integer(1),
                    "members at the start, all trained at the first stage"),
            F.Field("method.grow_by", 1, F.integer(1),
                    "k, members added (and trained) before every later stage (paper: 1)"),
            F.Field("method.new_member", "copy", F.choice(MEMBER_INITS),
                    "copy (of the last member, which then keeps learning: the released code; "
                    "the paper's section 6.1 remark on replay fits it) or fresh (a new random "
                    "network; the paper's section 4.2 does not say which)"),
            F.Field("method.combine", "probs", F.choice(("probs", "logits")),
                    "predict the mean of the members' probabilities (the paper) or the softmax "
                    "of their mean logits (the released code)"),
            F.Field("method.slots", "pow2", F.choice(MEMBER_SLOTS),
                    "member slots: pow2 (the next power of two: one compiled structure per "
                    "power of two of the members) or exact (one per growth)"),
            STRATEGY)

  @classmethod
  def growth_period(cls, config, planned_stages: int) -> int | None:
    del config, planned_stages
    return 1  # `grow_by` >= 1 members before every later stage


# gMoE on a backbone with experts of its own (the Switch Transformer): its experts are copied.
EXPERT_GROWTH_FIELDS = (
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
            "copy keeps every token's routing and gate)"),
    F.Field("method.slots", "auto", F.choice(GMOE_SLOTS),
            _GMOE_SLOTS_HELP.format(parts="every block's expert"), was_default="pow2"),
)


class GMoE(Declaration):
  name = "gmoe"
  HIDDEN_UNITS = MIXTURE_UNITS  # its mixtures' channels (and the VGG's inner ones)
  FIELDS = (
      F.Field("method.gating", "soft", F.choice(GATINGS),
              "soft (weighted sum over all experts) or hard (one expert per example: sampled "
              "with a straight-through gradient in training, greedy at test time)"),
      F.Field("method.tree", True, F.boolean(),
              "binary gating tree (function-preserving splits); False: one flat softmax gate"),
      F.Field("method.grow", True, F.boolean(),
              "False: a fixed MoE with initial_experts experts per layer"),
      F.Field("method.initial_experts", 1, F.integer(1),
              "experts per layer at the start (paper: 1; released code: 2)"),
      F.Field("method.grow_every", 0, F.integer(0),
              "grow before every this many-th stage; 0: about 10 growths over the stream "
              "(every max(1, stages // 10) stages, of the stages the waiting policy plans; "
              "the released runs reach 6-11 experts); the paper and the released config: 1"),
      F.Field("method.split_by", "loss", F.choice(SPLIT_BY),
              "the expert to split: largest routed validation loss (paper) or usage "
              "(released code)"),
      F.Field("method.gate_pool", 4, F.integer(1),
              "side of the average pool of a VGG block's gate input"),
      F.Field("method.max_experts", 0, F.integer(0),
              "stop splitting a layer at this many experts (0: no limit)"),
      F.Field("method.slots", "auto", F.choice(GMOE_SLOTS),
              _GMOE_SLOTS_HELP.format(parts="a layer's expert"), was_default="pow2"),
  )

  @classmethod
  def fields(cls, config) -> tuple[F.Field, ...]:
    """`FIELDS`, or `EXPERT_GROWTH_FIELDS` on a backbone with experts of its own."""
    return EXPERT_GROWTH_FIELDS if backbones.own_experts(config.model.name) else cls.FIELDS

  @classmethod
  def growth_period(cls, config, planned_stages: int) -> int | None:
    """`grow_every`, or its automatic value: about 10 growths over the planned stages
    (`method.grow` is not a field of the expert growth, which always grows)."""
    if not F.lookup(config, "method.grow", True):
      return None
    return F.lookup(config, "method.grow_every", 0) or max(1, planned_stages // 10)

  @staticmethod
  def expert_copies(opts, stage: int, num_experts: int) -> int:
    """On a backbone with experts of its own: how many of a block's `num_experts` experts
    the growth copies before training stage number `stage` (1 = the first; `opts`: the
    method's resolved fields): the schedule's k, then `grow_by`, at most doubling the
    block and never past `max_experts`."""
    if not grows_before(stage, opts.grow_every):
      return 0
    i = (stage - 1) // opts.grow_every - 1  # 0 for the first growth
    k = opts.grow_schedule[i] if i < len(opts.grow_schedule) else opts.grow_by
    room = (opts.max_experts - num_experts) if opts.max_experts else k
    return max(0, min(k, room, num_experts))

  @classmethod
  def planned_experts(cls, config, planned_stages: int) -> int:
    """The experts of each layer (block) after `planned_stages` stages: the initial ones and
    those of every growth before them (`method.slots=planned` holds this many from the start).
    A gated mixture's growth splits one expert per layer, up to `max_experts`."""
    opts = F.resolve(config, cls.fields(config))
    n = opts.initial_experts
    if backbones.own_experts(config.model.name):
      for stage in range(1, planned_stages + 1):
        n += cls.expert_copies(opts, stage, n)
      return n
    period = cls.growth_period(config, planned_stages)
    if period is None:
      return n
    n += sum(grows_before(stage, period) for stage in range(1, planned_stages + 1))
    return min(n, opts.max_experts) if opts.max_experts else n


class FF(Declaration):
  name = "ff"
  HIDDEN_UNITS = True  # channels in slots: `Method.unit_active` says which are the learner's
  FIELDS = (
      F.Field("method.growth_rate", 0.25, F.number(0.0),
              "neurons added per growth as a fraction of the initial total width (paper B.1: "
              "0.25; released CIFAR config: 0.6)"),
      F.Field("method.grow_every", 1, F.integer(1),
              "grow before every this many-th stage, never before the first"),
      F.Field("method.num_new", 70, F.integer(0),
              "K, new-neuron candidates per layer (released code: 70)"),
      F.Field("method.epsilon", 0.01, F.number(0.0),
              "split halves get w +- epsilon v, new neurons outgoing weights epsilon b; 0 keeps "
              "the function exactly (released code: unscaled +-v)"),
      F.Field("method.split_init", 0.1, F.number(0.0),
              "split directions start as U(-s, s) (released code: 0.1)"),
      F.Field("method.new_in_init", 0.1, F.number(0.0),
              "new neurons' incoming weights start as N(0, s^2) (released code: 0.1)"),
      F.Field("method.new_out_init", 0.01, F.number(0.0),
              "new neurons' outgoing weights start as U(-s, s) (released code: 0.01)"),
      F.Field("method.split_penalty", 1e-2, F.number(0.0),
              "fit penalty on |v|^2 (released code: 1e-2)"),
      F.Field("method.new_penalty", 1e-4, F.number(0.0),
              "fit penalty on the new neurons' |a|^2 (released code: 1e-4)"),
      F.Field("method.fit_lr", 1e-3, F.number(0.0, open_lo=True),
              "RMSprop learning rate of the candidate fit (released code: 1e-3)"),
      F.Field("method.fit_examples", 0, F.integer(0),
              "fit and score on at most this many of the stage's examples (0: all)"),
      F.Field("method.slots", "pow2", F.choice(MEMBER_SLOTS),
              "channel slots of the growable layers: pow2 (each the next power of two of the "
              "widest layer's width: one compiled structure per power of two) or exact (one "
              "per growth)"),
      F.Field("method.min_slots", 0, F.integer(0),
              "with slots=pow2, every growable layer holds at least this many channel slots "
              "from the start: fewer structures to compile (a first run on a cold "
              "compilation cache), more padding computed by every step; 0: none"),
  )

  @classmethod
  def growth_period(cls, config, planned_stages: int) -> int | None:
    del planned_stages
    if F.lookup(config, "method.growth_rate", 0.25) == 0:
      return None
    return F.lookup(config, "method.grow_every", 1)


DECLARED = (SM, Ens, UMix, GEns, GMoE, FF)
