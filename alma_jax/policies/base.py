"""The interfaces of stage and waiting policies, their registry, and the config's alias.

A new policy is one file in this package: a subclass of `StagePolicy` (or
`WaitPolicy`) with a `name`, decorated with `@register`; the config field
`stream.warm_start` (or `stream.wait_policy`) then takes that name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.configuration import fields as F
from alma_jax.configuration import plugins
from alma_jax.configuration.plugins import methods as declared_methods
from alma_jax.configuration.plugins import policies as declared
from alma_jax.errors import ConfigError
from alma_jax.models import registry as backbones
from alma_jax.runtime import host_random

PyTree = Any


# A learner's stage key k gives fold_in(k, i) (`alma_jax.runtime.host_random.fold_in`): i = 1
# re-initialises (a policy), 2 grows before the stage (`Method.before_stage`), 3 trains; 4 is
# not used. A policy that needs keys of its own folds in FIRST_FREE_KEY or above.
REINIT_KEY, GROWTH_KEY, FIRST_FREE_KEY = 1, 2, 5


class StagePolicy(declared.Declaration):
  """How a learner starts a training stage; its one hook in the loop is `start_stage`.

  The loop calls `start_stage` at every stage, for every learner of the
  population, whatever the method, and trains from what it returns. The
  method's growth before the stage (`Method.before_stage`) runs inside the
  hook, through `grow`, so a policy can act before growth, after it, or
  both: e.g. the members that a gEns stage trains exist only after its
  growth, and `scratch` grows on the trained learner, then re-initialises.
  `fresh_trained_units` re-initialises what a stage trains and nothing else.

  Class attributes:
    name, FIELDS: the registry name (`config.stream.warm_start`) and the config fields the
      policy reads, from its declaration (`alma_jax.configuration.plugins.policies`).
  """

  def __init__(self, config):
    self.config = config

  @classmethod
  def check(cls, config) -> None:
    """Raises `ConfigError` for a config the policy cannot serve (its method, its fields)."""
    del config

  def start(self, method, learner, key: jax.Array, ctx, opt_state: PyTree | None,
            memo: dict | None) -> "Started":
    """`start_stage` with the policy's memory of this learner: `memo` is what the previous
    stage's `start` returned (None before the first stage), a JSON-able dict that the run's
    checkpoints keep, so a resumed run starts its stages as an uninterrupted one does. A
    policy that remembers nothing (the default) implements `start_stage` alone."""
    learner, opt_state = self.start_stage(method, learner, key, ctx, opt_state)
    return Started(learner, opt_state, memo)

  def start_stage(self, method, learner, key: jax.Array, ctx, opt_state: PyTree | None):
    """(learner, optimizer state) that the stage at `ctx.t` trains from.

    Args:
      method: the run's method (`alma_jax.methods.Method`).
      learner: one learner (unstacked), as the previous stage left it.
      key: this learner's key of the stage (see `REINIT_KEY`).
      ctx: the stage's context (`alma_jax.methods.StageContext`).
      opt_state: this learner's optimizer state after the previous stage, or None
        (the stage then starts a fresh one); always None with
        `train.keep_optimizer_state=False`, which also discards what this returns.

    The default grows (`grow`) and keeps everything else.
    """
    return self.grow(method, learner, key, ctx), opt_state

  def grow(self, method, learner, key: jax.Array, ctx):
    """The method's growth before the stage (`Method.before_stage`), with its key."""
    return method.before_stage(learner, host_random.fold_in(key, GROWTH_KEY), ctx)


def _mixture_units(spec, model_config) -> bool:
  """Whether backbone `spec`'s mixtures declare hidden units (`Mixture.expert_units`)."""
  return spec.mixture is not None and spec.mixture(model_config, 2).expert_units is not None


def _exposes_units(declaration, model_config) -> bool:
  """Whether method `declaration` has hidden units on backbone `model_config.name`."""
  spec = backbones.spec(model_config.name)
  if declaration.HIDDEN_UNITS == declared_methods.MIXTURE_UNITS:
    return _mixture_units(spec, model_config)
  build = spec.width_layout
  return bool(declaration.HIDDEN_UNITS) and build is not None and bool(
      build(model_config, 2).units)


def check_unit_resets(config, policy: str) -> None:
  """Raises `ConfigError` unless a policy that re-draws hidden units (`policy`) can serve the
  config: a method with hidden units it exposes (`Method.unit_layout`: sm, ens, umix, gens or
  ff on a backbone that sows them, gmoe on one whose mixtures declare them) and a fresh
  optimizer state at every stage (a kept one would hold the moments of the weights before
  they were re-drawn)."""
  method = plugins.method(config.method.name)
  if not _exposes_units(method, config.model):
    mixture = declared_methods.MIXTURE_UNITS
    names = [n for n, d in sorted(plugins.METHODS.items())
             if d.HIDDEN_UNITS and d.HIDDEN_UNITS != mixture]
    mixing = [n for n, d in sorted(plugins.METHODS.items()) if d.HIDDEN_UNITS == mixture]
    able = backbones.names(lambda s: s.width_layout is not None)
    able_mixing = backbones.names(lambda s: _mixture_units(s, config.model))
    raise ConfigError(f"config.stream.warm_start={policy!r} re-draws hidden units, which method "
                      f"{method.name!r} on backbone {config.model.name!r} does not expose; "
                      f"valid: config.method.name in {names} with config.model.name in {able}, "
                      f"or in {mixing} with config.model.name in {able_mixing}")
  if bool(F.get(config.train, "train.keep_optimizer_state")):
    raise ConfigError(f"config.train.keep_optimizer_state=True is not supported by "
                      f"config.stream.warm_start={policy!r}: the kept moments belong to the "
                      f"weights before they were re-drawn; allowed values: [False]")


@dataclasses.dataclass(frozen=True)
class Started:
  """What `StagePolicy.start` returns for one learner.

  Attributes:
    learner, opt_state: what the stage trains from (as `StagePolicy.start_stage`).
    memo: the policy's memory of the learner for its next stage (JSON-able; None: none).
    fields: record fields of the stage's time step (e.g. how many units were re-drawn).
  """

  learner: Any
  opt_state: Any
  memo: dict | None = None
  fields: dict = dataclasses.field(default_factory=dict)


def fresh_trained_units(method, learner, key: jax.Array):
  """`learner` with the parts that its stage trains drawn afresh, the others kept.

  The parts are the method's selection units (`Method.select_units`): the
  whole model for most methods; for gEns the members its structure marks as
  trained (after growth: the new ones), so frozen members stay untouched. The
  fresh values are those of `method.init(key, learner.structure)`.
  """
  fresh = method.init(key, learner.structure)
  take = jnp.ones((method.num_units(learner.structure),), bool)
  return method.select_units(learner.structure, take, fresh, learner)


@dataclasses.dataclass(frozen=True)
class Decision:
  """A waiting policy's decision at one time step.

  Attributes:
    train: whether the learner trains at this step.
    reason: why (a short phrase; '' for policies that record nothing).
    fields: each seed's record fields of the decision (`Record.extra`), one dict per seed;
      empty for policies that record nothing (the fixed wait).
    flops, macs: each seed's cost of deciding (FLOPs and forward multiply-adds of the
      evaluations it ran; zero for a schedule).
  """

  train: bool
  reason: str = ""
  fields: tuple[dict, ...] = ()
  flops: np.ndarray | None = None
  macs: np.ndarray | None = None


class Probe(Protocol):
  """What a waiting policy may ask of the run (`alma_jax.stream.run_setup.Setup.probe`)."""

  num_seeds: int

  def sizes(self, t: int) -> list[int]:
    """The training examples of mega-batches 1 ... `t` (of the first seed's stream)."""

  def val_error(self, learner, t: int) -> tuple[float, int]:
    """(the first seed's error on the validation examples of mega-batch `t`, how many there
    are); (nan, 0) when there are none (nothing is evaluated then)."""

  def flops(self, learner) -> dict[str, float]:
    """`alma_jax.engine.steps.Steps.flops` of the first seed's learner in the stacked
    `learner`."""


class WaitPolicy(declared.Declaration):
  """When the learner trains: at the time steps t >= 1 where `trains_at(t, state)` holds.

  A stage trains on the mega-batches that arrived since the previous stage
  (with replay, also a fraction of the earlier ones: `alma_jax.policies.schedule.
  stage_data`), so a policy may choose any times. The loop asks `decide`,
  which by default asks `trains_at` and records nothing; a policy that looks
  at the data (or records why it decided) overrides `decide`, and may add
  record fields after the stage (`stage_fields`).

  Class attributes:
    name, FIELDS: the registry name (`config.stream.wait_policy`) and the config fields the
      policy reads, from its declaration (`alma_jax.configuration.plugins.policies`); every
      other policy's fields must stay at their defaults.
    same_times_for_every_seed: whether every seed of a population trains at the same times
      (False: the seeds are separate runs, `config.num_seeds` = 1).
  """

  same_times_for_every_seed = True

  def __init__(self, config):
    self.config = config

  @classmethod
  def check(cls, config) -> None:
    """Raises `ConfigError` for values of the policy's fields that do not fit together."""
    del config

  def decide(self, t: int, state, probe: "Probe") -> Decision:
    """The decision at time step `t` >= 1 (`state`: the run's state before `t`; `probe`:
    what a policy may ask of the run's data and learner)."""
    del probe
    return Decision(self.trains_at(t, state))

  def stage_fields(self, decision: Decision, state) -> list[dict]:
    """Each seed's record fields of the step decided by `decision`, once its stage (if any)
    has trained (`state.stats`); by default `decision.fields`."""
    del state
    return [dict(f) for f in decision.fields]

  def trains_at(self, t: int, state) -> bool:
    """Whether the learner trains at time step `t` >= 1; `state` is the run's state before
    `t` (`alma_jax.state.RunState`: records so far, the learner, its last test errors)."""
    raise NotImplementedError

  def planned_times(self, num_megabatches: int) -> list[int]:
    """The times the policy expects to train at, for the estimate of the training time
    (default: every time step)."""
    return list(range(1, num_megabatches + 1))


# -- the registry ------------------------------------------------------------------------------
_FIELDS = {StagePolicy: "stream.warm_start", WaitPolicy: "stream.wait_policy"}
_REGISTRY: dict[type, dict[str, type]] = {StagePolicy: {}, WaitPolicy: {}}


def register(cls: type) -> type:
  """Class decorator: makes a stage or waiting policy available under `cls.name`."""
  kind = next((k for k in _REGISTRY if issubclass(cls, k)), None)
  if kind is None:
    raise TypeError(f"{cls.__name__} is neither a StagePolicy nor a WaitPolicy")
  if not cls.name:
    raise ValueError(f"policy {cls.__name__} has no name")
  if _REGISTRY[kind].get(cls.name, cls) is not cls:
    raise ValueError(f"policy name {cls.name!r} registered twice")
  plugins.declare_policy(cls, stage=kind is StagePolicy)
  _REGISTRY[kind][cls.name] = cls
  return cls


def stage_names() -> list[str]:
  return sorted(_REGISTRY[StagePolicy])


def wait_names() -> list[str]:
  return sorted(_REGISTRY[WaitPolicy])


def _make(kind: type, config):
  name = config.stream.get(_FIELDS[kind].split(".")[1])
  if name not in _REGISTRY[kind]:
    raise ConfigError(f"config.{_FIELDS[kind]}={name!r} is unknown; valid names: "
                      f"{sorted(_REGISTRY[kind])}")
  return _REGISTRY[kind][name](config)


def make_stage(config) -> StagePolicy:
  """The stage policy that `config.stream.warm_start` names."""
  return _make(StagePolicy, config)


def check_stage(config) -> None:
  """Raises `ConfigError` when the stage policy cannot serve the config (`StagePolicy.check`)."""
  name = F.get(config.stream, "stream.warm_start")
  if name not in _REGISTRY[StagePolicy]:
    raise ConfigError(f"config.stream.warm_start={name!r} is unknown; valid names: "
                      f"{stage_names()}")
  _REGISTRY[StagePolicy][name].check(config)


def make_wait(config) -> WaitPolicy:
  """The waiting policy that `config.stream.wait_policy` names."""
  return _make(WaitPolicy, config)


def wait_class(name: str) -> type:
  """The class of the waiting policy `name` (a `ConfigError` for an unknown name)."""
  if name not in _REGISTRY[WaitPolicy]:
    raise ConfigError(f"config.stream.wait_policy={name!r} is unknown; valid names: "
                      f"{wait_names()}")
  return _REGISTRY[WaitPolicy][name]


def check_wait(config, default: Callable[[str], Any]) -> None:
  """Raises `ConfigError` when the waiting policy's fields do not fit the config.

  `default(path)` is the default of a base field. The fields of the other
  waiting policies must stay at their defaults, `stream.wait` too unless the
  policy is the fixed wait; a policy that times each seed's stages on its own
  needs `num_seeds` = 1.
  """
  s = config.stream
  name = F.get(s, "stream.wait_policy")
  cls = wait_class(name)
  if name != "fixed":
    if F.get(s, "stream.iid") is True:
      raise ConfigError(f"config.stream.iid=True trains once, at t=B, on the whole stream: it "
                        f"needs config.stream.wait_policy='fixed', not {name!r}")
    if s.wait != 1:
      raise ConfigError(f"config.stream.wait={s.wait} is read only by config.stream."
                        f"wait_policy='fixed', not {name!r}; leave it at 1")
  others = sorted({f for c in _REGISTRY[WaitPolicy].values() for f in c.paths()}
                  - set(cls.paths()))
  for path in others:
    value = config.get(path.split(".")[0]).get(path.split(".")[1], default(path))
    if value != default(path):
      users = [c.name for c in _REGISTRY[WaitPolicy].values() if path in c.paths()]
      raise ConfigError(f"config.{path}={value!r} is read only by config.stream.wait_policy="
                        f"{users[0] if len(users) == 1 else users}, not {name!r}; set it, or "
                        f"leave the field at {default(path)!r}")
  n = F.get(config, "num_seeds")
  if n > 1 and not cls.same_times_for_every_seed:
    raise ConfigError(f"config.stream.wait_policy={name!r} decides each seed's training times "
                      f"from its own data and model, so the seeds cannot train together; set "
                      f"config.num_seeds=1 (one run per seed), not {n}")
  cls.check(config)
