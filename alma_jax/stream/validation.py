"""Checks of a run's inputs before any training, with one-line error messages.

`validate(config)` checks every declared field (`alma_jax.configuration.config_lib.
base_fields`, the method's fields and the task's), the rules that tie fields
together (the task's among them: `alma_jax.tasks.check`), and builds the
optimizer and (where the task knows the input shape without loading the data)
the method, so their own checks run too; it also makes sure the task's data
can be had. `validate_data` checks what depends on the loaded data.
Every message names the offending field and its allowed values, e.g.
`config.stream.wait=3 does not divide config.stream.num_megabatches=10; allowed values: [1, 2, 5, 10]`.
"""

from __future__ import annotations

import math

import jax
from absl import logging

from alma_jax import methods
from alma_jax import policies
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields
from alma_jax.configuration import options
from alma_jax.configuration import plugins
from alma_jax.engine import optim
from alma_jax.engine import sharding
from alma_jax.errors import ConfigError
from alma_jax.models import registry as backbones

# Input shape and number of classes of common image data sets (`ImageTask.known_shape`).
KNOWN_SHAPES = tasks.images.KNOWN_SHAPES


_DECAY = fields.number(0.0, 1.0)  # a moving average's decay: 0 keeps nothing, 1 nothing new
# Checks of the optimizer arguments of `alma_jax.engine.optim`'s optimizers, by argument name:
# each name means the same in every optax optimizer that takes it (a config file may also give
# a schedule: a callable, not checked here). Whether the optimizer takes the argument at all is
# checked when it is built.
OPTIMIZER_KWARG_CHECKS = {
    "learning_rate": fields.number(0.0, math.inf, open_lo=True, open_hi=True),
    # Adam's family (adam, adamw, nadam, radam, adamax, lamb, lion, novograd, yogi): the
    # decays of the first and second moments; at 1 a moment never moves from its start.
    "b1": fields.number(0.0, 1.0, open_hi=True),
    "b2": fields.number(0.0, 1.0, open_hi=True),
    "eps": fields.number(0.0, math.inf),
    "eps_root": fields.number(0.0, math.inf),
    "rho": _DECAY,  # adadelta
    "decay": _DECAY,  # rmsprop
    "momentum": fields.number(0.0, 1.0, optional=True),  # sgd, rmsprop, adafactor: None, none
    "nesterov": fields.boolean(),
    "centered": fields.boolean(),  # rmsprop
    "weight_decay": fields.number(0.0, math.inf),  # adamw, lamb, lion, novograd, adadelta
    "initial_accumulator_value": fields.number(0.0, math.inf),  # adagrad
}


def _check_rules(config, backend: bool = True, devices: int | None = None) -> None:
  """The checks that tie several fields together (`backend`: with those of the devices
  visible, which start JAX's backend; else with `devices` CPU devices, where known)."""
  dataset = fields.lookup(config, "data.name", "")
  policies.check_wait(config, lambda p: fields.declared(p).default_for(dataset))
  policies.check_stage(config)
  if (fields.lookup(config, "train.stage_program", "auto") == "whole"
      and not tasks.task_class(config).right_or_wrong()):
    raise ConfigError(f"config.train.stage_program='whole' needs a task whose examples are "
                      f"right or wrong; for task {tasks.task_class(config).name!r} valid: "
                      "['per_epoch', 'auto']")
  b, w = config.stream.num_megabatches, config.stream.wait
  if b % w:
    divisors = [d for d in range(1, b + 1) if b % d == 0]
    raise ConfigError(f"config.stream.wait={w} does not divide config.stream.num_megabatches={b}; "
                      f"allowed values: {divisors}")
  n = fields.lookup(config, "num_seeds", 1)
  if config.seed + n - 1 > config_lib.MAX_SEED:
    raise ConfigError(f"config.seed={config.seed} with config.num_seeds={n} reaches seed "
                      f"{config.seed + n - 1}; seeds must be in [0, {config_lib.MAX_SEED}]")
  if n > 1 and not methods.get(config.method.name).same_growth_for_every_seed:
    valid = [m for m in methods.names() if methods.get(m).same_growth_for_every_seed]
    raise ConfigError(
        f"config.num_seeds={n} needs a method whose growth is the same for every seed; "
        f"config.method.name={config.method.name!r} is not one; valid names: {valid} "
        "(or config.num_seeds=1)")
  kwargs = config.optimizer.kwargs
  for name, check in OPTIMIZER_KWARG_CHECKS.items():
    if name in kwargs and not callable(kwargs[name]):
      check(f"optimizer.kwargs.{name}", kwargs[name])
  try:
    optim.from_config(config)
  except ConfigError:  # already in the field's words (a missing learning rate)
    raise
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.optimizer: {e}") from e
  sharding.check_rules(dict(config.mesh.rules.items()))
  if backend:
    _check_mesh(config, jax.device_count(), jax.default_backend())
  elif devices is not None:
    _check_mesh(config, devices, "cpu")


def _check_mesh(config, visible: int, platform: str) -> None:
  """The mesh's fields against the `visible` devices of `platform`."""
  if config.mesh.num_devices > visible:
    raise ConfigError(f"config.mesh.num_devices={config.mesh.num_devices} but only {visible} "
                      f"{platform} devices are visible; use 0 for all of them")
  sharding.mesh_shape(config.mesh.num_devices, config.mesh.data, config.mesh.model, visible)


def value_error(path: str, value) -> str | None:
  """What the check of field `path` says of `value` (its allowed values), for a value that
  cannot even be set (a command-line override of the wrong type).

  `path` is a base or text field, an optimizer argument of `OPTIMIZER_KWARG_CHECKS` or a
  method field; None when the value passes, the path is not declared, or the methods that
  declare it check it differently.
  """
  declared = (config_lib.base_fields()
              + tuple(f for t in plugins.TASKS.values() for f in t.FIELDS)
              + tuple(f for m in plugins.METHODS.values() for f in m.FIELDS))
  checks = [f.check for f in declared if f.path == path]
  prefix = "optimizer.kwargs."
  if path.startswith(prefix) and path[len(prefix):] in OPTIMIZER_KWARG_CHECKS:
    checks.append(OPTIMIZER_KWARG_CHECKS[path[len(prefix):]])
  messages = set()
  for check in checks:
    try:
      check(path, value)
    except ConfigError as e:
      messages.add(str(e))
    else:
      return None
  return messages.pop() if len(messages) == 1 else None


def validate(config, *, backend: bool = True, devices: int | None = None, data: bool = True):
  """Checks the config's fields; raises `ConfigError` naming the first bad one.

  Returns the config completed with the defaults of the fields it lacks.
  `backend=False` leaves out the checks that start JAX's backend (the devices
  visible; the method built, whose backbone may ask for the backend's name): a
  process checks its config that way before it chooses its XLA flags, which the
  backend reads when it starts, and fully once they are set. There `devices`, the
  CPU devices the backend will have where that is known before it starts
  (`cpu_fusion.cpu_devices_expected`), checks the mesh's fields. `data=False` leaves out
  the check that the data set is available here: a launcher checks a config on a machine
  other than the run's.
  """
  fields.check_all(config, config_lib.base_fields())
  config = complete(config)
  fields.check_all(config, plugins.method_fields(config))
  fields.check_all(config, plugins.task(config).FIELDS)
  o = options.of(config)  # what the checks below (and everything a run builds) read
  task = tasks.task_class(o)
  _check_rules(o, backend, devices)
  tasks.check(o)
  shape = task.known_shape(o)
  if shape is not None:
    check_input_shape(o, shape[0])
    if backend:
      methods.make(o, *shape)
  if data:
    task.check_available(o)
  return config


def check_input_shape(config, input_shape) -> None:
  """Raises `ConfigError` unless the backbone takes inputs of `input_shape` (one example's:
  the data set's, known before it loads or read from it)."""
  backbones.check_input_shape(config.model.name, tuple(input_shape),
                              f"config.data.name={config.data.name!r}")


def validate_data(config, num_train: int, stream, num_test: int | None = None) -> None:
  """Checks the fields that depend on the loaded data (`num_train` training examples, or text
  sequences, and `num_test` test ones) and its stream."""
  smallest = min(len(t) for t in stream.train)
  smallest_val = min(len(v) for v in stream.val)
  where = (f"{num_train} training examples in config.stream.num_megabatches="
           f"{stream.num_megabatches} mega-batches with config.stream.val_fraction="
           f"{config.stream.val_fraction}")
  if smallest < 1 or smallest_val < 1:
    raise ConfigError(f"config.stream.num_megabatches={stream.num_megabatches} leaves a mega-batch "
                      f"with {smallest} training and {smallest_val} validation examples ({where}); "
                      "use fewer mega-batches or more data (config.data.train_subset)")
  b = config.train.batch_size
  if b > smallest * config.stream.wait:
    # Not an error: the paper's own MNIST setting (B=500, w=1) has 108 training
    # examples per mega-batch for a batch of 128. Each epoch is then one
    # partial (masked) step, and the FLOP count is that of a full batch.
    logging.warning("config.train.batch_size=%d is larger than the training data of a stage "
                    "without replay (%d examples: %s, config.stream.wait=%d); each epoch of "
                    "such a stage is a single partial batch", b, smallest * config.stream.wait,
                    where, config.stream.wait)
  eb, largest = config.train.eval_batch_size, max(num_train, num_test or 0)
  if eb > largest:
    logging.warning("config.train.eval_batch_size=%d is larger than every set the run evaluates "
                    "(%d training%s examples), so each evaluation pads its batch to %d "
                    "examples; %d or less would pad less", eb,
                    num_train, "" if num_test is None else f" and {num_test} test", eb, largest)
  warn_if_it_never_grows(config, stream.num_megabatches)


def warn_if_it_never_grows(config, num_megabatches: int) -> None:
  """Logs a warning when a growing method leaves no stage to grow before: it first grows
  before stage 1 + its growth period (`Declaration.growth_period`), and the waiting policy
  plans no more stages than that period."""
  policy = config.stream.wait_policy
  planned = len(policies.make_wait(config).planned_times(num_megabatches))
  period = plugins.method(config.method.name).growth_period(config, planned)
  if period is None or planned > period:
    return  # a method that does not grow, was asked not to, or will
  every = fields.lookup(config, "method.grow_every", None)
  logging.warning(
      "config.method.name=%r will not grow: its first growth comes before stage %d%s and "
      "config.stream.wait_policy=%r plans %d training stage(s) over "
      "config.stream.num_megabatches=%d%s", config.method.name, period + 1,
      "" if every is None else f" (config.method.grow_every={every})", policy, planned,
      num_megabatches, " (the error may add more)" if policy == "triggered" else "")


def complete(config):
  """A copy of `config` with every declared field that it lacks set to its default (and
  `stream.init_from_scratch` made to agree with `stream.warm_start`)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    dataset = fields.lookup(c, "data.name", "")
    fields.fill(c, config_lib.base_fields(), dataset, overwrite=False)
    fields.value(c, config_lib.BASE_FIELDS_BY_PATH["method.name"])  # a known name
    task = plugins.task(c)
    fields.fill(c, plugins.method_fields(c), dataset, overwrite=False)
    fields.fill(c, task.FIELDS, dataset, overwrite=False)
    task.complete(c)
    plugins.resolve_warm_start(c)
  return c
