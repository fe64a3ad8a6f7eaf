"""A population of learners stacked on a leading axis: one run (S = 1) or several seeds.

Every learner, key and index array the loop and the stage hold carries a
leading population axis of size S. A run with `config.num_seeds = S` trains
the seeds `seed`, ..., `seed + S - 1` together; an ordinary run is S = 1.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.engine import programs
from alma_jax.models import slots
from alma_jax.runtime import executables
from alma_jax.runtime import fused_draws
from alma_jax.runtime import host_random
from alma_jax.state import Learner

PyTree = Any


def size(tree: PyTree) -> int:
  """S, the leading axis shared by the leaves of a stacked tree."""
  return slots.leading_size(tree)


# Trees of one structure -> one tree with a leading axis: one program for the whole tree (not
# one per leaf shape), reused while the shapes stay.
stack_trees = programs.utility(lambda *trees: jax.tree.map(lambda *a: jnp.stack(a), *trees),
                               "stack")


def stack(learners: Sequence[Learner], place: Callable | None = None) -> Learner:
  """Learners of one structure -> one learner with a leading population axis.

  `place` (`Programs.place`): each learner is placed with its unstacked shardings first, and
  the population with its own after, so that learners from anywhere (a growth's program, an
  unstacked population) share one stack program per structure.
  """
  structures = {l.structure for l in learners}
  if len(structures) != 1:
    raise ValueError(f"the learners of a population must share one structure; got {structures}")
  if place is not None:
    learners = [place(l, stacked=False) for l in learners]
  params, model_state = stack_trees(*[(l.params, l.model_state) for l in learners])
  stacked = Learner(params=params, model_state=model_state, structure=learners[0].structure)
  return stacked if place is None else place(stacked)


# One program per tree of shapes takes a member of every leaf (not one per leaf shape).
_member = programs.utility(lambda tree, i: jax.tree.map(lambda a: a[i], tree), "unstack")


def unstack(tree: PyTree, i: int) -> PyTree:
  """Member `i` of a stacked tree (a `Learner` stays a `Learner`)."""
  if isinstance(tree, Learner):
    params, model_state = unstack((tree.params, tree.model_state), i)
    return Learner(params=params, model_state=model_state, structure=tree.structure)
  leaves = jax.tree.leaves(tree)
  if leaves and all(isinstance(a, jax.Array) for a in leaves) and not slots.is_traced(tree):
    return _member(tree, np.int32(i))
  return jax.tree.map(lambda a: a[i], tree)


def abstract_member(tree: PyTree) -> PyTree:
  """The shapes and dtypes (`jax.ShapeDtypeStruct`s) of one member of a stacked tree (a
  `Learner` stays a `Learner`), without a program or a trace."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)


def members(learner: Learner) -> list[Learner]:
  return [unstack(learner, i) for i in range(size(learner.params))]


def select_units(method, take: np.ndarray, new: Learner, old: Learner) -> Learner:
  """Per member s and selection unit u: `new` where `take[s, u]`, else `old`."""
  take = np.asarray(take, bool)
  if not take.any():
    return old
  # Taking all of `new` runs the same program (a copy of `new`), so that the first stage
  # compiles it whichever units improve.
  return _select_units(method, new.structure, take, new, old)


def _select(method, structure, take, new, old):
  return jax.vmap(lambda t, a, b: method.select_units(structure, t, a, b))(take, new, old)


# One small program per (method, structure, shapes), not a dispatch per leaf and operation; a
# utility in `jax.monitoring`, not a step.
_select.__name__ = _select.__qualname__ = programs.UTILITY_PREFIX + "select_units"
_select_units = jax.jit(_select, static_argnums=(0, 1))


def keys(seeds: Sequence[int]) -> jax.Array:
  """The root PRNG keys of `seeds`, stacked: made on the host (`host_random.seed_keys`), else
  by one small program (not one per operation)."""
  seeds = tuple(int(s) for s in seeds)
  made = host_random.seed_keys(seeds)
  return _keys(seeds) if made is None else made


def _seed_keys(seeds: tuple[int, ...]) -> jax.Array:
  return jax.random.wrap_key_data(jnp.stack([jax.random.key_data(jax.random.key(s))
                                             for s in seeds]))


_seed_keys.__name__ = _seed_keys.__qualname__ = programs.UTILITY_PREFIX + "keys"
_keys = executables.jit(_seed_keys, _seed_keys.__name__, once=True, static_argnums=0)


def stack_keys(key_list: Sequence[jax.Array]) -> jax.Array:
  """Keys (of one implementation) stacked on the host: no program of their own."""
  data = np.stack([np.asarray(jax.random.key_data(k)) for k in key_list])
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key_list[0]))


def member_keys(stacked_keys: jax.Array) -> list[jax.Array]:
  """The keys of a stacked population, one per member, made from their data on the host (an
  index into the device array would be a program of its own)."""
  data = np.asarray(jax.random.key_data(stacked_keys))
  impl = jax.random.key_impl(stacked_keys)
  return [jax.random.wrap_key_data(d, impl=impl) for d in data]


def fold(stacked_keys: jax.Array, i: int) -> jax.Array:
  """`jax.random.fold_in(key, i)` for every key of the population: each member's on the host
  (`host_random.fold_in`; where it cannot, by the one program of a single key's fold that every
  fold shares), the keys restacked on the host."""
  return stack_keys([host_random.fold_in(k, i) for k in member_keys(stacked_keys)])


def initial(method, stacked_keys: jax.Array, place: Callable | None = None) -> Learner:
  """The untrained learner of every key (`method.init(fold_in(key, 0))`), stacked by one
  program (`place`: as in `stack`)."""
  learner = _initial(method, stacked_keys)
  return learner if place is None else place(learner)


def _init_members(method, stacked_keys: jax.Array) -> Learner:
  # Inside this program. The methods' own initialisation programs hash their draws together
  # (`fused_draws`); so does this one with any draw they leave (e.g. a plug-in method's).
  return fused_draws.fuse_draws(lambda keys: stack([
      method.init(jax.random.fold_in(keys[i], 0)) for i in range(keys.shape[0])]))(stacked_keys)


_init_members.__name__ = _init_members.__qualname__ = programs.UTILITY_PREFIX + "init"
# Runs once per run, compiled for a short compile (`executables.once_options`); not kept: no
# text identifies its static argument, the method.
_initial = executables.jit(_init_members, _init_members.__name__, once=True, keep=False,
                           static_argnums=0)


def numpy_rngs(stacked_keys: jax.Array) -> list[np.random.Generator]:
  """A numpy generator per key of a stacked population, seeded by the key's data (host-side
  shuffles)."""
  return [np.random.default_rng(d.ravel().tolist())
          for d in np.asarray(jax.random.key_data(stacked_keys))]


STD_CONVENTION = "sample standard deviation over the seeds (ddof=1)"


def mean_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
  """Each numeric metric's mean over the population and its sample standard deviation
  (`<key>_std`, ddof=1, the convention of the report's tables and figures; 0 for one
  learner), and `std_convention` naming it."""
  out = {}
  for key in summaries[0]:
    values = np.asarray([s[key] for s in summaries], np.float64)
    out[key] = float(np.mean(values))
    out[f"{key}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  out["std_convention"] = STD_CONVENTION
  return out
