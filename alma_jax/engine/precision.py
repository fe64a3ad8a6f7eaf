"""The arithmetic precision of the train and evaluation programs (`train.compute_dtype`).

`float32` (the default) runs the method's functions as they are. `bfloat16`
is mixed precision: the parameters, the optimizer state and the model state
(BatchNorm statistics) stay float32, while the forward and backward passes
compute in bfloat16:

  * the floating-point parameters and inputs are cast to bfloat16 inside the
    differentiated function, so the gradients arrive in float32 (the cast's
    transpose) and the optimizer updates float32 parameters;
  * every Flax module of the model receives bfloat16 inputs and, inside the
    model, returns bfloat16 outputs (a module that promotes, such as
    BatchNorm with its float32 statistics, is cast back); the model's own
    outputs (logits, auxiliary losses) are returned in float32, so the loss,
    the log-probabilities and the evaluation sums are float32;
  * the new model state keeps the dtypes of the old one.

This holds for every backbone without changes of its own, since it acts on
module calls, not on layers. It concerns the train steps and the evaluation;
the passes that growth runs over data (`alma_jax.engine.passes.reduce`,
`scan`) stay float32. On XLA:CPU bfloat16 convolutions are not faster than
float32 ones; the setting is meant for GPUs and TPUs.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

PyTree = Any
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FIELD = "train.compute_dtype"


def cast(tree: PyTree, dtype) -> PyTree:
  """`tree` with its float32 leaves in `dtype` (integer, boolean and key leaves as they are)."""
  return jax.tree.map(lambda a: a.astype(dtype) if _is_float32(a) else a, tree)


def _is_float32(a) -> bool:
  return hasattr(a, "dtype") and a.dtype == jnp.float32


def _to_float32(tree: PyTree) -> PyTree:
  return jax.tree.map(
      lambda a: a.astype(jnp.float32)
      if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _interceptor(dtype) -> Callable:
  """A Flax method interceptor: module calls take and give `dtype`; the outermost module's
  outputs are float32."""
  def intercept(next_fun, args, kwargs, context):
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    out = next_fun(*cast(args, dtype), **cast(kwargs, dtype))
    # The root's scope has the empty path (a module inside a lifted transformation, e.g. the
    # body of `nn.scan`, has a scope but no Module parent: it is not the outermost).
    outermost = not context.module.scope.path
    return _to_float32(out) if outermost else cast(out, dtype)
  return intercept


def _restore_dtypes(new: PyTree, like: PyTree) -> PyTree:
  """`new` with the dtypes of `like`'s leaves where the trees match (the model state)."""
  try:
    return jax.tree.map(lambda a, b: a.astype(b.dtype) if hasattr(b, "dtype") else a, new, like)
  except ValueError:  # a state of another structure (e.g. created in the step): as it is
    return new


def loss_in(dtype_name: str, loss_fn: Callable) -> Callable:
  """`loss_fn(trainable, frozen, model_state, x, y, mask, rng) -> (loss, model_state)`
  computing in `dtype_name`; `loss_fn` itself for float32."""
  if dtype_name == "float32":
    return loss_fn
  dtype = DTYPES[dtype_name]

  def loss(trainable, frozen, model_state, x, y, mask, rng):
    with nn.intercept_methods(_interceptor(dtype)):
      value, new_state = loss_fn(cast(trainable, dtype), cast(frozen, dtype), model_state,
                                 cast(x, dtype), y, mask, rng)
    return value.astype(jnp.float32), _restore_dtypes(new_state, model_state)

  return loss


def evaluate_in(dtype_name: str, evaluate_fn: Callable) -> Callable:
  """`evaluate_fn(params, model_state, x, *rest)` computing in `dtype_name`, its outputs in
  float32; `evaluate_fn` itself for float32."""
  if dtype_name == "float32":
    return evaluate_fn
  dtype = DTYPES[dtype_name]

  def evaluate(params, model_state, x, *rest):
    with nn.intercept_methods(_interceptor(dtype)):
      out = evaluate_fn(cast(params, dtype), model_state, cast(x, dtype), *rest)
    return _to_float32(out)

  return evaluate
