"""Optimizers from optax by name, with their arguments taken from the config."""

from __future__ import annotations

import inspect

import optax

# Names accepted in `config.optimizer.name`: optax's gradient transformations
# that take a learning rate.
OPTIMIZERS = ("adadelta", "adagrad", "adam", "adamw", "lamb", "lion", "nadam", "rmsprop",
              "sgd", "adafactor", "adamax", "novograd", "radam", "yogi")


def make_optimizer(opt_config) -> optax.GradientTransformation:
  """Builds `optax.<name>(**kwargs)`, with PyTorch-style coupled weight decay.

  `weight_decay` > 0 adds `weight_decay * param` to the gradient before the
  optimizer, as PyTorch's SGD does (the paper's CIFAR-10 setting).
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
  tx = fn(**kwargs)
  wd = float(opt_config.get("weight_decay", 0.0))
  if wd < 0:
    raise ValueError(f"config.optimizer.weight_decay must be >= 0, got {wd}")
  if wd > 0:
    tx = optax.chain(optax.add_decayed_weights(wd), tx)
  return tx
