"""FLOPs and multiply-adds counted from the traced computation, the same on every backend.

`count(fn, *args)` traces `fn` to a jaxpr (no lowering, no compilation) and
adds up, over every equation (inside nested jits, custom derivatives, scans
and conditionals too):
  * matrix products and convolutions: 2 FLOPs per multiply-add, and their
    multiply-adds (MACs) on their own;
  * floating-point elementwise arithmetic: 1 FLOP per output element;
  * reductions: 1 FLOP per input element;
  * data movement (gathers, reshapes, casts, selects, comparisons): nothing.
This is what XLA's cost analysis reports on CPU, but it does not depend on a
backend providing one (some GPU builds report none).

The paper's "training TFLOPs" are forward multiply-adds times the training
examples processed; `Count.macs` of the training loss's forward pass gives
that per example. `step_flops` counts a learner's train step, forward pass
and prediction this way; `PassCosts` adds up the FLOPs and multiply-adds of
the passes over data that growth runs (`alma_jax.engine.passes`). A run traces
both on its background thread (`alma_jax.runtime.background`): they build no
program, and their values are needed only when a stage's records are made.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.engine import timing
from alma_jax.engine.programs import Batch, Programs, TrainState
from alma_jax.methods.base import Learner
from alma_jax.models import conv
from alma_jax.models import switch
from alma_jax.runtime import background
from alma_jax.runtime import executables

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "cos", "cosh", "digamma", "div", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1",
    "integer_pow", "lgamma", "log", "log1p", "logistic", "max", "min", "mul", "neg", "nextafter",
    "pow", "rem", "round", "rsqrt", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan",
    "tanh"})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                        "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
                        "reduce_precision"})


@dataclasses.dataclass(frozen=True)
class Count:
  """FLOPs of a computation and the multiply-adds of its products and convolutions."""

  flops: float = 0.0
  macs: float = 0.0

  def __add__(self, other: "Count") -> "Count":
    return Count(self.flops + other.flops, self.macs + other.macs)

  def __mul__(self, k: float) -> "Count":
    return Count(self.flops * k, self.macs * k)


def _size(aval) -> int:
  return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _is_float(aval) -> bool:
  # jnp's type lattice: numpy does not count bfloat16 and float8 (ml_dtypes) as inexact.
  return hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.inexact)


def _dot_macs(eqn) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval
  k = math.prod(lhs.shape[d] for d in lhs_contract)
  return float(_size(eqn.outvars[0].aval) * k)


def _conv_macs(eqn) -> float:
  rhs = eqn.invars[1].aval
  spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
  per_output = rhs.shape[spec[1]] * math.prod(rhs.shape[d] for d in spec[2:])
  return float(_size(eqn.outvars[0].aval) * per_output)


def _sub_jaxprs(eqn):
  """(jaxpr, multiplicity) of the computations nested in `eqn`; conditionals: the costliest."""
  p = eqn.params
  if eqn.primitive.name == "cond":
    return [("max", [_jaxpr(b) for b in p["branches"]])]
  if eqn.primitive.name == "scan":
    return [(p["length"], [_jaxpr(p["jaxpr"])])]
  if eqn.primitive.name == "while":
    return [(1, [_jaxpr(p["cond_jaxpr"]), _jaxpr(p["body_jaxpr"])])]
  found = []
  for v in p.values():
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      j = _jaxpr(item)
      if j is not None:
        found.append(j)
  return [(1, found)] if found else []


def _jaxpr(obj):
  if hasattr(obj, "eqns"):
    return obj
  if hasattr(obj, "jaxpr") and hasattr(obj.jaxpr, "eqns"):
    return obj.jaxpr
  return None


def _count_jaxpr(jaxpr) -> Count:
  total = Count()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      m = _dot_macs(eqn)
      total += Count(2 * m, m)
    elif name == "conv_general_dilated":
      m = _conv_macs(eqn)
      total += Count(2 * m, m)
    elif name in ELEMENTWISE and _is_float(eqn.outvars[0].aval):
      total += Count(float(_size(eqn.outvars[0].aval)))
    elif name in REDUCTIONS and _is_float(eqn.invars[0].aval):
      total += Count(float(_size(eqn.invars[0].aval)))
    for times, subs in _sub_jaxprs(eqn):
      counts = [_count_jaxpr(s) for s in subs]
      if times == "max":
        total += max(counts, key=lambda c: c.flops)
      else:
        for c in counts:
          total += c * times
  return total


def count(fn: Callable, *args) -> Count:
  """FLOPs and MACs of `fn(*args)`; `args` may be arrays or `jax.ShapeDtypeStruct`s. Its
  trace is not compilation (`timing.counting`), and it traces every 3x3 convolution as XLA's
  (`conv.as_xla`: the count does not depend on `model.conv_impl`), and a scanned Switch
  Transformer's blocks as the unrolled form's (`switch.as_unrolled`: nor on
  `model.scan_layers`)."""
  with timing.counting(), conv.as_xla(), switch.as_unrolled():
    return _count_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)


# -- the costs of a run's programs ---------------------------------------------------------------
def step_flops(programs: Programs, learner: Learner) -> dict[str, float]:
  """FLOP and multiply-add counts for one (unstacked) learner's structure.

  `train_step`: one train step (forward, backward and update) on a batch;
  `train_step_forward`: the forward pass of the training loss alone;
  `train_macs_per_example`: the forward multiply-adds of the training loss
  per training example (what the paper's "training FLOPs" count);
  `inference_per_example`: predicting one example (`inference_macs_per_example`: its
  multiply-adds).
  Counted from the traced computations, the same on every backend, for the
  learner's active parts (`Method.active_view`): padding slots that the
  compiled programs also compute are not counted. The programs traced are
  those of `Method.counted()`, one canonical form of the method's step (an
  ensemble's members in one vmap whatever `method.strategy` runs), with XLA's
  convolutions whatever `model.conv_impl` runs (`count`), and they are traced
  unsharded: the counts do not depend on the execution strategy or on the
  mesh. Its traces are not compilation (`timing.counting`).
  """
  with timing.counting():
    method = programs.method.counted()
    view = jax.eval_shape(method.active_view, learner)  # shapes alone: no eager slicing
    structure = method.program_structure(view.structure)
    parts = jax.eval_shape(method.partition, view)
    # Kept under what the counted programs are built from (`executables.remembered`; the
    # optimizer is the context's): runs whose learners grew differently (another gMoE tree)
    # share a count where that agrees.
    key = (structure, programs.batch_size, programs.eval_batch_size, bool(programs.l2_init),
           executables.shapes((view.params, view.model_state, parts, programs.data)))
    return executables.remembered("step_flops", key,
                                  lambda: _step_flops(programs, method, view, structure, parts))


def _step_flops(programs: Programs, method, learner: Learner, structure,
                parts: tuple[Any, Any]) -> dict[str, float]:
  trainable, frozen = parts
  d, b = method.num_data_orders(structure), programs.batch_size
  spec = jax.ShapeDtypeStruct
  state = TrainState(trainable, frozen, learner.model_state,
                     jax.eval_shape(programs.tx.init, trainable),
                     trainable if programs.l2_init else None)  # the l2_init term counts too
  rng = jax.eval_shape(lambda: jax.random.key(0))
  idx, mask = spec((d, b), jnp.int32), spec((d, b), jnp.bool_)
  train = count(programs.step_body(structure, method), state, programs.data, idx, mask, rng)
  if train.flops <= 0:
    raise ValueError(f"counting the FLOPs of {method.name!r}'s train step found no arithmetic; "
                     "its loss must use differentiable array operations")
  x, y = jax.eval_shape(programs.task.inputs, programs.data, idx)

  def forward(trainable, frozen, model_state, x, y, mask, rng):
    return method.loss(structure, trainable, frozen, model_state, x, y, mask, rng)[0]

  fwd = count(forward, trainable, frozen, learner.model_state, x, y, mask, rng)
  eb = programs.eval_batch_size
  xe = spec((eb,) + tuple(x.shape[2:]), x.dtype)
  infer = count(functools.partial(method.predict, structure), learner.params,
                learner.model_state, xe)
  return {"train_step": train.flops, "train_step_forward": fwd.flops,
          "train_macs_per_example": fwd.macs / b, "inference_per_example": infer.flops / eb,
          "inference_macs_per_example": infer.macs / eb}


class PassCosts:
  """The FLOPs and multiply-adds of the passes over data that growth runs, added up as they run.

  A pass's cost per batch is counted once per (kind, function, structure),
  over the learner's active parts (`Method.active_view`); `total` (FLOPs) and
  `total_macs` (multiply-adds) are the sums over every batch run so far of
  that cost times the fraction of the batch that holds real examples
  (padding, e.g. of a validation set smaller than an evaluation batch, is not
  counted). A new cost is counted on the background thread
  (`alma_jax.runtime.background`) while the run goes on; reading a total waits for the
  counts it needs, and adds the batches in the order they ran.
  """

  def __init__(self, method, data):
    self.method, self.data = method, data
    self._per_batch: dict[tuple, Any] = {}  # key -> Count, or a Pending one
    self._unadded: list[tuple[tuple, float]] = []  # (key, real fraction), in order
    self._total = 0.0
    self._total_macs = 0.0

  def add(self, kind: str, fn: Callable, learner: Learner, build: Callable, batch: Batch,
          carry: Any = ()) -> None:
    """Adds one batch of the pass `kind` of `fn`; `build(structure)` is the pass's body."""
    key = (kind, fn, learner.structure)
    if key not in self._per_batch:
      # Shapes alone: the count needs no values, and keeps no arrays alive until it runs.
      args = _abstract((learner, batch) + ((carry,) if kind == "scan" else ()))
      self._per_batch[key] = background.later(self._count, kind, fn, build, *args)
    mask = np.asarray(batch.mask)
    self._unadded.append((key, float(np.count_nonzero(mask)) / mask.size))

  def _count(self, kind: str, fn: Callable, build: Callable, learner: Learner, batch: Batch,
             *carry) -> Count:
    with timing.counting():
      view = jax.eval_shape(self.method.active_view, learner)
      structure = self.method.program_structure(view.structure)
      args = (view.params, view.model_state, self.data, batch) + carry
      counted = executables.remembered(
          "pass_cost", (kind, executables.site_of(fn), structure, executables.shapes(args)),
          lambda: dataclasses.astuple(count(build(structure), *args)))
      return Count(*counted)

  def _add_counted(self) -> None:
    for key, real in self._unadded:
      cost = self._per_batch[key] = background.value(self._per_batch[key])
      self._total += cost.flops * real
      self._total_macs += cost.macs * real
    self._unadded = []

  @property
  def total(self) -> float:
    self._add_counted()
    return self._total

  @property
  def total_macs(self) -> float:
    self._add_counted()
    return self._total_macs


def _abstract(tree: Any) -> Any:
  """`tree` with each array (on a device or the host) as its `jax.ShapeDtypeStruct`."""
  def one(x):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
      return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False))
    return x
  return jax.tree.map(one, tree)
