"""A function's random draws computed by one Threefry hash: the same bits, fewer kernels.

Every `jax.random` draw (`uniform`, `normal`, `truncated_normal`, ...) hashes its
key with Threefry-2x32 over a counter per element, and XLA compiles each draw's
hash as a kernel of its own: on a CPU most of the compile time of a network's
initialisation, which draws one small array per layer from keys known before
any draw is used (benchmarks/README.md, "Random draws hashed together").

`fuse_draws(fn)` returns a function with `fn`'s values that traces `fn`,
inlines its nested `jit` calls, and evaluates it with the bits of every draw
whose key does not depend on another draw's bits read from one Threefry hash
of all their counters side by side. Each draw's bits are exactly those of its
own hash (the hash is elementwise in key and counter: `jax.random`'s
partitionable Threefry hashes key k over the counters 0..n-1 of its n
elements), so everything computed from them -- every parameter -- is the same
to the bit; tests/runtime/test_fused_draws.py checks that against `jax.random`,
and tests/models/test_models.py against the initialisations' fingerprints.

Anything else (another key implementation, the non-partitionable Threefry,
64-bit draws, a function with side effects, fewer than two draws) is evaluated
as `fn` traced it. Meant inside `jax.jit`: an initialisation or a growth step's
draws, not a train step (whose one draw per step gains nothing).

The traversal reads JAX's jaxprs through `jax.extend`, which promises no
stability from one JAX release to the next. Where this JAX lacks a name it
uses, or its jaxprs are not as expected, `fn` is evaluated as it traced
(the same values, each draw hashed alone) and a warning says so once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

try:  # `jax.extend` may rename or drop these between releases: then draws are not fused
  from jax.extend import core as jcore
  from jax.extend import random as jrandom
  from jax.extend.core import primitives as P
  # Calls whose body is inlined, so that the draws inside `jax.random`'s own jitted helpers
  # (and a nested program's) are seen.
  _INLINED = (P.jit_p, P.closed_call_p)
  _UNAVAILABLE = None
except (ImportError, AttributeError) as _e:  # pragma: no cover (a JAX other than the pinned one)
  _UNAVAILABLE = f"{type(_e).__name__}: {_e}"
_warned = []  # the warning of a JAX whose jaxprs this module cannot read is given once
_BIT_WIDTHS = (8, 16, 32)  # 64-bit draws combine the two hash words differently
# The counters hashed by one kernel at most: 256 MiB per uint32 array where XLA materialises
# one (a 64M-parameter Switch Transformer's initialisation in one hash raised a run's peak
# memory by about 2% on a CPU).
MAX_GROUP = 1 << 26


@dataclasses.dataclass(frozen=True, eq=False)
class _Node:
  prim: Any
  params: dict
  ins: tuple  # refs (ints) or _Const
  outs: tuple  # refs
  ctx: Any  # the equation's context (the Threefry setting, compute type)
  key_aval: Any = None  # a draw's key aval
  effects: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class _Const:
  value: Any


def _flatten(closed, in_refs, nodes: list, fresh) -> list:
  """Appends `closed`'s equations to `nodes` with calls inlined; returns its output refs."""
  env = {v: _Const(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}
  env.update(zip(closed.jaxpr.invars, in_refs))

  def read(a):
    return _Const(a.val) if isinstance(a, jcore.Literal) else env[a]

  for eqn in closed.jaxpr.eqns:
    ins = tuple(read(a) for a in eqn.invars)
    if eqn.primitive in _INLINED and isinstance(eqn.params.get("jaxpr"), jcore.ClosedJaxpr):
      outs = _flatten(eqn.params["jaxpr"], ins, nodes, fresh)
    else:
      outs = tuple(next(fresh) for _ in eqn.outvars)
      nodes.append(_Node(eqn.primitive, eqn.params, ins, outs, eqn.ctx,
                         eqn.invars[0].aval if eqn.primitive is P.random_bits_p else None,
                         bool(eqn.effects)))
    for v, r in zip(eqn.outvars, outs):
      env[v] = r
  return [read(a) for a in closed.jaxpr.outvars]


def _counters(node: _Node) -> int:
  """How many counters a draw hashes: its elements for each of its keys."""
  return math.prod(node.params["shape"]) * math.prod(node.key_aval.shape)


def _fusable(node: _Node) -> bool:
  """A draw whose bits `_hash_all` reproduces."""
  impl = getattr(node.key_aval.dtype, "_impl", None)
  return (impl is jrandom.threefry_prng_impl and node.params["bit_width"] in _BIT_WIDTHS
          and getattr(node.ctx, "threefry_partitionable", False)
          and 0 < _counters(node) and math.prod(node.params["shape"]) < 2 ** 32)


def _hash_all(keys: list, draws: list[_Node]) -> list:
  """The bits of every draw (`keys`: their key arrays), as `jax.random.bits` gives them,
  from one Threefry hash per group of at most `MAX_GROUP` counters."""
  groups, size = [[]], 0
  for i, n in enumerate(draws):
    count = _counters(n)
    if groups[-1] and size + count > MAX_GROUP:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += count
  out = [None] * len(draws)
  for group in groups:
    k1, k2, counters, spans = [], [], [], []
    for i in group:
      n, shape = draws[i], tuple(draws[i].params["shape"])
      per_key = math.prod(shape)
      data = jax.random.key_data(keys[i]).reshape(-1, 2)  # (keys, 2) uint32
      m = data.shape[0]
      k1.append(jnp.broadcast_to(data[:, :1], (m, per_key)).reshape(-1))
      k2.append(jnp.broadcast_to(data[:, 1:], (m, per_key)).reshape(-1))
      # The partitionable Threefry's counters: the element's flat index (its high word 0).
      counters.append(jnp.broadcast_to(jnp.arange(per_key, dtype=jnp.uint32)[None],
                                       (m, per_key)).reshape(-1))
      spans.append((m * per_key, tuple(n.key_aval.shape) + shape, n.params["bit_width"]))
    counter = jnp.concatenate(counters)
    b1, b2 = jrandom.threefry2x32_p.bind(jnp.concatenate(k1), jnp.concatenate(k2),
                                         jnp.zeros_like(counter), counter)
    bits = b1 ^ b2
    start = 0
    for i, (count, shape, width) in zip(group, spans):
      part = bits[start:start + count].reshape(shape)
      out[i] = part if width == 32 else part.astype(jnp.dtype(f"uint{width}"))
      start += count
  return out


def _evaluate(nodes: list[_Node], env: dict, out_refs: list) -> list | None:
  """The outputs, with the fusable draws hashed together; None when there is nothing to fuse."""
  if any(n.effects for n in nodes):
    return None
  tainted = set()  # refs computed from some draw's bits
  draws = []
  for n in nodes:
    if n.prim is P.random_bits_p:
      if n.ins[0] not in tainted and _fusable(n):
        draws.append(n)
      tainted.update(n.outs)
    elif any(r in tainted for r in n.ins if not isinstance(r, _Const)):
      tainted.update(n.outs)
  if len(draws) < 2:
    return None
  needed = {n.ins[0] for n in draws if not isinstance(n.ins[0], _Const)}
  first = []  # the equations the draws' keys need, in order
  for n in reversed(nodes):
    if needed.intersection(n.outs):
      first.append(n)
      needed.update(r for r in n.ins if not isinstance(r, _Const))
  first.reverse()

  def read(r):
    return r.value if isinstance(r, _Const) else env[r]

  def run(n):
    with n.ctx.manager:
      outs = n.prim.bind(*map(read, n.ins), **n.prim.get_bind_params(n.params))
    env.update(zip(n.outs, outs if n.prim.multiple_results else (outs,)))

  for n in first:
    run(n)
  fused = {id(n): bits for n, bits in zip(draws, _hash_all([read(n.ins[0]) for n in draws],
                                                           draws))}
  done = {id(n) for n in first}
  for n in nodes:
    if id(n) in fused:
      env[n.outs[0]] = fused[id(n)]
    elif id(n) not in done:
      run(n)
  return [read(r) for r in out_refs]


def fuse_draws(fn: Callable) -> Callable:
  """`fn` with its independent random draws hashed together. Positional arguments are array
  pytrees; keyword arguments are static (as `jax.jit`'s `static_argnames` pass them)."""

  if _UNAVAILABLE is not None:
    _warn_once(_UNAVAILABLE)
    return fn

  @functools.wraps(fn)
  def fused(*args, **static):
    bound = functools.partial(fn, **static) if static else fn
    closed, out_shape = jax.make_jaxpr(bound, return_shape=True)(*args)
    leaves = jax.tree.leaves(args)
    try:
      fresh = iter(range(1 << 62))
      in_refs = [next(fresh) for _ in closed.jaxpr.invars]
      nodes: list[_Node] = []
      out_refs = _flatten(closed, in_refs, nodes, fresh)
      outs = _evaluate(nodes, dict(zip(in_refs, leaves)), out_refs)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # jaxprs unlike those expected
      _warn_once(f"{type(e).__name__}: {e}")
      outs = None  # an error of `fn` itself is raised again below, as `fn` would raise it
    if outs is None:  # the traced function as it is (not traced again)
      outs = jcore.jaxpr_as_fun(closed)(*leaves)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return fused


def _warn_once(why: str) -> None:
  if not _warned:
    _warned.append(why)
    logging.warning("random draws are hashed one by one, not together (the same values; "
                    "slower compiles of the initialisations): jax %s's jaxprs are not as "
                    "alma_jax.runtime.fused_draws reads them (%s)", jax.__version__, why)
