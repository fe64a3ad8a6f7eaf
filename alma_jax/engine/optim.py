"""Optimizers from optax by name, with their arguments taken from the config."""

from __future__ import annotations

import inspect

import optax

from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.errors import ConfigError

# Names accepted in `config.optimizer.name`: optax's gradient transformations
# that take a learning rate.
OPTIMIZERS = ("adadelta", "adagrad", "adam", "adamw", "lamb", "lion", "nadam", "rmsprop",
              "sgd", "adafactor", "adamax", "novograd", "radam", "yogi")


def from_config(config) -> optax.GradientTransformation:
  """The optimizer of `config.optimizer`; a schedule spans one stage (`config_lib.stage_steps`)."""
  return make_optimizer(config.optimizer, config_lib.stage_steps(config))


def learning_rate(opt_config, lr: float, total_steps: int):
  """`lr`, or the schedule of `opt_config.schedule` over a stage of `total_steps` steps."""
  schedule = F.get(opt_config, "optimizer.schedule")
  if schedule == "constant":
    return lr
  if schedule != "warmup_linear":
    raise ValueError(f"config.optimizer.schedule={schedule!r} is unknown; valid values: "
                     "['constant', 'warmup_linear']")
  warmup = int(F.get(opt_config, "optimizer.warmup_steps"))
  if total_steps <= warmup:
    raise ValueError(f"config.optimizer.schedule='warmup_linear' needs more steps per stage "
                     f"({total_steps}) than config.optimizer.warmup_steps={warmup}; set "
                     "config.train.steps_per_epoch")
  decay = optax.linear_schedule(lr, 0.0, total_steps - warmup)
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def make_optimizer(opt_config, total_steps: int = 0) -> optax.GradientTransformation:
  """Builds `optax.<name>(**kwargs)`, with PyTorch-style coupled weight decay.

  `weight_decay` > 0 adds `weight_decay * param` to the gradient before the
  optimizer, as PyTorch's SGD does (the paper's CIFAR-10 setting). With
  `schedule` "warmup_linear" the learning rate rises linearly from 0 over
  `warmup_steps`, then falls linearly to 0 at `total_steps` (a stage: the
  optimizer state, and so the schedule, starts afresh at every stage).
  """
  name = opt_config.name
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer.name={name!r} is not supported; valid names: {list(OPTIMIZERS)}")
  fn = getattr(optax, name)
  kwargs = dict(opt_config.kwargs)
  accepted = inspect.signature(fn).parameters
  unknown = sorted(k for k in kwargs if k not in accepted)
  if unknown:
    raise ValueError(f"config.optimizer.kwargs has {unknown} which optax.{name} does not take; "
                     f"valid keys: {sorted(accepted)}")
  if "learning_rate" not in kwargs:  # optax.adadelta takes None: an update up the gradient
    raise ConfigError(f"config.optimizer.kwargs has no learning_rate: give the learning rate of "
                      f"optax.{name}, e.g. --config.optimizer.kwargs.learning_rate=0.01 (a "
                      "number > 0)")
  kwargs["learning_rate"] = learning_rate(opt_config, kwargs["learning_rate"], total_steps)
  tx = fn(**kwargs)
  wd = float(F.get(opt_config, "optimizer.weight_decay"))
  if wd < 0:
    raise ValueError(f"config.optimizer.weight_decay must be >= 0, got {wd}")
  if wd > 0:
    tx = optax.chain(optax.add_decayed_weights(wd), tx)
  return tx
