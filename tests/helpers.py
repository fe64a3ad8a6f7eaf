"""Small synthetic data sets and trainers shared by the tests."""

from __future__ import annotations

import types

import jax
import numpy as np

from alma_jax import config_lib
from alma_jax import methods
from alma_jax import sharding
from alma_jax.train import Trainer, put_dataset


def synthetic_dataset(n_train=512, n_test=128, shape=(28, 28, 1), num_classes=10, seed=0,
                      learnable=True):
  """uint8 noise images; if learnable, class y brightens rows 2y and 2y+1."""
  rng = np.random.default_rng(seed)

  def make(n):
    y = rng.integers(0, num_classes, n).astype(np.int32)
    x = rng.integers(0, 60, (n,) + shape)
    if learnable:
      rows = np.arange(shape[0])[None, :] // 2 == y[:, None]
      x = x + 190 * rows[:, :, None, None]
    return x.astype(np.uint8), y

  tx, ty = make(n_train)
  sx, sy = make(n_test)
  c = shape[-1]
  return types.SimpleNamespace(train_x=tx, train_y=ty, test_x=sx, test_y=sy,
                               mean=np.full((c,), 0.4, np.float32), std=np.full((c,), 0.25, np.float32),
                               num_classes=num_classes)


def small_config(dataset="mnist", method="sm", width=8, **train):
  c = config_lib.base_config(dataset)
  c.method.name = method
  c.model.width = width
  c.train.epochs = 2
  c.train.patience = 2
  c.mesh.num_devices = 1
  for k, v in train.items():
    c.train[k] = v
  return c


def make_trainer(config, ds, num_devices=1):
  mesh = sharding.make_mesh(num_devices)
  data = put_dataset(mesh, ds)
  method = methods.get(config.method.name)(config, data.input_shape, ds.num_classes)
  return method, Trainer(method, config, data, mesh)


def init(method, seed=0):
  return method.init(jax.random.key(seed))
