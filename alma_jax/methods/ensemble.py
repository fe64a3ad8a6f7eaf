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
        (`add_member`, a pure edit of the stacked pytrees) and only they are
        trained, each with its own data order, while the older ones stay
        frozen. Prediction: log of the mean of all members' probabilities.

`method.strategy` says how members run inside a compiled step: "vmap"
(`jax.vmap` over the member axis), "loop" (a Python loop over the members'
slices, unrolled in the same jitted function) or "auto". vmap turns
convolutions into grouped convolutions, which XLA:CPU runs several times
slower than separate ones (see benchmarks/ensemble_strategy.py), so "auto" is
"loop" for the VGG backbone on CPU and "vmap" otherwise. With vmap, more than
`VMAP_CHUNK` members run as a Python loop over chunks of that many, which
bounds the memory of the activations.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp

from alma_jax import fields as F
from alma_jax.methods import base
from alma_jax.methods.registry import register

PyTree = Any
MEMBER_INITS = ("copy", "fresh")
VMAP_CHUNK = 32
# Backbones that "auto" runs as a loop on CPU (convolutions; measured by
# benchmarks/ensemble_strategy.py).
LOOP_ON_CPU = ("vgg",)
STRATEGY = F.Field("method.strategy", "auto", F.choice(("auto", "loop", "vmap")),
                   "how members run in a compiled step: vmap, loop, or auto (loop for the VGG "
                   "on CPU, vmap elsewhere)")


def choose_strategy(strategy: str, model_name: str, backend: str | None = None) -> str:
  """Resolves "auto" to "loop" (conv backbones on CPU) or "vmap" (everything else)."""
  if strategy != "auto":
    return strategy
  backend = backend or jax.default_backend()
  return "loop" if backend == "cpu" and model_name in LOOP_ON_CPU else "vmap"


# -- stacked members ------------------------------------------------------------------------------
def num_members(tree: PyTree) -> int:
  """The size of the leading (member) axis shared by all leaves of `tree`."""
  sizes = {a.shape[0] for a in jax.tree.leaves(tree)}
  if len(sizes) != 1:
    raise ValueError(f"the leaves of a stacked tree must share their leading axis; got {sorted(sizes)}")
  return sizes.pop()


def stack_members(members: list[PyTree]) -> PyTree:
  """[tree_0, ..., tree_{n-1}] (same structure) -> one tree with a leading axis n."""
  return jax.tree.map(lambda *a: jnp.stack(a), *members)


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
  n = num_members(stacked)
  if strategy == "loop":
    return stack_members([fn(*member(stacked, i)) for i in range(n)])
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


# -- growth: add_member ---------------------------------------------------------------------------
def _new_members(state: base.Learner, key: jax.Array, init: str, k: int,
                 init_fn: Callable | None) -> tuple[PyTree, PyTree]:
  """k new members, stacked: fresh ones from `init_fn`, or copies of the last member."""
  if init == "copy":
    last = lambda a: jnp.repeat(a[-1:], k, axis=0)
    return jax.tree.map(last, state.params), jax.tree.map(last, state.model_state)
  if init_fn is None:
    raise ValueError("add_member(init='fresh') needs init_fn: key -> (params, model_state) of one member")
  members = [init_fn(jax.random.fold_in(key, j)) for j in range(k)]
  return stack_members([m[0] for m in members]), stack_members([m[1] for m in members])


def _concat(old: PyTree, new: PyTree, what: str) -> PyTree:
  if jax.tree.structure(old) != jax.tree.structure(new):
    raise ValueError(f"the new members' {what} do not have the existing members' tree structure")

  def cat(a, b):
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
      raise ValueError(f"a new member's {what} leaf {b.shape[1:]} {b.dtype} does not match the "
                       f"existing {a.shape[1:]} {a.dtype}")
    return jnp.concatenate([a, b], axis=0)

  return jax.tree.map(cat, old, new)


def add_member(state: base.Learner, key: jax.Array, *, init: str = "fresh", k: int = 1,
               init_fn: Callable[[jax.Array], tuple[PyTree, PyTree]] | None = None) -> base.Learner:
  """Appends `k` members to a stacked ensemble (gEns growth, paper section 4.2).

  Args:
    state: an ensemble learner whose structure is `(num_members, num_trainable)`
      and whose params/model_state leaves are stacked on axis 0 (not modified).
    key: PRNG key of the new members (member j of the k uses `fold_in(key, j)`).
    init: "fresh" (a new random network from `init_fn`; the paper's text) or
      "copy" (a copy of the last member; the paper's released code).
    k: how many members to add.
    init_fn: key -> (params, model_state) of one unstacked member; needed for
      "fresh".

  Returns:
    A new learner with `num_members + k` members whose first `num_members`
    slices are the old members, bitwise; its structure is
    `(num_members + k, k)`: the new members are the trainable ones.
  """
  if init not in MEMBER_INITS:
    raise ValueError(f"add_member: init={init!r} is unknown; valid values: {list(MEMBER_INITS)}")
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"add_member: k={k!r} must be an integer >= 1")
  n = num_members(state.params)
  if not (isinstance(state.structure, tuple) and len(state.structure) == 2
          and state.structure[0] == n):
    raise ValueError(f"add_member needs an ensemble learner with structure (num_members, "
                     f"num_trainable) and {n} stacked members; got structure {state.structure!r}")
  params, model_state = _new_members(state, key, init, k, init_fn)
  return base.Learner(params=_concat(state.params, params, "params"),
                      model_state=_concat(state.model_state, model_state, "model_state"),
                      structure=(n + k, k))


# -- the methods --------------------------------------------------------------------------------------
@register
class Ensemble(base.SingleBackbone, base.Method):
  """Ens: N independently trained members; the mean of their probabilities."""

  name = "ens"
  FIELDS = (F.Field("method.num_members", 5, F.integer(1), "N (paper: 5; released code: 3)"),
            STRATEGY)
  LEAF_AXES = (("", ("member",)),)  # every leaf is stacked on the member axis

  @property
  def initial_members(self) -> int:
    return self.opts.num_members

  @property
  def run_as(self) -> str:
    """The strategy actually used: "vmap" or "loop"."""
    return choose_strategy(self.opts.strategy, self.config.model.name)

  # -- construction ---------------------------------------------------------------------------
  def initial_structure(self) -> tuple[int, int]:
    return (self.initial_members, self.initial_members)

  def check_structure(self, structure) -> None:
    if structure != self.initial_structure():
      raise ValueError(f"structure {structure!r} does not fit {self.name} with "
                       f"config.method.num_members={self.initial_members}; expected "
                       f"{self.initial_structure()!r}")

  def init_members(self, key: jax.Array, n: int):
    """(params, model_state) of n members stacked; member 0 from `key` as SM."""
    keys = [key] + [jax.random.fold_in(key, i) for i in range(1, n)]
    members = [self.init_backbone(k) for k in keys]
    return stack_members([m[0] for m in members]), stack_members([m[1] for m in members])

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
    """The members' combined prediction (`combine_members`)."""
    logits, _ = self.member_logits(params, model_state, x, train=False, stacked_x=False)
    return self.combine_members(logits, structure[0])

  def combine_members(self, logits, n: int) -> jnp.ndarray:
    """log(mean_i softmax(logits_i)): the mean of the members' probabilities."""
    return jax.nn.logsumexp(jax.nn.log_softmax(logits), axis=0) - math.log(n)

  # -- best-epoch selection: every trained member on its own ------------------------------------
  units_are_parts = True

  def num_units(self, structure) -> int:
    return structure[1]

  def predict_units(self, structure, params, model_state, x):
    n, k = structure
    logits, _ = self.member_logits(params, model_state, x, train=False, stacked_x=False)
    return self.combine_members(logits, n), jax.nn.log_softmax(logits[n - k:])

  def select_units(self, structure, take, new: base.Learner, old: base.Learner) -> base.Learner:
    n, k = structure
    members = jnp.concatenate([jnp.zeros((n - k,), bool), take])

    def pick(a, b):
      return jnp.where(members.reshape((n,) + (1,) * (a.ndim - 1)), a, b)

    return old.replace(params=jax.tree.map(pick, new.params, old.params),
                       model_state=jax.tree.map(pick, new.model_state, old.model_state))

  # -- accounting -------------------------------------------------------------------------------------
  def describe(self, learner: base.Learner) -> dict:
    n, k = learner.structure
    return {"num_params": self.num_params(learner), "members": n, "trained_members": k,
            "strategy": self.run_as}


@register
class UniformMixture(Ensemble):
  """UMix: one model whose logits are the mean (or sum) of the members' logits."""

  name = "umix"
  FIELDS = Ensemble.FIELDS + (
      F.Field("method.combine", "mean", F.choice(("mean", "sum")),
              "the members' logits are averaged (the paper) or summed (the released code; "
              "with SGD a sum gives every member N times the gradient)"),)

  def num_data_orders(self, structure) -> int:
    del structure
    return 1

  # One model on one data order: the cross-entropy and log-softmax of `logits`, selected as
  # a whole.
  loss = base.Method.loss
  predict = base.Method.predict
  units_are_parts = False
  num_units = base.Method.num_units
  predict_units = base.Method.predict_units
  select_units = base.Method.select_units

  def logits(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """The mean of the members' logits."""
    del structure, rng
    logits, new_state = self.member_logits(params, model_state, x, train=train, mask=mask,
                                           stacked_x=False)
    combined = jnp.sum(logits, axis=0) if self.opts.combine == "sum" else jnp.mean(logits, axis=0)
    return combined, new_state


@register
class GrowingEnsemble(Ensemble):
  """gEns: adds `grow_by` members before every stage but the first; trains only those.

  The first stage trains the `initial_members` members (paper section 4.2:
  "when starting with a single component and until the next growing step,
  the cost of training gEns is equal to SM"; Appendix B.1: one model is
  trained at every mega-batch). Growing before the first stage as well would
  leave an untrained, frozen member in the average forever. With
  config.stream.init_from_scratch=True new members are always fresh; old
  members are never retrained, so `reinit` keeps them.
  """

  name = "gens"
  FIELDS = (F.Field("method.initial_members", 1, F.integer(1),
                    "members at the start, all trained at the first stage"),
            F.Field("method.grow_by", 1, F.integer(1),
                    "k, members added (and trained) before every later stage (paper: 1)"),
            F.Field("method.new_member", "copy", F.choice(MEMBER_INITS),
                    "copy (of the last member, which then keeps learning: the released code, "
                    "the paper's Fig. 9) or fresh (a new random network)"),
            F.Field("method.combine", "probs", F.choice(("probs", "logits")),
                    "predict the mean of the members' probabilities (the paper) or the softmax "
                    "of their mean logits (the released code)"),
            STRATEGY)

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    self.refuse_kept_optimizer_state("every stage trains new members")

  @property
  def initial_members(self) -> int:
    return self.opts.initial_members

  def check_structure(self, structure) -> None:
    ok = (isinstance(structure, tuple) and len(structure) == 2
          and all(isinstance(v, int) for v in structure) and 1 <= structure[1] <= structure[0])
    if not ok:
      raise ValueError(f"structure {structure!r} does not fit gens: expected (num_members, "
                       "num_trainable) with 1 <= num_trainable <= num_members")

  def reinit(self, learner: base.Learner, key: jax.Array) -> base.Learner:
    del key
    return learner

  def combine_members(self, logits, n: int) -> jnp.ndarray:
    if self.opts.combine == "logits":
      return jax.nn.log_softmax(jnp.mean(logits, axis=0))
    return super().combine_members(logits, n)

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    """Appends `grow_by` members (they alone are trained), except before the first stage."""
    if ctx.is_first:
      return learner
    scratch = bool(self.config.stream.get("init_from_scratch", False))
    return add_member(learner, key, init="fresh" if scratch else self.opts.new_member,
                      k=self.opts.grow_by, init_fn=self.init_backbone)
