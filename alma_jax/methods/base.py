"""The learner state, the stage context and the interface every method implements.

A method is a bundle of pure functions over a `Learner` pytree. The training
loop (`alma_jax.stream.run`, `alma_jax.engine.train`, `alma_jax.engine.steps`) only calls the
functions of `Method` below, so a new method is one file: a subclass that
declares its config fields (`FIELDS`), overrides what it needs and registers
itself by name (`alma_jax.methods.register`). Methods built on one Flax
backbone from `config.model` mix in `SingleBackbone`.

A method knows nothing of the kind of data: it computes logits (and whatever
the backbone returns beside them) and asks its task (`Method.task`, the task
of the config: `alma_jax.tasks`) for the loss, so one method class serves
images and text alike.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alma_jax import tasks
from alma_jax.configuration import fields
from alma_jax.configuration.plugins import methods as declared
from alma_jax.errors import ConfigError
from alma_jax.models import registry as backbones
from alma_jax.models import slots
from alma_jax.models import units
from alma_jax.runtime import fused_draws
from alma_jax.state import Learner

PyTree = Any


@dataclasses.dataclass(frozen=True)
class StageContext:
  """What a method may look at around a training stage (one learner of the population).

  Attributes:
    t: the time step of the stage.
    stage: its index among the stages (1 = the first).
    is_first: whether it is the first stage of the stream.
    train_idx, val_idx: the stage's training and validation examples
      (indices into the training split).
    reduce: `reduce(fn, learner, idx)` sums, over the examples `idx` of the
      training split (unaugmented), what `fn(structure, params, model_state,
      x, y, mask, task)` returns for each batch (a pytree of arrays), compiled
      once per (fn, structure); for scoring passes before or after a stage.
    scan: `scan(fn, carry, learner, idx)` threads `carry = fn(structure, params,
      model_state, x, y, mask, carry, task)` through those batches in order
      (for fitting growth candidates).
    eval_aux: `eval_aux(learner, idx)` sums the method's `Method.eval_aux` over
      the examples `idx` of the training split, computed by the evaluation
      program itself (no program of its own: a scoring pass that adds no
      compilation).
  """

  t: int
  stage: int
  is_first: bool
  train_idx: np.ndarray
  val_idx: np.ndarray
  reduce: Callable[..., PyTree]
  scan: Callable[..., PyTree] | None = None
  eval_aux: Callable[..., PyTree] | None = None


count_params = slots.count_params


class Method(declared.Declaration):
  """The interface of a method; subclasses implement `init` and `outputs` or `logits` (or
  `loss` and `predict`).

  All functions are pure: they take the learner (or its parts) and return
  new values, never mutating their inputs.

  Class attributes:
    name, FIELDS: the registry name (`config.method.name`) and the method's own config
      fields (paths under "method."), from its declaration
      (`alma_jax.configuration.plugins.methods`); their checked values are
      `self.opts.<field name>`. A method whose fields depend on the backbone overrides
      `fields` there.
    same_growth_for_every_seed: whether the architecture grows the same way
      for every seed, so that several seeds can share one program
      (`config.num_seeds`).
    LEAF_AXES: the logical axes (`alma_jax.engine.sharding`) of the leading
      dimensions of parameter leaves, after the population axis: pairs of a
      regular expression searched in the leaf's path (`jax.tree_util.keystr`
      in the params, the model state or the optimizer state) and the names of
      its leading dimensions; the first match wins, other leaves are
      replicated. E.g. `(("", ("member",)),)`: every leaf has a member axis.
  """

  same_growth_for_every_seed = True
  LEAF_AXES: tuple[tuple[str, tuple[str, ...]], ...] = ()

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    self.config = config
    self.input_shape = tuple(input_shape)
    self.num_classes = num_classes
    self.opts = fields.resolve(config, self.fields(config))
    self.task = tasks.for_config(config)  # its loss is the training loss

  def refuse_kept_optimizer_state(self, why: str, when: str = "") -> None:
    """A clear error when `train.keep_optimizer_state` is set for a method whose stages
    change the parameters' shapes or the trained parameters (`why` says how)."""
    if bool(fields.get(self.config.train, "train.keep_optimizer_state")):
      raise ConfigError(f"config.train.keep_optimizer_state=True is not supported by "
                        f"{self.name}{when}: {why}; allowed values: [False]")

  # -- construction ---------------------------------------------------------
  def init(self, key: jax.Array, structure: Hashable | None = None) -> Learner:
    """A fresh learner; with `structure` (a checkpoint's), one of that structure."""
    raise NotImplementedError

  def reinit(self, learner: Learner, key: jax.Array) -> Learner:
    """Re-initialises all parameters, keeping the learner's structure."""
    return self.init(key, learner.structure)

  def fresh_init(self, learner: Learner, key: jax.Array) -> Learner:
    """A fresh initialisation of what the learner's stage trains, in the learner's layout (the
    values that `shrink_perturb` mixes in); default: `reinit`."""
    return self.reinit(learner, key)

  def program_structure(self, structure: Hashable) -> Hashable:
    """What the compiled programs of a learner depend on: the shapes of its arrays.

    Programs are compiled once per program structure and are traced with it
    in place of `structure`, so every function that runs inside them
    (`loss`, `predict`, `predict_units`, passes over data) must accept it.
    A method that allocates growth in slots (gMoE experts, gEns members, FF
    channels; `alma_jax.models.slots`) maps every structure that fits the
    same slots to one value and keeps the rest (which slots are active, the
    gating tree) in arrays; the default is the structure itself. Must be
    idempotent.
    """
    return structure

  def program_change(self, old: Hashable, new: Hashable) -> str:
    """Why programs compile again when the program structure goes from `old` to `new`
    (for the progress log; methods with slots name the slot count)."""
    return f"new structure {_short(new)}, was {_short(old)}"

  def active_view(self, learner: Learner) -> Learner:
    """The learner without its padding slots: what Mem and Comp count (default: itself)."""
    return learner

  # -- hidden units (`alma_jax.models.units`) --------------------------------------------
  def unit_layout(self):
    """The hidden layers of the learner whose units the plasticity diagnostics measure and
    the unit-reset policies re-draw (a `alma_jax.models.registry.WidthLayout` with its
    `units`), or None: the method exposes none (the default)."""
    return None

  def hidden_units(self, structure, params, model_state, x) -> list:
    """Each hidden layer's output after its activation on a batch `x` (inference mode), in
    the order of `unit_layout()`'s layers, units on the last axis; only for methods with a
    `unit_layout`. With `unit_members` > 0, the members' units side by side (member-major:
    unit u of member m is m * width + u)."""
    raise NotImplementedError(f"method {self.name!r} exposes no hidden units")

  def unit_active(self, learner: Learner) -> list[np.ndarray] | None:
    """Per layer of `unit_layout()`, which of `hidden_units`' units are the learner's (bool);
    None: all of them. A method whose layers hold padding slots says which are active."""
    del learner
    return None

  def unit_trained(self, learner: Learner) -> list[np.ndarray] | None:
    """Per layer, which units a reset may re-draw: the learner's units that its stages train
    (default: all of `unit_active`'s; a method with frozen parts leaves theirs out)."""
    return self.unit_active(learner)

  def unit_outgoing(self, learner: Learner, layer: int) -> np.ndarray:
    """Per unit of `layer`, the summed magnitude of its outgoing weights (continual
    backprop's utility: `alma_jax.models.units.outgoing_weight` of the learner's parameters;
    a method whose readers of a unit hold padding slots leaves them out)."""
    return units.outgoing_weight(self.unit_layout(), learner.params, layer,
                                 self.unit_members_of(learner))

  # Members whose units `hidden_units` puts side by side, every leaf of the unit layout
  # stacked on a leading member axis; 0: one network, no member axis.
  unit_members = 0

  def unit_members_of(self, learner: Learner) -> int:
    """`unit_members` for `learner` (a method whose members grow in slots: its member
    slots)."""
    del learner
    return self.unit_members

  def counted(self) -> "Method":
    """The method whose traced programs Comp counts (`alma_jax.engine.accounting`): the same
    learning algorithm in one canonical execution form, so that the FLOPs counted do not
    depend on how a run executes it (an ensemble's `method.strategy`). Default: itself."""
    return self

  # -- training -------------------------------------------------------------
  def num_data_orders(self, structure: Hashable) -> int:
    """How many independent data orders a train step consumes (members)."""
    del structure
    return 1

  def partition(self, learner: Learner) -> tuple[PyTree, PyTree]:
    """Splits params into (trainable, frozen); only `trainable` gets gradients."""
    return learner.params, None

  def combine(self, learner: Learner, trainable: PyTree) -> PyTree:
    """Inverse of `partition`: the full params with `trainable` put back."""
    del learner
    return trainable

  def outputs(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """(logits, aux, new_model_state) of the whole model on a batch `x`; `aux` holds what the
    backbone returns beside its logits for the task's loss (e.g. an auxiliary loss), {} for
    most backbones.

    Methods trained on one data order implement this or `logits`; `loss` and
    `predict` follow from it (methods with several data orders override those
    instead). By default: `logits` and no `aux`.
    """
    logits, new_state = self.logits(structure, params, model_state, x, train=train, mask=mask,
                                    rng=rng)
    return logits, {}, new_state

  def logits(self, structure, params, model_state, x, *, train: bool, mask=None, rng=None):
    """(logits, new_model_state) of the whole model on a batch `x`: `outputs` without aux."""
    if type(self).outputs is Method.outputs:
      raise NotImplementedError(f"{type(self).__name__} implements neither outputs nor logits")
    logits, _, new_state = self.outputs(structure, params, model_state, x, train=train,
                                        mask=mask, rng=rng)
    return logits, new_state

  def loss(self, structure, trainable, frozen, model_state, x, y, mask, rng):
    """Training loss on a batch; returns (loss, new_model_state).

    `x`, `y` and `mask` carry a leading axis of size `num_data_orders`. By
    default: the task's loss of `outputs` on the one data order.
    """
    del frozen
    logits, aux, new_state = self.outputs(structure, trainable, model_state, x[0], train=True,
                                          mask=mask[0], rng=rng)
    return self.task.loss(logits, y[0], mask[0], aux), new_state

  # -- inference --------------------------------------------------------------
  def predict(self, structure, params, model_state, x) -> jnp.ndarray:
    """Log-probabilities of the classes, shape (batch, num_classes)."""
    logits, _ = self.logits(structure, params, model_state, x, train=False)
    return jax.nn.log_softmax(logits)

  # -- best-epoch selection -----------------------------------------------------
  # A stage keeps, for each "unit" of the trained parameters, the epoch where that unit's
  # own validation accuracy was best: one unit by default (the whole model); an ensemble's
  # members are units of their own (`units_are_parts`).
  units_are_parts = False

  def num_units(self, structure) -> int:
    """How many independently selected parts the trained parameters have."""
    del structure
    return 1

  def predict_units(self, structure, params, model_state, x):
    """(log-probabilities of the model (b, C), of each unit (U, b, C))."""
    logp = self.predict(structure, params, model_state, x)
    return logp, logp[None]

  def structure_read(self, structure) -> Hashable | None:
    """What of `structure` `partition`, `combine` and `select_units` read: None when they
    read nothing (the defaults); the small programs built of them (a stage's start, the
    epoch's rule) are compiled once per distinct value, else once per program structure."""
    del structure
    return None

  def select_units(self, structure, take, new: Learner, old: Learner) -> Learner:
    """`new` for the units where `take` (U,) is true, `old` for the others."""
    del structure
    return jax.tree.map(lambda a, b: jnp.where(take[0], a, b), new, old)

  def eval_aux(self, structure, params, model_state, x, y, mask, task) -> PyTree:
    """What the evaluation program also sums over a batch for the method's own use (e.g.
    gMoE's growth scores; see `StageContext.eval_aux`); nothing by default."""
    del structure, params, model_state, x, y, mask, task
    return ()

  def evaluate_batch(self, structure, params, model_state, x, y, mask, task):
    """What the evaluation program computes of a batch: (`predict_units`'s two outputs,
    `eval_aux`). A method whose `eval_aux` needs its forward pass overrides this to run
    that pass once."""
    logp, unit_logp = self.predict_units(structure, params, model_state, x)
    return logp, unit_logp, self.eval_aux(structure, params, model_state, x, y, mask, task)

  # -- growth -------------------------------------------------------------------
  def before_stage(self, learner: Learner, key: jax.Array, ctx: StageContext) -> Learner:
    """Called before each training stage (gEns adds members, gMoE splits experts)."""
    del key, ctx
    return learner

  # -- accounting -------------------------------------------------------------
  def num_params(self, learner: Learner) -> int:
    """Mem: the parameters of the learner's active parts (`active_view`); of their shapes, so
    `learner` may be abstract."""
    return count_params(jax.eval_shape(self.active_view, learner).params)

  def describe(self, learner: Learner) -> dict:
    """JSON-friendly facts about the current architecture, for progress logs."""
    return {"num_params": self.num_params(learner)}


def _short(value, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def split_outputs(out) -> tuple[jax.Array, dict]:
  """A backbone's output as (logits, aux): backbones return logits, or (logits, aux dict)."""
  return (out[0], out[1]) if isinstance(out, tuple) else (out, {})


def apply_module(module: nn.Module, params, model_state, x, *, train: bool, mask=None,
                 rng=None):
  """Runs a backbone module; returns (logits, aux, new_model_state) (see `split_outputs`);
  in training its non-trained collections (BatchNorm statistics) are updated, and `rng` (if
  given) is its dropout key."""
  variables = {"params": params, **model_state}
  rngs = {"dropout": rng} if train and rng is not None else None
  if train and model_state:
    out, updates = module.apply(variables, x, train=True, mask=mask, mutable=list(model_state),
                                rngs=rngs)
    return *split_outputs(out), dict(updates)
  return (*split_outputs(module.apply(variables, x, train=train, mask=mask, rngs=rngs)),
          model_state)


def init_variables(module: nn.Module, key: jax.Array, *args, **kwargs) -> dict:
  """A backbone's initial variables: its class's `init_variables(module, key, ...)` where it has
  one (a backbone whose parameter layout differs from how it initialises, e.g. the Switch
  Transformer's layers stacked for a scan), else `module.init(key, ...)`."""
  own = getattr(type(module), "init_variables", None)
  return own(module, key, *args, **kwargs) if own else module.init(key, *args, **kwargs)


def backbone_leaf_axes(backbone) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """The logical axes of the stacked leaves of a backbone (a module or its class: the class's
  `LEAF_AXES`, e.g. the Switch Transformer's experts), in the form of `Method.LEAF_AXES`;
  none by default."""
  cls = backbone if isinstance(backbone, type) else type(backbone)
  return tuple(getattr(cls, "LEAF_AXES", ()))


class SingleBackbone:
  """Mixin for methods built on the one Flax backbone that `config.model` names (built by the
  task for its inputs: `Task.backbone`)."""

  def __init__(self, config, input_shape: tuple[int, ...], num_classes: int):
    super().__init__(config, input_shape, num_classes)
    self.backbone: nn.Module = self.task.backbone(config.model, num_classes, self.input_shape)
    self._init_fn = None

  @property
  def LEAF_AXES(self):  # pylint: disable=invalid-name
    return backbone_leaf_axes(self.backbone)

  def init_backbone(self, key: jax.Array) -> tuple[PyTree, PyTree]:
    """Initialises one backbone; returns (params, model_state)."""
    if self._init_fn is None:
      # One compiled program: run eagerly, the initialisers' many small ops
      # take seconds on CPU. A numpy dummy: the first call may come inside a
      # transformation (vmap, eval_shape), where a jnp array would be a
      # tracer leaking into the cache. Its draws hashed together: `fused_draws`.
      dummy = np.zeros((1,) + self.input_shape, self.task.input_dtype)
      self._init_fn = jax.jit(fused_draws.fuse_draws(
          lambda k: init_variables(self.backbone, k, dummy, train=False)))
    variables = self._init_fn(key)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    return params, model_state

  @functools.cache
  def unit_layout(self):
    """The backbone's growable layers (`BackboneSpec.width_layout`) where it sows their units
    (`WidthLayout.units`); None for a backbone without them (the Switch Transformer)."""
    build = backbones.spec(self.config.model.name).width_layout
    layout = None if build is None else build(self.config.model, self.num_classes)
    return layout if layout is not None and layout.units else None

  def backbone_units(self, params, model_state, x) -> list:
    """One backbone's sown hidden-layer outputs on `x` (inference), in `unit_layout()`'s
    order; `Method.hidden_units`' error for a backbone that sows none."""
    layout = self.unit_layout()
    if layout is None:
      return Method.hidden_units(self, (), params, model_state, x)  # raises
    _, sown = self.backbone.apply({"params": params, **model_state}, x, train=False,
                                  mutable=["intermediates"])
    return [backbones.leaf_at(sown["intermediates"], path)[0] for path in layout.units]

  def forward_backbone(self, params, model_state, x, *, train: bool, mask=None, rng=None):
    """Runs one backbone; returns (logits, aux, new_model_state) (`apply_module`; `rng`: the
    dropout key in training)."""
    return apply_module(self.backbone, params, model_state, x, train=train, mask=mask, rng=rng)

  def apply_backbone(self, params, model_state, x, *, train: bool, mask=None):
    """Runs one backbone; returns (logits, new_model_state)."""
    logits, _, new_state = self.forward_backbone(params, model_state, x, train=train, mask=mask)
    return logits, new_state
