"""Device mesh and shardings for the train and eval steps.

One mesh axis, "data", spans all devices (or `config.mesh.num_devices` of
them). Batches are split along it; parameters, optimizer state and the
resident data set are replicated. A dimension that does not divide the mesh
axis falls back to replication.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D data-parallel mesh over the first `num_devices` devices (all if None/<=0)."""
  devices = jax.devices()
  if num_devices is not None and num_devices > 0:
    if num_devices > len(devices):
      raise ValueError(f"config.mesh.num_devices={num_devices} but only {len(devices)} "
                       f"devices are visible ({devices[0].platform})")
    devices = devices[:num_devices]
  return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,),
                       devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], axis: int) -> NamedSharding:
  """Shards `axis` of an array of `shape` over the data axis, if it divides."""
  n = mesh.shape[DATA_AXIS]
  if n == 1 or shape[axis] % n:
    return replicated(mesh)
  spec = [None] * len(shape)
  spec[axis] = DATA_AXIS
  return NamedSharding(mesh, P(*spec))


def put_replicated(mesh: Mesh, tree):
  """Places every leaf of `tree` on all devices of the mesh."""
  return jax.device_put(tree, replicated(mesh))


def put_batch(mesh: Mesh, array: np.ndarray, axis: int):
  return jax.device_put(array, batch_sharding(mesh, array.shape, axis))
