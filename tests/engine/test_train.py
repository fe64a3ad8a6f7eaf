"""Tests of the training stage (alma_jax/engine/train.py) and compiled steps (alma_jax/engine/steps.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import errors
from alma_jax.engine import orders
from alma_jax.engine import train
from tests import helpers


def test_mlp_train_step_flops_match_analytic_count():
  h, b, d, k = 64, 128, 784, 10
  c = helpers.small_config(width=h)
  c.optimizer.name = "sgd"
  c.optimizer.kwargs = {"learning_rate": 0.1}
  method, steps = helpers.make_steps(c, helpers.synthetic_dataset(n_train=256))
  flops = steps.flops(helpers.init(method))
  dims = [(d, h), (h, h), (h, k)]
  matmul_fwd = sum(2 * b * i * o for i, o in dims)
  matmul_bwd = sum(2 * b * i * o for i, o in dims) + sum(2 * b * i * o for i, o in dims[1:])
  n_params = sum(i * o + o for i, o in dims)
  elementwise = (3 * b * d  # normalisation of the input
                 + 2 * b * (2 * h + k)  # bias add forward, bias gradient
                 + 2 * 2 * b * h  # ReLU forward and backward
                 + 2 * n_params)  # SGD update
  analytic = matmul_fwd + matmul_bwd + elementwise
  assert flops["train_step"] == pytest.approx(analytic, rel=0.01)
  # The forward pass of the loss takes normalised inputs: matmuls, bias adds and ReLUs.
  forward = matmul_fwd + b * (2 * h + k) + 2 * b * h
  assert flops["train_step_forward"] == pytest.approx(forward, rel=0.01)
  assert flops["train_step"] > 2.0 * flops["train_step_forward"]
  assert flops["inference_per_example"] == pytest.approx(matmul_fwd / b, rel=0.01)


def test_fit_stage_learns_and_keeps_the_best_epoch():
  ds = helpers.synthetic_dataset(n_train=1024, n_test=256)
  c = helpers.small_config(width=16, epochs=6, patience=6)
  method, steps = helpers.make_steps(c, ds)
  learner = helpers.init(method)
  err0 = helpers.test_error(steps, learner)
  best, _, stats = train.fit_one(steps, learner, np.arange(900, dtype=np.int32),
                                 np.arange(900, 1024, dtype=np.int32), jax.random.key(1))
  assert stats.epochs_run.tolist() == [6] and 1 <= stats.best_epoch[0] <= 6
  assert stats.steps_run.tolist() == [6 * 8]  # ceil(900 / 128) = 8 steps per epoch
  acc = helpers.evaluate(steps, best, np.arange(900, 1024, dtype=np.int32))
  assert acc == pytest.approx(stats.best_val_accuracy[0])
  assert helpers.test_error(steps, best) < min(err0, 0.5)
  # The input learner is untouched (the step donates copies, not the originals).
  chex.assert_trees_all_equal(learner.params, helpers.init(method).params)


def test_early_stopping_with_patience():
  ds = helpers.synthetic_dataset(n_train=512, learnable=False)
  c = helpers.small_config(width=8, epochs=50, patience=1)
  c.optimizer.kwargs = {"learning_rate": 0.0}  # nothing changes: no epoch improves on the first
  method, steps = helpers.make_steps(c, ds)
  _, _, stats = train.fit_one(steps, helpers.init(method), np.arange(400, dtype=np.int32),
                              np.arange(400, 512, dtype=np.int32), jax.random.key(0))
  assert stats.epochs_run.tolist() == [2] and stats.best_epoch.tolist() == [1]


@pytest.mark.parametrize("k", [1, 3])
def test_partial_last_batch_is_masked_not_recompiled(k):
  ds = helpers.synthetic_dataset(n_train=600)
  c = helpers.small_config(width=8, steps_per_call=k)
  method, steps = helpers.make_steps(c, ds)
  learner = helpers.init(method)
  for n in (300, 200, 457):  # different stage sizes, same compiled step
    learner, _, _ = train.fit_one(steps, learner, np.arange(n, dtype=np.int32),
                                  np.arange(500, 600, dtype=np.int32), jax.random.key(n))
  assert steps.num_compilations == 2  # one train and one eval function (validation and test)
  chex.assert_tree_all_finite(learner.params)


def test_padding_slots_hold_real_examples_and_are_masked():
  idx = np.arange(100, 110, dtype=np.int32)
  order, mask, steps = orders.padded_orders(np.random.default_rng(0), idx, 2, 4, 2)
  assert steps == 3 and order.shape == mask.shape == (4, 2, 4)  # 3 steps padded to 2 calls of 2
  for d in range(2):
    flat, m = order[:, d].ravel(), mask[:, d].ravel()
    assert m.sum() == 10 and m[:10].all()
    assert sorted(flat[:10]) == list(idx)  # one pass over the data
    np.testing.assert_array_equal(flat[10:], flat[:6])  # padding repeats the order
  assert not np.array_equal(order[:, 0], order[:, 1])  # each order its own shuffle


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_steps_per_call_gives_the_same_result(augment):
  # With crop_flip every step draws its crops and flips: step i of an epoch draws the same ones
  # whether it runs alone or inside a call of K steps.
  ds = helpers.synthetic_dataset(n_train=600)
  results = []
  with jax.enable_x64(True):  # a scan and single calls round differently: see helpers.float64
    for k in (1, 4):
      c = helpers.small_config(width=8, steps_per_call=k, augment=augment)
      method, steps = helpers.make_steps(c, ds)
      best, _, stats = train.fit_one(steps, helpers.float64(helpers.init(method)),
                                     np.arange(500, dtype=np.int32),
                                     np.arange(500, 600, dtype=np.int32), jax.random.key(3))
      assert jax.tree.leaves(best.params)[0].dtype == jnp.float64
      results.append((best.params, stats.steps_run.tolist()))
  assert results[0][1] == results[1][1]
  chex.assert_trees_all_close(results[0][0], results[1][0], atol=1e-9, rtol=1e-9)


def test_sharded_step_matches_single_device():
  ds = helpers.synthetic_dataset(n_train=512)
  out = []
  with jax.enable_x64(True):  # 8 devices sum the batch in another order: see helpers.float64
    for n_dev in (1, 8):
      c = helpers.small_config(width=8)
      method, steps = helpers.make_steps(c, ds, num_devices=n_dev)
      best, _, _ = train.fit_one(steps, helpers.float64(helpers.init(method)),
                                 np.arange(400, dtype=np.int32),
                                 np.arange(400, 512, dtype=np.int32), jax.random.key(0))
      out.append(best.params)
  assert len(jax.devices()) == 8
  chex.assert_trees_all_close(out[0], out[1], atol=1e-9, rtol=1e-9)


def test_vgg_crop_flip_stage_runs_with_batchnorm():
  ds = helpers.synthetic_dataset(n_train=300, n_test=64, shape=(32, 32, 3))
  c = helpers.small_config("cifar10", width=4)
  method, steps = helpers.make_steps(c, ds)
  learner = helpers.init(method)
  best, _, stats = train.fit_one(steps, learner, np.arange(250, dtype=np.int32),
                                 np.arange(250, 300, dtype=np.int32), jax.random.key(0))
  assert stats.steps_run.tolist() == [2 * 2]
  stats_before = learner.model_state["batch_stats"]
  stats_after = best.model_state["batch_stats"]
  assert not np.allclose(jax.tree.leaves(stats_before)[0], jax.tree.leaves(stats_after)[0])
  chex.assert_tree_all_finite(best.params)


def test_divergence_raises_with_stage_and_epoch():
  ds = helpers.synthetic_dataset(n_train=300)
  c = helpers.small_config(width=8)
  c.optimizer.kwargs = {"learning_rate": float("nan")}
  method, steps = helpers.make_steps(c, ds)
  with pytest.raises(errors.DivergenceError, match="stage t=7 epoch 1"):
    train.fit_one(steps, helpers.init(method), np.arange(250, dtype=np.int32),
                  np.arange(250, 300, dtype=np.int32), jax.random.key(0), t=7)


def test_random_crop_flip_shapes_and_content():
  from alma_jax.data import augment
  x = jnp.arange(2 * 8 * 8 * 1, dtype=jnp.float32).reshape(2, 8, 8, 1)
  y = augment.random_crop_flip(jax.random.key(0), x, pad=2)
  chex.assert_shape(y, (2, 8, 8, 1))
  # Every output pixel is either padding (0) or a pixel of the same image.
  for i in range(2):
    vals = set(np.asarray(y[i]).ravel().tolist()) - {0.0}
    assert vals <= set(np.asarray(x[i]).ravel().tolist())


def test_reduce_and_scan_pass_over_training_examples_once_compiled():
  ds = helpers.synthetic_dataset(n_train=300)
  c = helpers.small_config(width=4, eval_batch_size=128)
  method, steps = helpers.make_steps(c, ds)
  learner = helpers.init(method)
  idx = np.arange(10, 260, dtype=np.int32)  # two full batches of 128 and a padded one

  def count(structure, params, model_state, x, y, mask, task):
    del structure, params, model_state, task
    return {"n": jnp.sum(mask), "labels": jnp.sum(jnp.where(mask, y, 0)),
            "pixels": jnp.sum(jnp.where(mask[:, None, None, None], x, 0.0))}

  def visit(structure, params, model_state, x, y, mask, carry, task):
    del structure, params, model_state, x, task
    return carry + jnp.sum(jnp.where(mask, y, 0))

  out = steps.reduce(count, learner, idx)
  assert out["n"] == 250 and out["labels"] == ds.train_y[10:260].sum()
  normalised = (ds.train_x[10:260].astype(np.float64) / 255.0 - 0.4) / 0.25
  # Summing n float32 values of magnitude <= m errs by at most n * m * 6e-8 (any order).
  bound = normalised.size * np.abs(normalised).max() * 6e-8
  assert out["pixels"] == pytest.approx(normalised.sum(), abs=bound)
  assert int(steps.scan(visit, jnp.int32(0), learner, idx)) == ds.train_y[10:260].sum()
  steps.reduce(count, learner, idx[:7])
  assert steps.num_compilations == 2  # one program per pass function, reused
