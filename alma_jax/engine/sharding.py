"""The device mesh, the logical-axis rules and the placement of the steps' inputs.

The mesh has two axes, `data` and `model` (`config.mesh.data` x
`config.mesh.model` devices; by default every device on `data`). Arrays name
the role of their dimensions with logical axes:

  population  the stacked learners of a run (seeds): the leading axis of all state;
  batch       the examples of a batch;
  member      ensemble members (and the data orders of an ensemble's train batch);
  expert      gMoE's stacked experts.

`config.mesh.rules` maps each logical axis to a mesh axis or to "replicated"
(default: batch -> data, member and expert -> model, population replicated);
every other dimension is replicated. A method names the logical axes of its
parameter leaves by path (`Method.LEAF_AXES`). A dimension that does not
divide its mesh axis is replicated along it instead, with one warning naming
the leaf (none for a dimension of size 1); a mesh axis shards at most one
dimension of an array (the first that asks for it).

The mesh's axis types are given explicitly as `Auto`: the shardings of a
step's inputs and outputs are pinned, and XLA propagates them through the
step (with `Explicit` axes every operation of the models would have to
resolve its own output sharding).

In a multi-process run (`jax.distributed`) every process holds the same host
values (data, indices, initial parameters) and `put` transfers only the
slices that its own devices hold.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from alma_jax.configuration import fields as F
from alma_jax.errors import ConfigError

DATA_AXIS, MODEL_AXIS = "data", "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)
REPLICATED = "replicated"
LOGICAL_AXES = ("population", "batch", "member", "expert")
DEFAULT_RULES = dict(F.declared("mesh.rules").default)  # population replicated, batch on data,
# members and experts on model
PyTree = Any


# -- the mesh -------------------------------------------------------------------------------------
def mesh_shape(num_devices: int, data: int, model: int, visible: int) -> tuple[int, int]:
  """(data, model) sizes of the mesh; raises `ConfigError` naming the fields that do not fit.

  `num_devices` (0: all `visible`) and `data` (0: num_devices // model) may be
  left to follow from the others.
  """
  if model < 1 or data < 0 or num_devices < 0:
    raise ConfigError(f"config.mesh.model={model} must be >= 1 and config.mesh.data={data}, "
                      f"config.mesh.num_devices={num_devices} >= 0")
  total = num_devices or (data * model if data else visible)
  if total > visible:
    raise ConfigError(f"config.mesh.num_devices={total} (config.mesh.data={data} x "
                      f"config.mesh.model={model}) but only {visible} devices are visible")
  if total % model:
    raise ConfigError(f"config.mesh.model={model} does not divide the {total} devices of the mesh; "
                      f"allowed values: {[d for d in range(1, total + 1) if total % d == 0]}")
  if data and data * model != total:
    raise ConfigError(f"config.mesh.data={data} x config.mesh.model={model} != {total} devices "
                      f"(config.mesh.num_devices={num_devices}); use config.mesh.data=0 for "
                      f"{total // model}")
  return total // model, model


def make_mesh(num_devices: int | None = None, data: int = 0, model: int = 1) -> Mesh:
  """A (data, model) mesh over the first data x model devices (see `mesh_shape`)."""
  devices = jax.devices()
  d, m = mesh_shape(int(num_devices or 0), int(data), int(model), len(devices))
  if jax.process_count() > 1 and d * m != len(devices):
    raise ConfigError(f"a multi-process run uses every device: the mesh has {d * m} of "
                      f"{len(devices)} (config.mesh.num_devices, data, model)")
  return jax.make_mesh((d, m), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices[:d * m])


def mesh_from_config(config) -> Mesh:
  c = config.mesh
  return make_mesh(c.num_devices, F.get(c, "mesh.data"), F.get(c, "mesh.model"))


def check_rules(rules: Mapping[str, str]) -> dict[str, str]:
  """`rules` completed with the defaults; raises `ConfigError` for an unknown name."""
  for logical, axis in rules.items():
    if logical not in LOGICAL_AXES:
      raise ConfigError(f"config.mesh.rules.{logical} is unknown; valid logical axes: "
                        f"{sorted(LOGICAL_AXES)}")
    if axis not in MESH_AXES + (REPLICATED,):
      raise ConfigError(f"config.mesh.rules.{logical}={axis!r} is unknown; valid values: "
                        f"{sorted(MESH_AXES + (REPLICATED,))}")
  return {**DEFAULT_RULES, **dict(rules)}


# -- logical axes -> shardings --------------------------------------------------------------------
class Layout:
  """The shardings of a run's arrays: the mesh and the rules of `config.mesh.rules`."""

  def __init__(self, mesh: Mesh, rules: Mapping[str, str] | None = None):
    self.mesh = mesh
    self.rules = check_rules(rules or {})
    self._warned: set[tuple] = set()

  @property
  def replicated(self) -> NamedSharding:
    return replicated(self.mesh)

  def _spec(self, shape: Sequence[int], axes: Sequence[str | None], bad: list) -> P:
    spec, used = [], set()
    for dim, (size, logical) in enumerate(zip(shape, tuple(axes) + (None,) * len(shape))):
      axis = self.rules.get(logical, REPLICATED) if logical else REPLICATED
      n = self.mesh.shape.get(axis, 1)
      if axis in used or n == 1:
        spec.append(None)
      elif size % n:
        if size > 1:  # one slice (a single trained member, S = 1) is not worth a warning
          bad.append((dim, logical, size, axis, n))
        spec.append(None)
      else:
        spec.append(axis)
        used.add(axis)
    while spec and spec[-1] is None:
      spec.pop()
    return P(*spec)

  def sharding(self, shape: Sequence[int], axes: Sequence[str | None], name: str) -> NamedSharding:
    """The sharding of one array of `shape` whose dimensions have the logical `axes`."""
    bad = []
    spec = self._spec(shape, axes, bad)
    self._warn([(name, b) for b in bad])
    return NamedSharding(self.mesh, spec)

  def tree(self, tree: PyTree, leaf_axes: Callable[[str], Sequence[str]],
           lead: Sequence[str] = (), name: str = "") -> PyTree:
    """Shardings of every leaf of `tree`: `lead` names its leading axes, then `leaf_axes(path)`."""
    bad = []

    def one(path, x):
      key = name + jax.tree_util.keystr(path)
      found = []
      spec = self._spec(x.shape, tuple(lead) + tuple(leaf_axes(key)), found)
      bad.extend((key, b) for b in found)
      return NamedSharding(self.mesh, spec)

    out = jax.tree_util.tree_map_with_path(one, tree)
    self._warn(bad)
    return out

  def _warn(self, bad: list) -> None:
    new = [(leaf, b) for leaf, b in bad if (leaf, b) not in self._warned]
    if not new:
      return
    self._warned.update(new)
    leaves = [f"{leaf} (dimension {dim}, {logical}, size {size} on {axis}={n})"
              for leaf, (dim, logical, size, axis, n) in new]
    logging.warning("sharding: %d array dimension(s) do not divide their mesh axis and are "
                    "replicated along it instead: %s%s", len(leaves), "; ".join(leaves[:4]),
                    f" (+{len(leaves) - 4} more)" if len(leaves) > 4 else "")


def leaf_axes_by_pattern(rules: Sequence[tuple[str, Sequence[str]]]) -> Callable[[str], tuple]:
  """A `leaf_axes` function from (regular expression searched in the path, names) pairs."""
  compiled = [(re.compile(p), tuple(names)) for p, names in rules]

  def leaf_axes(path: str) -> tuple[str, ...]:
    for pattern, names in compiled:
      if pattern.search(path):
        return names
    return ()

  return leaf_axes


# -- placement ------------------------------------------------------------------------------------
def _put_one(x, s: NamedSharding):
  if getattr(x, "sharding", None) == s and x.committed:
    return x  # the common case (e.g. the state a train call returned), kept fast
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _put_one(jax.random.key_data(x), s)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return _place(x, s)


def _place(x, s: NamedSharding):
  if isinstance(x, jax.Array):
    if x.sharding == s and x.committed:
      return x
    if not x.is_fully_addressable:  # a global array: resharded by the devices that hold it
      return jax.device_put(x, s)
  if jax.process_count() == 1:
    return jax.device_put(x, s)
  host = np.asarray(x)  # the same on every process: each transfers the slices of its devices
  return jax.make_array_from_callback(host.shape, s, lambda index: np.asarray(host[index]))


def _copy_leaf(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(jnp.copy(jax.random.key_data(x)),
                                    impl=jax.random.key_impl(x))
  return jnp.copy(x)


def copies(tree: PyTree) -> PyTree:
  """Fresh buffers holding the values of every leaf of `tree` (PRNG keys included)."""
  return jax.tree.map(_copy_leaf, tree)


_copies = jax.jit(copies)  # one program copies a whole tree (not one per leaf shape)


def put(tree: PyTree, shardings: PyTree | NamedSharding, *, copy: bool = False) -> PyTree:
  """Places every leaf of `tree` with its sharding (a tree of them, or one for all leaves).

  Leaves already placed so are returned as they are (unless `copy`: then
  every leaf is a fresh buffer, e.g. for a state a program will donate);
  host values must be the same on every process of a multi-process run.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    placed = jax.tree.map(lambda x: _put_one(x, shardings), tree)
  else:
    placed = jax.tree.map(lambda x, s: _put_one(x, s), tree, shardings)
  if not copy:
    return placed
  # `jax.device_put` may share the buffer of a one-device source with one shard, so the
  # copies come from a program; placing them again only fixes an equivalent spec.
  return put(_copies(placed), shardings)


def put_args(args: PyTree, shardings: PyTree) -> PyTree:
  """`put` for the arguments of a compiled program: in a single-process run, host values
  (numpy arrays, scalars) are left to the program, whose compiled dispatch transfers them
  with its input shardings (on a CPU about 3 us a value, where `jax.device_put` takes about
  100 us); device arrays are placed as `put` places them. With several processes every
  value is placed by `put` (host values become global arrays)."""
  if jax.process_count() > 1:
    return put(args, shardings)
  return jax.tree.map(lambda x, s: _put_one(x, s) if isinstance(x, jax.Array) else x, args,
                      shardings)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())

