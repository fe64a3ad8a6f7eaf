"""The reduced VGG's inference form: BatchNorm folded into the convolutions in evaluation
programs only (alma_jax/models/vgg.py, alma_jax/models/inference.py)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax

from alma_jax.engine.programs import Batch
from alma_jax.models import conv
from alma_jax.models import inference
from alma_jax.models import vgg
from tests import helpers

U = 2.0**-24  # float32's unit round-off


def _random_variables(module, x, seed):
  """`module`'s variables with BatchNorm parameters and running statistics far from their
  initial values (scale 1, bias 0, mean 0, variance 1 would fold into the same kernel)."""
  variables = module.init(jax.random.key(seed), x, train=False)
  rng = np.random.default_rng(seed)

  def perturb(path, leaf):
    name = jax.tree_util.keystr(path)
    if "'scale'" in name or "'var'" in name:
      return jnp.asarray(rng.uniform(0.3, 3.0, leaf.shape), leaf.dtype)
    if "'bias'" in name or "'mean'" in name:
      return jnp.asarray(rng.normal(0.0, 0.5, leaf.shape), leaf.dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(perturb, variables)


def test_a_folded_block_is_the_same_function_to_its_round_off():
  """One conv -> BatchNorm -> ReLU -> max-pool block. Both forms use the same computed m =
  scale * rsqrt(var + eps) (the same operations in both), so take m as given. Per output
  element, from the n = 9 C_in products of the convolution: as defined, (sum x k - mean) m + b,
  within gamma_n of the sum (any order of its additions) and three roundings after it; folded,
  sum x (k m) + (b - mean m), one rounding of each k m, gamma_n of the sum and three roundings
  of the bias and its addition. Each is within (n + 3) u (1 + (n + 3) u) S of the exact value,
  S = sum |x| |k| |m| + |mean m| + |b|, u = 2^-24, so the two differ by less than
  2 (n + 4) u S; ReLU and the max-pool take no element further from its counterpart."""
  c_in, width = 5, 7
  block = vgg.ConvBlock(width, 1)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 8, c_in)), jnp.float32)
  variables = _random_variables(block, x, seed=2)
  defined = block.apply(variables, x, train=False)
  with inference.evaluation():
    folded = block.apply(variables, x, train=False)
  assert folded.shape == defined.shape == (4, 4, 4, width)
  p, s = variables["params"], variables["batch_stats"]["bn0"]
  var = np.asarray(s["var"], np.float64)
  m = np.abs(np.asarray(p["bn0"]["scale"]) / np.sqrt(var + vgg.BN_EPSILON))
  k = np.asarray(p["conv0"]["kernel"], np.float64)
  with jax.enable_x64(True):
    magnitude = np.asarray(lax.conv_general_dilated(
        jnp.abs(jnp.asarray(x, jnp.float64)), jnp.asarray(np.abs(k) * m), (1, 1), "SAME",
        dimension_numbers=conv.DIMENSION_NUMBERS))
  magnitude = (magnitude + np.abs(np.asarray(s["mean"]) * m)
               + np.abs(np.asarray(p["bn0"]["bias"])))
  n = 9 * c_in
  bound = vgg.max_pool_2x2(jnp.asarray(2 * (n + 4) * U * magnitude, jnp.float32))
  diff = np.abs(np.asarray(folded, np.float64) - np.asarray(defined, np.float64))
  assert np.all(diff <= np.asarray(bound)), float(np.max(diff / np.asarray(bound)))
  assert not np.array_equal(folded, defined)  # another order of the arithmetic: it ran


def _activation_products(fn, batch: int, *args) -> int:
  """How many multiplications of `fn`'s traced program yield an activation map (an array of
  rank 4 whose leading axis is the `batch`: BatchNorm's scaling; a kernel's leads with 3)."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  count = 0

  def walk(jx):
    nonlocal count
    for eqn in jx.eqns:
      shape = eqn.outvars[0].aval.shape
      if eqn.primitive.name == "mul" and len(shape) == 4 and shape[0] == batch:
        count += 1
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return count


def test_a_vgg_folds_its_batchnorms_at_inference_inside_an_evaluation_only():
  model = vgg.VGG(width=4)
  x = jnp.zeros((2, 32, 32, 3), jnp.float32)
  variables = model.init(jax.random.key(0), x, train=False)
  # New functions for each trace: JAX keeps a function's traces by its arguments' types only.
  infer = lambda: lambda v, x: model.apply(v, x, train=False)
  train = lambda: lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])
  assert _activation_products(infer(), 2, variables, x) >= 16  # each BatchNorm scales its map
  with inference.evaluation():
    assert _activation_products(infer(), 2, variables, x) == 0
    assert inference.folds()
    folded_training = str(jax.make_jaxpr(train())(variables, x))
  assert not inference.folds()
  assert folded_training == str(jax.make_jaxpr(train())(variables, x))  # training never folds


def test_the_evaluation_program_of_a_vgg_run_folds_and_the_flop_count_does_not():
  """The evaluation body traces the folded form; the method's prediction, which Comp's
  inference FLOPs count, is the network as defined."""
  ds = helpers.synthetic_dataset(n_train=64, n_test=32, shape=(32, 32, 3))
  c = helpers.small_config("cifar10", width=4, eval_batch_size=16)
  method, steps = helpers.make_steps(c, ds)
  learner = helpers.init(method)
  structure = method.program_structure(learner.structure)
  batch = Batch(jnp.arange(16, dtype=jnp.int32), jnp.ones(16, bool))
  body = steps.programs.eval_body(structure)
  data = steps.programs.data
  assert _activation_products(body, 16, learner.params, learner.model_state, data, batch) == 0
  x = jnp.zeros((16, 32, 32, 3), jnp.float32)
  assert _activation_products(lambda p, s, x: method.predict(structure, p, s, x), 16,
                              learner.params, learner.model_state, x) >= 16
