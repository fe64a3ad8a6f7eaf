"""Tests of the growing mixture of experts (alma_jax/methods/gmoe.py with split_expert, models/moe.py)."""

import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.engine import accounting
from alma_jax.engine import population
from alma_jax.engine import train
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods import gmoe
from alma_jax.models import moe
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT
MNIST = (28, 28, 1)
CIFAR = (32, 32, 3)
# A split replaces w * e(x) by w*g * e(x) + w*(1-g) * e(x): equal in exact arithmetic, a few
# float32 ulps (6e-8 relative each) apart in practice. Losses and log-probabilities here are
# below ~20 in magnitude, so they move by at most ~1e-6; a wrong split (another expert, a
# lost gate) changes them by 1e-2 or more.
SPLIT_ATOL = 1e-5


def make_method(dataset="mnist", width=4, **fields):
  """The gMoE method of a small config (shared between tests, so are its compiled functions)."""
  return helpers.cached_method("gmoe", dataset, width, **fields)


def batch(shape=MNIST, n=16, seed=0):
  ds = helpers.synthetic_dataset(n_train=n, n_test=1, shape=shape, seed=seed)
  x = (jnp.asarray(ds.train_x, jnp.float32) / 255.0 - 0.4) / 0.25
  return x, jnp.asarray(ds.train_y), jnp.ones((n,), bool)


def randomize_gates(learner, key):
  """Gate biases far from 0, so that routing is far from uniform."""
  params = dict(learner.params)
  for l in range(len(learner.structure)):
    lp = dict(params[moe.layer_name(l)])
    for name in ("gates", "gate"):
      if name in lp:
        k = jax.random.fold_in(key, l)
        lp[name] = {**lp[name], "bias": 2.0 * jax.random.normal(k, lp[name]["bias"].shape)}
    params[moe.layer_name(l)] = lp
  return base.Learner(params, learner.model_state, learner.structure)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_and_predictions(method, structure, params, model_state, x, y, mask, rng):
  loss, state = method.loss(structure, params, None, model_state, x[None], y[None], mask[None],
                            rng)
  return loss, state, method.predict(structure, params, model_state, x)


def loss_and_predictions(method, learner, x, y, mask, rng):
  """(training loss, new model state, test-time log-probabilities), compiled per structure."""
  return _loss_and_predictions(method, learner.structure, learner.params, learner.model_state, x,
                               y, mask, rng)


def grow_twice(learner):
  """Splits leaf 1 of layer 0, then the new expert 2 of layer 0 and leaf 0 of layer 1."""
  learner = gmoe.split_expert(learner, 0, 1, jax.random.key(11))
  learner = gmoe.split_expert(learner, 0, 2, jax.random.key(12))
  return gmoe.split_expert(learner, 1, 0, jax.random.key(13))


# -- trees and gates ----------------------------------------------------------------------
def test_tree_encoding_and_split():
  assert moe.balanced_tree(1) == 0
  assert moe.balanced_tree(2) == (0, 0, 1)
  t3 = moe.balanced_tree(3)
  moe.check_tree(t3)
  assert moe.leaves(t3) == [0, 1, 2] and moe.num_gates(t3) == 2
  t4 = moe.split_leaf(t3, 1)
  moe.check_tree(t4)
  assert moe.num_experts(t4) == 4 and moe.num_gates(t4) == 3
  assert moe.leaves(t4) == [0, 1, 3, 2]  # the copy (expert 3) is the right child of leaf 1
  assert moe.split_leaf(("flat", 3), 0) == ("flat", 4)
  assert moe.tree_dict((0, 0, 1)) == {"gate": 0, "children": [{"expert": 0}, {"expert": 1}]}
  with pytest.raises(ValueError, match="expert 7 is not a leaf"):
    moe.split_leaf(t3, 7)
  with pytest.raises(ValueError, match="must number its experts"):
    moe.check_tree((0, 0, 0))


@pytest.mark.parametrize("tree", [(0, (1, 0, (3, 4, 2)), (2, 1, 3)), ("flat", 5)])
def test_leaf_weights_sum_to_one_and_hard_is_one_hot(tree):
  f, b = 6, 32
  lp = moe.init_gates(jax.random.key(0), tree, f)
  feats = 3.0 * jax.random.normal(jax.random.key(1), (b, f))

  @jax.jit
  def all_weights(lp, feats):
    soft = moe.leaf_weights(tree, lp, feats)
    return soft, [moe.leaf_weights(tree, lp, feats, train=train, hard=True, rng=jax.random.key(2))
                  for train in (False, True)]

  soft, hards = all_weights(lp, feats)
  chex.assert_shape(soft, (b, 5))
  assert bool(jnp.all(soft > 0))
  chex.assert_trees_all_close(jnp.sum(soft, -1), jnp.ones((b,)), atol=1e-6)
  for hard in hards:
    chex.assert_trees_all_close(jnp.max(hard, -1), jnp.ones((b,)), atol=1e-6)
    chex.assert_trees_all_close(jnp.sum(hard, -1), jnp.ones((b,)), atol=1e-6)
  # The gates route different examples to different experts; test-time hard routing is the
  # greedy descent, which can be read off the soft weights.
  assert len(set(np.argmax(hards[0], -1).tolist())) > 1
  chex.assert_trees_all_equal(moe.greedy_leaf(tree, soft), jnp.argmax(hards[0], -1))
  # A single expert has weight 1 and no gate.
  assert moe.init_gates(jax.random.key(0), 0, f) == {}
  chex.assert_trees_all_equal(moe.leaf_weights(0, {}, feats), jnp.ones((b, 1)))


def test_hard_straight_through_gradient_reaches_the_gates():
  tree, f = (0, 0, (1, 1, 2)), 4
  lp = moe.init_gates(jax.random.key(0), tree, f)
  feats = jax.random.normal(jax.random.key(1), (8, f))
  out = jnp.arange(3.0)

  def objective(lp):
    w = moe.leaf_weights(tree, lp, feats, train=True, hard=True, rng=jax.random.key(2))
    return jnp.sum(w @ out)

  grads = jax.jit(jax.grad(objective))(lp)
  assert float(jnp.abs(grads["gates"]["kernel"]).sum()) > 0


# -- splits -------------------------------------------------------------------------------
@pytest.mark.parametrize("gating", ["soft", "hard"])
def test_mlp_split_preserves_loss_and_predictions(gating):
  method = make_method(gating=gating, initial_experts=2)
  learner = randomize_gates(method.init(jax.random.key(0)), jax.random.key(1))
  x, y, mask = batch()
  before = loss_and_predictions(method, learner, x, y, mask, jax.random.key(5))
  grown = grow_twice(learner)
  assert gmoe.experts_per_layer(grown.structure) == [4, 3]
  after = loss_and_predictions(method, grown, x, y, mask, jax.random.key(5))
  chex.assert_trees_all_close(before[0], after[0], atol=SPLIT_ATOL)
  chex.assert_trees_all_close(before[2], after[2], atol=SPLIT_ATOL)
  # The input learner is untouched and the copies are exact.
  assert gmoe.experts_per_layer(learner.structure) == [2, 2]
  e = grown.params["mix0"]["experts"]
  chex.assert_trees_all_equal(jax.tree.map(lambda a: a[3], e), jax.tree.map(lambda a: a[1], e))
  # Routing still sends each example through the old expert or its copies.
  old = method.route(learner, x, 0)
  new = method.route(grown, x, 0)
  family = {0: {0}, 1: {1, 2, 3}}
  assert all(n in family[o] for o, n in zip(old, new))


def test_vgg_split_preserves_function_and_batch_stats():
  method = make_method("cifar10", width=2)
  learner = method.init(jax.random.key(0))
  assert gmoe.experts_per_layer(learner.structure) == [1, 1, 1, 1]
  x, y, mask = batch(CIFAR, n=4)
  grown = gmoe.split_expert(learner, 1, 0, jax.random.key(1))
  grown = gmoe.split_expert(grown, 3, 0, jax.random.key(3))  # its gate pools 2x2 maps
  grown = gmoe.split_expert(randomize_gates(grown, jax.random.key(9)), 1, 1,
                                  jax.random.key(7))
  assert gmoe.experts_per_layer(grown.structure) == [1, 3, 1, 2]
  before = loss_and_predictions(method, learner, x, y, mask, jax.random.key(5))
  after = loss_and_predictions(method, grown, x, y, mask, jax.random.key(5))
  chex.assert_trees_all_close(before[0], after[0], atol=SPLIT_ATOL)
  chex.assert_trees_all_close(before[2], after[2], atol=SPLIT_ATOL)
  # Per-expert BatchNorm statistics: stacked, copied, and updated consistently in training.
  stats = grown.model_state["batch_stats"]["mix1"]
  chex.assert_trees_all_equal(jax.tree.map(lambda a: a[2], stats), jax.tree.map(lambda a: a[0], stats))
  new_stats = after[1]["batch_stats"]["mix1"]
  chex.assert_trees_all_equal_structs(new_stats, stats)
  chex.assert_trees_all_close(jax.tree.map(lambda a: a[2], new_stats),
                              jax.tree.map(lambda a: a[0], new_stats), atol=1e-6)
  chex.assert_trees_all_close(before[1]["batch_stats"]["mix1"],
                              jax.tree.map(lambda a: a[:1], new_stats), atol=1e-5)
  assert not np.allclose(jax.tree.leaves(new_stats)[0], jax.tree.leaves(stats)[0])


def test_flat_gate_split_changes_the_function():
  method = make_method(tree=False, initial_experts=2)
  learner = method.init(jax.random.key(0))
  assert learner.structure[0][1] == ("flat", 2)
  x, y, mask = batch()
  before = loss_and_predictions(method, learner, x, y, mask, jax.random.key(5))
  grown = gmoe.split_expert(learner, 0, 0, jax.random.key(3))
  assert grown.structure[0][1] == ("flat", 3)
  # Three active outputs in four slots (the next power of two).
  chex.assert_shape(grown.params["mix0"]["gate"]["kernel"], (784, 4))
  assert grown.model_state["routing"]["mix0"]["active"].tolist() == [True] * 3 + [False]
  after = loss_and_predictions(method, grown, x, y, mask, jax.random.key(5))
  assert float(jnp.max(jnp.abs(before[2] - after[2]))) > 1e-4


def test_param_count_grows_by_one_expert_and_one_gate_per_split_layer():
  h = 4
  method = make_method(width=h)
  split = lambda l, layer: jax.eval_shape(  # shapes only: nothing to compile
      lambda l: gmoe.split_expert(l, layer, 0, jax.random.key(1)), l)
  learner = jax.eval_shape(method.init, jax.random.key(0))
  n0 = method.num_params(learner)
  assert n0 == (784 * h + h) + (h * h + h) + (h * 10 + 10)  # the SM network, no gate
  one = split(learner, 0)
  assert method.num_params(one) - n0 == (784 * h + h) + (2 * 784 + 2)
  both = split(one, 1)
  assert method.num_params(both) - method.num_params(one) == (h * h + h) + (2 * h + 2)
  assert method.describe(both) == {"num_params": method.num_params(both), "experts": [2, 2],
                                   "gates": [1, 1]}
  again = split(both, 1)
  assert method.num_params(again) - method.num_params(both) == (h * h + h) + (2 * h + 2)


# -- growth criterion -------------------------------------------------------------------------
def test_split_picks_the_arg_max_leaf_for_both_criteria():
  # Expert 0 carries most examples (usage) but expert 2 carries the largest loss.
  weights = jnp.array([[0.8, 0.1, 0.1], [0.7, 0.2, 0.1], [0.6, 0.1, 0.3], [0.1, 0.1, 0.8],
                       [0.5, 0.5, 0.0]])
  losses = jnp.array([0.1, 0.2, 0.1, 5.0, 100.0])
  mask = jnp.array([True, True, True, True, False])  # the padded example does not count
  usage = gmoe.expert_scores(weights, losses, mask, "usage")
  loss = gmoe.expert_scores(weights, losses, mask, "loss")
  chex.assert_trees_all_close(usage, jnp.array([2.2, 0.5, 1.3]), atol=1e-6)
  chex.assert_trees_all_close(loss, jnp.array([0.78, 0.56, 4.06]), atol=1e-6)
  assert gmoe.losing_expert(usage) == 0
  assert gmoe.losing_expert(loss) == 2
  # The method splits the arg-max leaf of every layer.
  method = make_method(initial_experts=2)
  learner = method.init(jax.random.key(0))
  grown = method.grow_learner(learner, [np.array([1.0, 3.0]), np.array([2.0, 0.0])],
                              jax.random.key(1))
  assert grown.structure[0][1] == (0, 0, (1, 1, 2))
  assert grown.structure[0][1] == moe.split_leaf(learner.structure[0][1], 1)
  assert grown.structure[1][1] == moe.split_leaf(learner.structure[1][1], 0)


# -- training, compilation, growth in the stream -------------------------------------------
def test_compiles_once_per_structure_and_grows_before_stages():
  ds = helpers.synthetic_dataset(n_train=200, n_test=32)
  c = helpers.small_config(method="gmoe", width=4, epochs=1)
  c.method.split_by = "usage"
  c.method.grow_every = 2
  method, steps = helpers.make_steps(c, ds)
  # The train step traces the loss, evaluation traces predict: once per structure each.
  method.loss = chex.assert_max_traces(method.loss, n=2)
  method.predict = chex.assert_max_traces(method.predict, n=2)
  learner = helpers.init(method)
  train_idx, val_idx = np.arange(150, dtype=np.int32), np.arange(150, 200, dtype=np.int32)
  ctx = lambda t: helpers.context(t, steps=steps, train_idx=train_idx, val_idx=val_idx)
  for t in (1, 2, 3, 4):
    learner = method.before_stage(learner, jax.random.key(10 + t), ctx(t))
    # Stages 1 and 2 train the initial experts; the split comes before stage 3 (every 2).
    assert gmoe.experts_per_layer(learner.structure) == [1 + (t >= 3)] * 2
    learner, _, _ = train.fit_one(steps, learner, train_idx, val_idx, jax.random.key(t))
  chex.assert_tree_all_finite(learner.params)
  kinds = [k[0].split()[0] for k in steps.compiled]
  # Train and evaluate each structure once; the growth scores before the split at t=3 come
  # from the evaluation program, which compiles nothing more.
  assert kinds.count("train") == 2 and kinds.count("eval") == 2 and kinds.count("reduce") == 0
  assert steps.num_compilations == 4
  # The learner is rebuilt from its structure alone (checkpoint restore).
  shapes = jax.eval_shape(lambda k: method.init(k, learner.structure), jax.random.key(0))
  chex.assert_trees_all_equal_shapes_and_dtypes(shapes.params, learner.params)
  chex.assert_trees_all_equal_shapes_and_dtypes(shapes.model_state, learner.model_state)


def _inference_flops(method, num_experts=1):
  """Compiler FLOPs of predicting one example (as Steps.flops counts them), from shapes."""
  learner = jax.eval_shape(method.init, jax.random.key(0))
  for e in range(num_experts - 1):
    learner = jax.eval_shape(lambda l, e=e: gmoe.split_expert(
        gmoe.split_expert(l, 0, e, jax.random.key(0)), 1, e, jax.random.key(1)), learner)
  x = jax.ShapeDtypeStruct((100,) + MNIST, jnp.float32)
  predict = functools.partial(method.predict, learner.structure)
  return accounting.count(predict, learner.params, learner.model_state, x).flops / 100


def test_hard_gating_inference_runs_one_path_on_the_mlp():
  h = 64
  one = _inference_flops(make_method(width=h))  # a single expert per layer: the SM network
  assert one == pytest.approx(2 * (784 * h + h * h + h * 10), rel=0.02)
  soft = _inference_flops(make_method(width=h), 4)
  hard = _inference_flops(make_method(width=h, gating="hard"), 4)
  assert soft > 3.8 * one  # soft gating runs all four experts of each layer
  gates = 3 * 2 * 2 * (784 + h)  # three 2-way gates per layer
  assert one < hard < one + 2 * gates  # hard: one expert per layer plus the gates


def test_gating_tree_and_route():
  method = make_method(initial_experts=2)
  learner = grow_twice(method.init(jax.random.key(0)))
  tree = gmoe.gating_tree(learner, 0)
  assert tree == {"gate": 0, "children": [{"expert": 0}, {"gate": 1, "children": [
      {"expert": 1}, {"gate": 2, "children": [{"expert": 2}, {"expert": 3}]}]}]}
  x, _, _ = batch()
  leaves = method.route(learner, x, 1)
  assert leaves.shape == (16,) and set(leaves.tolist()) <= {0, 1, 2}
  weights = method.routing_weights(learner, x)
  assert [w.shape for w in weights] == [(16, 4), (16, 3)]


# -- configuration errors ---------------------------------------------------------------------
@pytest.mark.parametrize("field,value,message", [
    ("gating", "medium", r"config\.method\.gating='medium' is unknown; valid values: \['hard', 'soft'\]"),
    ("split_by", "random", r"config\.method\.split_by='random' is unknown; valid values: \['loss', 'usage'\]"),
    ("initial_experts", 0, r"config\.method\.initial_experts=0 must be >= 1"),
    ("grow_every", 1.5, r"config\.method\.grow_every=1\.5 must be an integer"),
    ("tree", "yes", r"config\.method\.tree='yes' must be true or false"),
    ("gate_pool", 0, r"config\.method\.gate_pool=0 must be >= 1"),
    ("max_experts", 2, r"config\.method\.max_experts=2 is below config\.method\.initial_experts=3"),
])
def test_bad_fields_give_clear_errors(field, value, message):
  c = helpers.small_config(method="gmoe")
  c.method.initial_experts = 3
  with c.method.ignore_type():
    c.method[field] = value
  with pytest.raises(ConfigError, match=message):
    methods.make(c, MNIST, 10)


def test_keeping_the_optimizer_state_across_growth_is_refused():
  c = helpers.small_config(method="gmoe", keep_optimizer_state=True)
  with pytest.raises(ConfigError, match=r"config\.train\.keep_optimizer_state=True"):
    methods.make(c, MNIST, 10)
  c.method.grow = False  # a fixed MoE keeps its shapes
  methods.make(c, MNIST, 10)


@pytest.mark.parametrize("name", ["mnist_gmoe", "cifar_gmoe"])
def test_config_files_set_every_method_field(name):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for variant in ("", "smoke", "quick"):
    c = module.get_config(variant)
    assert c.method.name == "gmoe"
    assert {f.name for f in gmoe.GrowingMoE.FIELDS} <= set(c.method.keys())
  c = module.get_config("smoke")
  c.mesh.num_devices = 1
  methods.make(c, MNIST if name.startswith("mnist") else CIFAR, 10)


@requires_mnist
@pytest.mark.parametrize("gating", ["soft", "hard"])
def test_split_preserves_loss_and_predictions_on_real_mnist(gating):
  from alma_jax.data import images  # pylint: disable=g-import-not-at-top
  ds = images.load_image_dataset("mnist")
  x = (jnp.asarray(ds.test_x[:64], jnp.float32) / 255.0 - ds.mean) / ds.std
  y, mask = jnp.asarray(ds.test_y[:64]), jnp.ones((64,), bool)
  method = make_method(gating=gating, initial_experts=2)
  learner = randomize_gates(method.init(jax.random.key(3)), jax.random.key(4))
  before = loss_and_predictions(method, learner, x, y, mask, jax.random.key(6))
  after = loss_and_predictions(method, grow_twice(learner), x, y, mask, jax.random.key(6))
  chex.assert_trees_all_close(before[0], after[0], atol=SPLIT_ATOL)
  chex.assert_trees_all_close(before[2], after[2], atol=SPLIT_ATOL)


def test_growth_scores_come_from_the_evaluation_program():
  """The scores `before_stage` splits by, summed by the evaluation program, equal those of a
  separate pass over the same examples; they compile nothing and count as a pass's FLOPs."""
  ds = helpers.synthetic_dataset(n_train=300, n_test=16)
  c = helpers.small_config(method="gmoe", width=4, eval_batch_size=64)
  c.method.initial_experts = 3
  with jax.enable_x64(True):  # see helpers.float64: two programs, the same arithmetic
    method, steps = helpers.make_steps(c, ds)
    learner = helpers.random_learner(method)
    idx = np.arange(100, 300, dtype=np.int32)  # 4 batches, the last one padded
    steps.evaluate(population.stack([learner]), "train", idx)
    programs = steps.num_compilations
    scores = steps.eval_aux(learner, idx)
    assert steps.num_compilations == programs
    flops = steps.pass_flops
    reference = steps.reduce(method.eval_aux, learner, idx)
    assert steps.pass_flops == 2 * flops > 0
  assert len(scores) == 2 and scores[0].shape == (4,)  # two mixture layers, 3 experts in 4 slots
  assert scores[0][3] == 0.0 and np.all(scores[0][:3] > 0)  # the padding slot scores 0
  chex.assert_trees_all_close(scores, reference, atol=1e-9, rtol=1e-9)


def _path_product_by_definition(path, values):
  """An expert's weight as the product of its path's gate values, multiplied gate after gate
  in index order (root first), off-path gates contributing an exact 1."""
  w = None
  for g in range(min(path.shape[1], values.shape[1])):
    side = path[:, g]
    v = jnp.where(side == 1, values[:, g, :1],
                  jnp.where(side == 2, values[:, g, 1:], jnp.ones((), values.dtype)))
    w = v if w is None else w * v
  return w


@pytest.mark.parametrize("experts,slots", [(2, 2), (3, 4), (5, 8), (9, 16), (16, 16)])
def test_the_path_product_is_bitwise_that_of_gate_after_gate_and_so_is_its_gradient_to_round_off(
    experts, slots):
  rng = np.random.default_rng(experts)
  tree = moe.balanced_tree(1)
  while moe.num_experts(tree) < experts:  # uneven trees: split leaves at random
    tree = moe.split_leaf(tree, int(rng.choice(moe.leaves(tree))))
  path = jnp.asarray(moe.tree_arrays(tree, slots)["path"])
  values = jax.nn.softmax(jnp.asarray(rng.normal(size=(32, path.shape[1], 2)), jnp.float32))
  cotangent = jnp.asarray(rng.normal(size=(32, slots)), jnp.float32)
  new = jax.jit(lambda v: moe._path_product(path, v))
  old = jax.jit(lambda v: _path_product_by_definition(path, v))
  np.testing.assert_array_equal(new(values), old(values))  # the same products in the same order

  def grad(f):
    return jax.jit(jax.grad(lambda v: jnp.sum(f(v) * cotangent)))(values)

  # A gate value's gradient sums, over the slots below it, the cotangent times products of
  # values in [0, 1]: each term is at most |cotangent| in size, and float32 sums of the same
  # `slots` terms in two orders differ by at most 2 * slots * eps * sum |terms|.
  bound = 2 * slots * np.finfo(np.float32).eps * float(np.abs(cotangent).sum(1).max())
  np.testing.assert_allclose(grad(new), grad(old), rtol=0, atol=bound)


@pytest.mark.parametrize("train", [False, True])
def test_the_path_product_compiles_to_one_loop_whatever_the_number_of_gates(train):
  # Unrolled, the products were a chain of G - 1 multiplications of slices of one array,
  # which XLA:GPU's fusion pass took superlinear time over (benchmarks/README.md, "Compiling
  # for a GPU without one"). The lowered program holds one loop over the gates (the gradient
  # a second, backwards), and its text is as long for 16 slots as for 4.
  def lowered(slots):
    tree = moe.balanced_tree(slots)
    path = jnp.asarray(moe.tree_arrays(tree, slots)["path"])
    values = jax.ShapeDtypeStruct((8, slots - 1, 2), jnp.float32)
    f = lambda v: moe._path_product(path, v)
    if train:
      f = jax.grad(lambda v: jnp.sum(moe._path_product(path, v)))
    text = jax.jit(f).lower(values).as_text()
    return text.count("stablehlo.while"), len(text.splitlines())

  assert lowered(4)[0] == (2 if train else 1)
  assert lowered(4) == lowered(16)
