"""Ensembles of backbones: Ens, UMix (paper section 4.1) and gEns (section 4.2).

The members' params and model_state (BatchNorm statistics) are the
backbone's pytrees stacked on a leading member axis. The learner's structure
is `(num_members, num_trainable)`: the last `num_trainable` members are
trained at a stage, the others are frozen (only gEns has frozen members).
Member 0 is initialised from the learner's key exactly as SM would be, member
i > 0 from `fold_in(key, i)`, so a one-member Ens is SM.

  ens:  N members trained independently on the same stage data, each with its
        own data order (the loss is the sum of the members' losses, so their
        gradients do not interact). Prediction: log of the mean of the
        members' probabilities.
  umix: one model whose logits are the mean of the N members' logits; trained
        on the cross-entropy of the mean logits (one data order), predicts
        with the same mean logits.
  gens: starts from `initial_members` members, trained at the first stage;
        before every later stage `grow_by` new members are appended
        (`alma_jax.surgery.add_member`) and only they are trained, each with
        its own data order, while the older ones stay frozen. Prediction: log
        of the mean of all members' probabilities.

Config fields (`config.method.*`; missing ones take `DEFAULTS`):
  num_members: N of ens and umix (paper: 5; released code: 3).
  initial_members, grow_by, new_member: gens only (see `GrowingEnsemble`).
  strategy: how members run inside a compiled step: "vmap" (`jax.vmap` over
    the member axis), "loop" (a Python loop over the members' slices, unrolled
    in the same jitted function) or "auto". vmap turns convolutions into
    grouped convolutions, which XLA:CPU runs several times slower than
    separate ones (see benchmarks/ensemble_strategy.py), so "auto" is "loop"
    for the VGG backbone on CPU and "vmap" otherwise. With vmap, more than
    `VMAP_CHUNK` members run as a Python loop over chunks of that many, which
    bounds the memory of the activations.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable

import jax
import jax.numpy as jnp

from alma_jax import surgery
from alma_jax import validation
from alma_jax.methods import base
from alma_jax.methods import register

DEFAULTS = {"num_members": 5, "initial_members": 1, "grow_by": 1, "new_member": "fresh",
            "strategy": "auto"}
STRATEGIES = ("auto", "loop", "vmap")
NEW_MEMBERS = surgery.MEMBER_INITS
VMAP_CHUNK = 32
# Backbones that "auto" runs as a loop on CPU (convolutions; measured by
# benchmarks/ensemble_strategy.py).
LOOP_ON_CPU = ("vgg",)


def choose_strategy(strategy: str, model_name: str, backend: str | None = None) -> str:
  """Resolves "auto" to "loop" (conv backbones on CPU) or "vmap" (everything else)."""
  if strategy != "auto":
    return strategy
  backend = backend or jax.default_backend()
  return "loop" if backend == "cpu" and model_name in LOOP_ON_CPU else "vmap"


def member(tree, i: int):
  """Slice `i` of every leaf of a stacked tree."""
  return jax.tree.map(lambda a: a[i], tree)


def map_members(fn: Callable, stacked: tuple, strategy: str, chunk: int = VMAP_CHUNK):
  """Applies `fn(*member_args)` to every member; stacks its outputs on axis 0.

  Args:
    fn: a function of one member's slices of `stacked` (other inputs are
      closed over, i.e. shared by all members).
    stacked: a tuple of trees whose leaves all have the member axis first.
    strategy: "vmap" or "loop" (see the module docstring).
    chunk: with "vmap", at most this many members per vmapped call.
  """
  n = surgery.num_members(stacked)
  if strategy == "loop":
    outs = [fn(*member(stacked, i)) for i in range(n)]
    return surgery.stack_members(outs)
  if strategy != "vmap":
    raise ValueError(f"strategy {strategy!r} is not 'vmap' or 'loop'")
  if n <= chunk:
    return jax.vmap(fn)(*stacked)
  parts = [jax.vmap(fn)(*jax.tree.map(lambda a, s=s: a[s:s + chunk], stacked))
           for s in range(0, n, chunk)]
  return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def _split(tree, frozen: int):
  """(first `frozen` members, the rest) of a stacked tree."""
  return jax.tree.map(lambda a: a[:frozen], tree), jax.tree.map(lambda a: a[frozen:], tree)


def _restack(frozen, trainable, num_frozen: int):
  if num_frozen == 0:
    return trainable
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=0), frozen, trainable)


@register
class Ensemble(base.Method):
  """Ens: N independently trained members; the mean of their probabilities."""

  name = "ens"

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    c = config
    self.strategy = validation._choice(c, "method.strategy", STRATEGIES,  # pylint: disable=protected-access
                                       default=DEFAULTS["strategy"])
    self.num_members = self._num_members_field()

  def _num_members_field(self) -> int:
    return validation._int(self.config, "method.num_members", 1,  # pylint: disable=protected-access
                           default=DEFAULTS["num_members"])

  @property
  def run_as(self) -> str:
    """The strategy actually used: "vmap" or "loop"."""
    return choose_strategy(self.strategy, self.config.model.name)

  # -- construction ---------------------------------------------------------------------------
  def initial_structure(self) -> tuple[int, int]:
    return (self.num_members, self.num_members)

  def check_structure(self, structure) -> None:
    if structure != self.initial_structure():
      raise ValueError(f"structure {structure!r} does not fit {self.name} with "
                       f"config.method.num_members={self.num_members}; expected "
                       f"{self.initial_structure()!r}")

  def init_members(self, key: jax.Array, n: int):
    """(params, model_state) of n members stacked; member 0 from `key` as SM."""
    keys = [key] + [jax.random.fold_in(key, i) for i in range(1, n)]
    members = [self.init_backbone(k) for k in keys]
    return (surgery.stack_members([m[0] for m in members]),
            surgery.stack_members([m[1] for m in members]))

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    if structure is None or structure == ():
      structure = self.initial_structure()
    self.check_structure(structure)
    params, model_state = self.init_members(key, structure[0])
    return base.Learner(params=params, model_state=model_state, structure=tuple(structure))

  # -- training -----------------------------------------------------------------------------------
  def num_data_orders(self, structure) -> int:
    return structure[1]

  def partition(self, learner: base.Learner):
    n, k = learner.structure
    if n == k:
      return learner.params, None
    frozen, trainable = _split(learner.params, n - k)
    return trainable, frozen

  def combine(self, learner: base.Learner, trainable):
    n, k = learner.structure
    frozen, _ = _split(learner.params, n - k)
    return _restack(frozen, trainable, n - k)

  def member_logits(self, params, model_state, x, *, train: bool, mask=None, stacked_x: bool):
    """(logits (n, b, classes), new model_state) of the stacked members.

    `stacked_x`: whether x and mask carry a member axis (one data order per
    member) or are shared by all members.
    """

    def one(p, s, *xm):
      xi, mi = xm if stacked_x else (x, mask)
      return self.apply_backbone(p, s, xi, train=train, mask=mi)

    stacked = (params, model_state) + ((x, mask) if stacked_x else ())
    return map_members(one, stacked, self.run_as)

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    """Sum over the trained members of each one's masked cross-entropy on its own x[i]."""
    del frozen, rng
    n, k = structure
    frozen_state, state = _split(model_state, n - k)

    def one(p, s, xi, yi, mi):
      logits, new_s = self.apply_backbone(p, s, xi, train=True, mask=mi)
      return base.masked_cross_entropy(logits, yi, mi), new_s

    losses, new_state = map_members(one, (trainable, state, x, y, mask), self.run_as)
    return jnp.sum(losses), _restack(frozen_state, new_state, n - k)

  # -- inference ------------------------------------------------------------------------------------
  def predict(self, structure, params, model_state, x) -> jnp.ndarray:
    """log(mean_i softmax(logits_i)) over all members."""
    logits, _ = self.member_logits(params, model_state, x, train=False, stacked_x=False)
    return jax.nn.logsumexp(jax.nn.log_softmax(logits), axis=0) - math.log(structure[0])

  # -- accounting -------------------------------------------------------------------------------------
  def describe(self, learner: base.Learner) -> dict:
    n, k = learner.structure
    return {"num_params": self.num_params(learner), "members": n, "trained_members": k,
            "strategy": self.run_as}


@register
class UniformMixture(Ensemble):
  """UMix: one model whose logits are the mean of the members' logits."""

  name = "umix"

  def num_data_orders(self, structure) -> int:
    del structure
    return 1

  def mean_logits(self, params, model_state, x, *, train: bool, mask=None):
    logits, new_state = self.member_logits(params, model_state, x, train=train, mask=mask,
                                           stacked_x=False)
    return jnp.mean(logits, axis=0), new_state

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    """Cross-entropy of the members' mean logits (one data order, x[0])."""
    del structure, frozen, rng
    logits, new_state = self.mean_logits(trainable, model_state, x[0], train=True, mask=mask[0])
    return base.masked_cross_entropy(logits, y[0], mask[0]), new_state

  def predict(self, structure, params, model_state, x) -> jnp.ndarray:
    del structure
    logits, _ = self.mean_logits(params, model_state, x, train=False)
    return jax.nn.log_softmax(logits)


@register
class GrowingEnsemble(Ensemble):
  """gEns: adds `grow_by` members before every stage but the first; trains only those.

  The first stage trains the `initial_members` members (paper section 4.2:
  "when starting with a single component and until the next growing step,
  the cost of training gEns is equal to SM"; Appendix B.1: one model is
  trained at every mega-batch). Growing before the first stage as well would
  leave an untrained, frozen member in the average forever.

  Config fields:
    initial_members: members at the start, all trained at the first stage.
    grow_by: k, members added (and trained) at every later stage (paper: 1).
    new_member: "fresh" (a new random network; paper's text) or "copy" (a copy
      of the last member; the paper's released code). With
      config.stream.init_from_scratch=True new members are always fresh.
  Old members are never retrained, so `reinit` keeps them: from-scratch
  training only makes the new members fresh.
  """

  name = "gens"

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    c = config
    self.grow_by = validation._int(c, "method.grow_by", 1, default=DEFAULTS["grow_by"])  # pylint: disable=protected-access
    self.new_member = validation._choice(c, "method.new_member", NEW_MEMBERS,  # pylint: disable=protected-access
                                         default=DEFAULTS["new_member"])
    if bool(c.train.get("keep_optimizer_state", False)):
      raise validation.ConfigError(
          "config.train.keep_optimizer_state=True is not supported by gens: every stage trains "
          "new members; allowed values: [False]")

  def _num_members_field(self) -> int:
    return validation._int(self.config, "method.initial_members", 1,  # pylint: disable=protected-access
                           default=DEFAULTS["initial_members"])

  def check_structure(self, structure) -> None:
    ok = (isinstance(structure, tuple) and len(structure) == 2
          and all(isinstance(v, int) for v in structure) and 1 <= structure[1] <= structure[0])
    if not ok:
      raise ValueError(f"structure {structure!r} does not fit gens: expected (num_members, "
                       "num_trainable) with 1 <= num_trainable <= num_members")

  def reinit(self, learner: base.Learner, key: jax.Array) -> base.Learner:
    del key
    return learner

  def is_first_stage(self, t: int) -> bool:
    return t <= int(self.config.stream.get("wait", 1))

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    """Appends `grow_by` members (they alone are trained), except before the first stage."""
    if self.is_first_stage(ctx.t):
      return learner
    scratch = bool(self.config.stream.get("init_from_scratch", False))
    return surgery.add_member(learner, key, init="fresh" if scratch else self.new_member,
                              k=self.grow_by, init_fn=self.init_backbone)
