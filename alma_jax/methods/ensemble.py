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

Every member is the backbone of `config.model` for the config's task: on
text, a Switch Transformer of E experts (Ens E@N, gEns), whose load-balancing
loss the task adds to each member's loss.

`method.strategy` says how members run inside a compiled step: "vmap"
(`jax.vmap` over the member axis), "loop" (a Python loop over the members'
slices, unrolled in the same jitted function) or "auto". vmap turns
convolutions into grouped convolutions, which XLA:CPU runs several times
slower than separate ones (see benchmarks/ensemble_strategy.py), so "auto" is
"loop" for the VGG backbone on CPU and "vmap" otherwise. With vmap, more than
`VMAP_CHUNK` members run as a Python loop over chunks of that many, which
bounds the memory of the activations. Compute is counted in one form whatever
the strategy (`Ensemble.counted`: one vmap over all members), so Comp does
not depend on how the members ran.

gEns holds its members in slots (`method.slots`: the next power of two by
default): params and model_state have C >= n slots on the member axis, and
`model_state["slots"]["active"]` (C,) says which are members (the first n).
Adding a member inside the slots writes values, so the compiled programs
(keyed by `(C, k)`, `program_structure`) are reused; padding slots run in
evaluation but are masked out of the prediction, and are never trained.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax import models
from alma_jax.configuration import fields as F
from alma_jax.configuration.plugins import methods as declared
from alma_jax.methods import base
from alma_jax.methods.registry import register
from alma_jax.models import slots as slots_lib
from alma_jax.models.registry import leaf_at

PyTree = Any
MEMBER_INITS = declared.MEMBER_INITS
SLOTS_KEY = "slots"  # model_state[SLOTS_KEY]["active"]: which member slots hold members
VMAP_CHUNK = 32


def choose_strategy(strategy: str, model_name: str, backend: str | None = None) -> str:
  """Resolves "auto" to "loop" for backbones whose spec is `conv_heavy` on CPU (measured by
  benchmarks/ensemble_strategy.py), "vmap" for everything else."""
  if strategy != "auto":
    return strategy
  backend = backend or jax.default_backend()
  return "loop" if backend == "cpu" and models.spec(model_name).conv_heavy else "vmap"


# -- stacked members ------------------------------------------------------------------------------
# Members are slots of the leading axis (`alma_jax.models.slots`).
num_members = slots_lib.leading_size
stack_members = slots_lib.stack
member = slots_lib.index
take_members = slots_lib.take


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


def backbone_state(model_state: PyTree) -> PyTree:
  """The stacked backbones' model state (without the slot bookkeeping)."""
  if isinstance(model_state, dict) and SLOTS_KEY in model_state:
    return {k: v for k, v in model_state.items() if k != SLOTS_KEY}
  return model_state


def active_slots(model_state: PyTree):
  """(C,) which member slots hold members, or None when every slot does."""
  if isinstance(model_state, dict) and SLOTS_KEY in model_state:
    return model_state[SLOTS_KEY]["active"]
  return None


def _per_member(active, logits):
  """The (C,) slot mask shaped to broadcast over members' logits of any rank (C, ...)."""
  return active.reshape(active.shape + (1,) * (logits.ndim - 1))


def _with_slots(model_state: PyTree, active) -> PyTree:
  if not isinstance(active, jax.Array):  # a host mask: a transfer, not a program
    active = jax.device_put(np.asarray(active))
  return {**backbone_state(model_state), SLOTS_KEY: {"active": active}}


# -- growth: add_member ---------------------------------------------------------------------------
def _new_members(state: base.Learner, key: jax.Array, init: str, k: int,
                 init_fn: Callable | None) -> tuple[PyTree, PyTree]:
  """k new members, stacked: fresh ones from `init_fn`, or copies of the last member."""
  if init == "copy":
    return _copies_of_member((state.params, backbone_state(state.model_state)),
                             np.int32(state.structure[0] - 1), k=k)
  if init_fn is None:
    raise ValueError("add_member(init='fresh') needs init_fn: key -> (params, model_state) of one member")
  members = [init_fn(jax.random.fold_in(key, j)) for j in range(k)]
  return stack_members([m[0] for m in members]), stack_members([m[1] for m in members])


@functools.partial(jax.jit, static_argnames="k")
def _copies_of_member(tree: PyTree, i, *, k: int) -> PyTree:
  """`k` copies of member `i` of every stacked leaf of `tree` (one program per shapes)."""
  return jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), take_members(tree, i, 1))


def _check_new(old: PyTree, new: PyTree, what: str) -> None:
  if jax.tree.structure(old) != jax.tree.structure(new):
    raise ValueError(f"the new members' {what} do not have the existing members' tree structure")

  def check(a, b):
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
      raise ValueError(f"a new member's {what} leaf {b.shape[1:]} {b.dtype} does not match the "
                       f"existing {a.shape[1:]} {a.dtype}")

  jax.tree.map(check, old, new)


def _concat(old: PyTree, new: PyTree, what: str) -> PyTree:
  _check_new(old, new, what)
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=0), old, new)


def add_member(state: base.Learner, key: jax.Array, *, init: str = "fresh", k: int = 1,
               init_fn: Callable[[jax.Array], tuple[PyTree, PyTree]] | None = None,
               slots: int | None = None) -> base.Learner:
  """Appends `k` members to a stacked ensemble (gEns growth, paper section 4.2).

  Args:
    state: an ensemble learner whose structure is `(num_members, num_trainable)`
      and whose params/model_state leaves are stacked on axis 0 (not modified).
    key: PRNG key of the new members (member j of the k uses `fold_in(key, j)`).
    init: "copy" (a copy of the last member: the released code's, and gEns's
      default `method.new_member`) or "fresh" (a new random network from
      `init_fn`). The paper says only that new networks are added (section
      4.2); its section 6.1 remark that with replay the last member
      "essentially coincides with SM" fits a copy.
    k: how many members to add.
    init_fn: key -> (params, model_state) of one unstacked member; needed for
      "fresh".
    slots: the member slots after the growth. None: a learner in slots (with
      `model_state["slots"]`) keeps its slots while the new members fit and
      grows to the next power of two otherwise; a learner without slots gets
      exactly `num_members + k` members, as before.

  Returns:
    A new learner with `num_members + k` members whose first `num_members`
    slices are the old members, bitwise; its structure is
    `(num_members + k, k)`: the new members are the trainable ones. Inside
    the slots only values change (the same shapes, the same programs).
  """
  if init not in MEMBER_INITS:
    raise ValueError(f"add_member: init={init!r} is unknown; valid values: {list(MEMBER_INITS)}")
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"add_member: k={k!r} must be an integer >= 1")
  c = num_members(state.params)
  active = active_slots(state.model_state)
  n = state.structure[0] if isinstance(state.structure, tuple) and state.structure else None
  if not (isinstance(state.structure, tuple) and len(state.structure) == 2
          and isinstance(n, int) and (n == c or (active is not None and n <= c))):
    raise ValueError(f"add_member needs an ensemble learner with structure (num_members, "
                     f"num_trainable) and {n} stacked members; got structure {state.structure!r}")
  params, model_state = _new_members(state, key, init, k, init_fn)
  if active is None and slots is None:
    return base.Learner(params=_concat(state.params, params, "params"),
                        model_state=_concat(state.model_state, model_state, "model_state"),
                        structure=(n + k, k))
  if slots is None:
    slots = c if n + k <= c else slots_lib.next_power_of_two(n + k)
  slots = max(int(slots), n + k)
  _check_new(state.params, params, "params")
  _check_new(backbone_state(state.model_state), model_state, "model_state")
  params, model_state = _put_in_slots((state.params, backbone_state(state.model_state)),
                                      (params, model_state), np.int32(n), slots=slots)
  return base.Learner(params=params,
                      model_state=_with_slots(model_state, slots_lib.mask(n + k, slots)),
                      structure=(n + k, k))


@functools.partial(jax.jit, static_argnames="slots")
def _put_in_slots(old: PyTree, new: PyTree, n, *, slots: int) -> PyTree:
  """`old` held in `slots` slots with the stacked `new` written from slot `n` on: one program
  per shapes and slots, whichever members are added."""
  return slots_lib.put(slots_lib.resize(old, slots), new, n)


# -- the methods --------------------------------------------------------------------------------------
@register
class Ensemble(declared.Ens, base.SingleBackbone, base.Method):
  """Ens: N independently trained members; the mean of their probabilities."""

  @property
  def LEAF_AXES(self):  # pylint: disable=invalid-name
    """Every leaf is stacked on the member axis, before the backbone's own axes."""
    own = tuple((pattern, ("member",) + axes) for pattern, axes in super().LEAF_AXES)
    return own + (("", ("member",)),)

  @property
  def initial_members(self) -> int:
    return self.opts.num_members

  @property
  def run_as(self) -> str:
    """The strategy actually used: "vmap" or "loop"."""
    return choose_strategy(self.opts.strategy, self.config.model.name)

  _counting = False  # set on the copy `counted` returns

  def counted(self) -> "Ensemble":
    """This method with its members run as one `jax.vmap` over all of them: the form its
    compute is counted in (`base.Method.counted`). With "loop" (and vmap's chunks) the
    gradient of every member's slice is a cotangent of the whole stacked params, added up
    across members (`add_any`): work of the execution strategy, not of the learning
    algorithm, which made Comp depend on the strategy."""
    view = copy.copy(super().counted())
    view._counting = True  # pylint: disable=protected-access
    return view

  def _map_members(self, fn: Callable, stacked: tuple):
    """`map_members` with the run's strategy, or one vmap over all members when counting."""
    if self._counting:
      return map_members(fn, stacked, "vmap", chunk=max(1, num_members(stacked)))
    return map_members(fn, stacked, self.run_as)

  # -- hidden units (`alma_jax.models.units`) ---------------------------------------------------
  @property
  def unit_members(self) -> int:
    return self.initial_members

  def hidden_units(self, structure, params, model_state, x) -> list:
    """Every member's hidden units on `x`, side by side (`Method.hidden_units`)."""
    del structure
    per_member = jax.vmap(lambda p, s: self.backbone_units(p, s, x))(params, model_state)
    return [jnp.moveaxis(h, 0, -2).reshape(h.shape[1:-1] + (-1,)) for h in per_member]

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

  def member_outputs(self, params, model_state, x, *, train: bool, mask=None, stacked_x: bool):
    """(logits (n, b, ...), aux (the backbones' `aux`, stacked), new model_state) of the
    stacked members.

    `stacked_x`: whether x and mask carry a member axis (one data order per
    member) or are shared by all members.
    """

    def one(p, s, *xm):
      xi, mi = xm if stacked_x else (x, mask)
      return self.forward_backbone(p, s, xi, train=train, mask=mi)

    stacked = (params, backbone_state(model_state)) + ((x, mask) if stacked_x else ())
    logits, aux, new_state = self._map_members(one, stacked)
    active = active_slots(model_state)
    return logits, aux, (new_state if active is None else _with_slots(new_state, active))

  def member_logits(self, params, model_state, x, *, train: bool, mask=None, stacked_x: bool):
    """(logits (n, b, ...), new model_state) of the stacked members (`member_outputs`)."""
    logits, _, new_state = self.member_outputs(params, model_state, x, train=train, mask=mask,
                                               stacked_x=stacked_x)
    return logits, new_state

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    """Sum over the trained members of each one's loss (the task's) on its own x[i]; each
    member's dropout key is its own split of `rng`."""
    del frozen
    n, k = structure
    active = active_slots(model_state)
    keys = () if rng is None else (jax.random.split(rng, k),)

    def one(p, s, xi, yi, mi, ki=None):
      logits, aux, new_s = self.forward_backbone(p, s, xi, train=True, mask=mi, rng=ki)
      return self.task.loss(logits, yi, mi, aux), new_s

    if active is None:
      frozen_state, state = _split(model_state, n - k)
      losses, new_state = self._map_members(one, (trainable, state, x, y, mask) + keys)
      return jnp.sum(losses), _restack(frozen_state, new_state, n - k)
    # Slots: the trained members are slots [n - k, n), n counted from the active slots.
    start = jnp.sum(active.astype(jnp.int32)) - k
    members = backbone_state(model_state)
    state = slots_lib.take(members, start, k)
    losses, new_state = self._map_members(one, (trainable, state, x, y, mask) + keys)
    members = slots_lib.put(members, new_state, start)
    return jnp.sum(losses), _with_slots(members, active)

  # -- inference ------------------------------------------------------------------------------------
  def predict(self, structure, params, model_state, x) -> jnp.ndarray:
    """The members' combined prediction (`combine_members`)."""
    logits, _ = self.member_logits(params, model_state, x, train=False, stacked_x=False)
    return self.combine_members(logits, structure[0], active_slots(model_state))

  def combine_members(self, logits, n: int, active=None) -> jnp.ndarray:
    """log(mean_i softmax(logits_i)): the mean of the members' probabilities (over the
    `active` slots alone when given)."""
    logp = jax.nn.log_softmax(logits)
    if active is None:
      return jax.nn.logsumexp(logp, axis=0) - math.log(n)
    count = (math.log(int(np.sum(active))) if isinstance(active, np.ndarray)
             else jnp.log(jnp.sum(active).astype(logp.dtype)))
    logp = jnp.where(_per_member(active, logp), logp, -jnp.inf)
    return jax.nn.logsumexp(logp, axis=0) - count

  # -- best-epoch selection: every trained member on its own ------------------------------------
  units_are_parts = True

  def num_units(self, structure) -> int:
    return structure[1]

  def predict_units(self, structure, params, model_state, x):
    n, k = structure
    logits, _ = self.member_logits(params, model_state, x, train=False, stacked_x=False)
    active = active_slots(model_state)
    if active is None:
      return self.combine_members(logits, n), jax.nn.log_softmax(logits[n - k:])
    start = jnp.sum(active.astype(jnp.int32)) - k
    trained = jax.lax.dynamic_slice_in_dim(logits, start, k)
    return self.combine_members(logits, n, active), jax.nn.log_softmax(trained)

  def structure_read(self, structure):
    return structure  # how many members there are and which of them train

  def select_units(self, structure, take, new: base.Learner, old: base.Learner) -> base.Learner:
    n, k = structure
    c = num_members(new.params)
    members = jnp.concatenate([jnp.zeros((n - k,), bool), take, jnp.zeros((c - n,), bool)])

    def pick(a, b):
      return jnp.where(members.reshape((c,) + (1,) * (a.ndim - 1)), a, b)

    return old.replace(params=jax.tree.map(pick, new.params, old.params),
                       model_state=jax.tree.map(pick, new.model_state, old.model_state))

  # -- accounting -------------------------------------------------------------------------------------
  def describe(self, learner: base.Learner) -> dict:
    n, k = learner.structure
    return {"num_params": self.num_params(learner), "members": n, "trained_members": k,
            "strategy": self.run_as}


@register
class UniformMixture(declared.UMix, Ensemble):
  """UMix: one model whose logits are the mean (or sum) of the members' logits."""

  def num_data_orders(self, structure) -> int:
    del structure
    return 1

  # One model on one data order: the task's loss and the log-softmax of `outputs`, selected
  # as a whole.
  loss = base.Method.loss
  predict = base.Method.predict
  units_are_parts = False
  num_units = base.Method.num_units
  predict_units = base.Method.predict_units
  select_units = base.Method.select_units

  def outputs(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """The mean of the members' logits; the members' aux outputs averaged."""
    del structure, rng
    logits, aux, new_state = self.member_outputs(params, model_state, x, train=train, mask=mask,
                                                 stacked_x=False)
    combined = jnp.sum(logits, axis=0) if self.opts.combine == "sum" else jnp.mean(logits, axis=0)
    return combined, jax.tree.map(lambda a: jnp.mean(a, axis=0), aux), new_state


@register
class GrowingEnsemble(declared.GEns, Ensemble):
  """gEns: adds `grow_by` members before every stage but the first; trains only those.

  The first stage trains the `initial_members` members (paper section 4.2:
  "when starting with a single component and until the next growing step,
  the cost of training gEns is equal to SM"; Appendix B.1: one model is
  trained at every mega-batch). Growing before the first stage as well would
  leave an untrained, frozen member in the average forever. With
  config.stream.init_from_scratch=True new members are always fresh; old
  members are never retrained, so `reinit` keeps them.
  """

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    self.refuse_kept_optimizer_state("every stage trains new members")

  @property
  def initial_members(self) -> int:
    return self.opts.initial_members

  # -- hidden units (`alma_jax.models.units`) ---------------------------------------------------
  def unit_members_of(self, learner: base.Learner) -> int:
    return slots_lib.leading_size(learner.params)  # every member slot's units, side by side

  def hidden_units(self, structure, params, model_state, x) -> list:
    return super().hidden_units(structure, params, backbone_state(model_state), x)

  def unit_active(self, learner: base.Learner) -> list[np.ndarray]:
    """The units of the n members (not of the padding slots)."""
    return self._member_units(learner, 0, learner.structure[0])

  def unit_trained(self, learner: base.Learner) -> list[np.ndarray]:
    """The units of the k members the stage trains (the others are frozen)."""
    n, k = learner.structure
    return self._member_units(learner, n - k, n)

  def _member_units(self, learner: base.Learner, first: int, end: int) -> list[np.ndarray]:
    """Per layer, the units of member slots first ... end - 1 (member-major)."""
    layout, slots = self.unit_layout(), self.unit_members_of(learner)
    members = (np.arange(slots) >= first) & (np.arange(slots) < end)
    return [np.repeat(members, leaf_at(learner.params, layout.kernels[l]).shape[-1])
            for l in range(len(layout.units))]

  # -- member slots ---------------------------------------------------------------------------
  def slots(self, members: int) -> int:
    """The member slots of an ensemble of `members` members (`method.slots`)."""
    return slots_lib.capacity(members, self.opts.slots)

  def program_structure(self, structure) -> tuple[int, int]:
    n, k = structure
    return (self.slots(n), k)

  def program_change(self, old, new) -> str:
    if old[1] == new[1]:
      return f"new slot count: {old[0]} -> {new[0]} member slots"
    return f"new structure: {new[0]} member slots, {new[1]} of them trained (was {old})"

  def init(self, key: jax.Array, structure: Hashable | None = None) -> base.Learner:
    if structure is None or structure == ():
      structure = self.initial_structure()
    self.check_structure(structure)
    n, c = structure[0], self.slots(structure[0])
    params, model_state = self.init_members(key, c)  # slot i as member i would be
    return base.Learner(params=params, model_state=_with_slots(model_state, slots_lib.mask(n, c)),
                        structure=tuple(structure))

  def partition(self, learner: base.Learner):
    """(the trained members, None): frozen members stay in the learner, out of the train
    state, so its shapes do not depend on how many there are."""
    n, k = learner.structure
    return take_members(learner.params, n - k, k), None

  def combine(self, learner: base.Learner, trainable):
    n, k = learner.structure
    return slots_lib.put(learner.params, trainable, n - k)

  def active_view(self, learner: base.Learner) -> base.Learner:
    """The n members alone (no padding slots), as shapes."""
    n = learner.structure[0]
    return learner.replace(params=slots_lib.cut_shapes(learner.params, n),
                           model_state={**slots_lib.cut_shapes(backbone_state(learner.model_state),
                                                               n),
                                        SLOTS_KEY: {"active": slots_lib.mask(n, n)}})

  def check_structure(self, structure) -> None:
    ok = (isinstance(structure, tuple) and len(structure) == 2
          and all(isinstance(v, int) for v in structure) and 1 <= structure[1] <= structure[0])
    if not ok:
      raise ValueError(f"structure {structure!r} does not fit gens: expected (num_members, "
                       "num_trainable) with 1 <= num_trainable <= num_members")

  def reinit(self, learner: base.Learner, key: jax.Array) -> base.Learner:
    del key
    return learner

  def fresh_init(self, learner: base.Learner, key: jax.Array) -> base.Learner:
    """The learner with the members its stage trains (the last k of its n) drawn afresh, as
    `add_member` draws fresh members (`init_backbone`, member j from `fold_in(key, j)`); the
    frozen members and the padding slots as they are."""
    n, k = learner.structure
    params, model_state = _new_members(learner, key, "fresh", k, self.init_backbone)
    _check_new(learner.params, params, "params")
    _check_new(backbone_state(learner.model_state), model_state, "model_state")
    params, model_state = _put_in_slots(
        (learner.params, backbone_state(learner.model_state)), (params, model_state),
        np.int32(n - k), slots=num_members(learner.params))
    active = active_slots(learner.model_state)
    return learner.replace(params=params, model_state=(
        model_state if active is None else _with_slots(model_state, active)))

  def combine_members(self, logits, n: int, active=None) -> jnp.ndarray:
    if self.opts.combine == "logits":
      if active is None:
        return jax.nn.log_softmax(jnp.mean(logits, axis=0))
      total = jnp.sum(jnp.where(_per_member(active, logits), logits, 0), axis=0)
      return jax.nn.log_softmax(total / jnp.sum(active).astype(logits.dtype))
    return super().combine_members(logits, n, active)

  def before_stage(self, learner: base.Learner, key: jax.Array, ctx) -> base.Learner:
    """Appends `grow_by` members (they alone are trained), except before the first stage."""
    if ctx.is_first:
      return learner
    scratch = bool(F.get(self.config.stream, "stream.init_from_scratch"))
    n = learner.structure[0] + self.opts.grow_by
    return add_member(learner, key, init="fresh" if scratch else self.opts.new_member,
                      k=self.opts.grow_by, init_fn=self.init_backbone, slots=self.slots(n))
