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
that per example.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np

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
  return hasattr(aval, "dtype") and np.issubdtype(aval.dtype, np.inexact)


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
  """FLOPs and MACs of `fn(*args)`; `args` may be arrays or `jax.ShapeDtypeStruct`s."""
  return _count_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)
