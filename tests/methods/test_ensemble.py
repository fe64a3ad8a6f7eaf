"""Tests of the stacked ensembles (Ens, UMix, gEns) and `ensemble.add_member`."""

import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.engine import epoch as epoch_lib
from alma_jax.engine import population
from alma_jax.engine import train
from alma_jax.errors import ConfigError
from alma_jax.methods import ensemble
from alma_jax.tasks import base as task_base
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT
MNIST = (28, 28, 1)
CIFAR = (32, 32, 3)


def make(method, model="mlp", width=4, shape=MNIST, **fields):
  c = helpers.small_config("mnist" if model == "mlp" else "cifar10", method=method, width=width)
  with c.method.ignore_type():
    for k, v in fields.items():
      c.method[k] = v
  return methods.make(c, shape, 10)


def batch(d, b=16, shape=MNIST, seed=0, padded=True):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(d, b) + shape), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, (d, b)), jnp.int32)
  mask = jnp.asarray(np.arange(b) < b - 3 * padded)[None].repeat(d, 0)  # a padded batch
  return x, y, mask


def member_logits(method, learner, x):
  fn = jax.jit(functools.partial(method.member_logits, train=False, stacked_x=False))
  return fn(learner.params, learner.model_state, x)[0]


def loss_and_grads(method, learner, x, y, mask):
  trainable, frozen = method.partition(learner)
  fn = jax.jit(jax.value_and_grad(
      lambda tr: method.loss(learner.structure, tr, frozen, learner.model_state, x, y, mask,
                             jax.random.key(0)), has_aux=True))
  return fn(trainable)


def copy_tree(tree):
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


# -- ensemble.add_member --------------------------------------------------------------------------
@pytest.mark.parametrize("init,k", [("fresh", 1), ("fresh", 2), ("copy", 2)])
def test_add_member_keeps_existing_members_bitwise(init, k):
  method = make("gens", "vgg", 2, CIFAR, initial_members=2)
  learner = method.init(jax.random.key(0))
  before = copy_tree((learner.params, learner.model_state))
  x = batch(1, 8, CIFAR)[0][0]
  logits_before = member_logits(method, learner, x)
  grown = ensemble.add_member(learner, jax.random.key(1), init=init, k=k,
                             init_fn=method.init_backbone)
  assert grown.structure == (2 + k, k)
  chex.assert_trees_all_equal((learner.params, learner.model_state), before)  # input untouched
  # The members sit in slots: four (the next power of two), the first 2 + k active.
  active = grown.model_state[ensemble.SLOTS_KEY]["active"]
  assert np.asarray(active).tolist() == [True] * (2 + k) + [False] * (2 - k)
  for new, old in ((grown.params, learner.params),
                   (ensemble.backbone_state(grown.model_state),
                    ensemble.backbone_state(learner.model_state))):
    jax.tree.map(lambda a, b: chex.assert_shape(a, (4,) + b.shape[1:]), new, old)
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:2], new), old)
  logits_after = member_logits(method, grown, x)
  np.testing.assert_array_equal(np.asarray(logits_after[:2]), np.asarray(logits_before))
  last = jax.tree.map(lambda a: a[1], learner.params)
  new0 = jax.tree.map(lambda a: a[2], grown.params)
  if init == "copy":
    chex.assert_trees_all_equal(new0, last)
  else:
    assert not np.allclose(np.asarray(new0["head"]["kernel"]), np.asarray(last["head"]["kernel"]))
    if k == 2:  # the new members differ from each other
      assert not np.allclose(np.asarray(grown.params["head"]["kernel"][2]),
                             np.asarray(grown.params["head"]["kernel"][3]))


def test_add_member_rejects_bad_arguments():
  method = make("gens")
  learner = method.init(jax.random.key(0))
  with pytest.raises(ValueError, match="init='clone' is unknown; valid values"):
    ensemble.add_member(learner, jax.random.key(1), init="clone")
  with pytest.raises(ValueError, match="k=0 must be an integer >= 1"):
    ensemble.add_member(learner, jax.random.key(1), k=0, init_fn=method.init_backbone)
  with pytest.raises(ValueError, match="needs init_fn"):
    ensemble.add_member(learner, jax.random.key(1))


# -- Ens and UMix losses -----------------------------------------------------------------------------
def test_ens_members_get_independent_gradients():
  method = make("ens", num_members=3)
  learner = method.init(jax.random.key(0))
  x, y, mask = batch(3)
  (loss, _), grads = loss_and_grads(method, learner, x, y, mask)
  changed = learner.replace(params=jax.tree.map(lambda a: a.at[2].add(0.5), learner.params))
  (loss2, _), grads2 = loss_and_grads(method, changed, x, y, mask)
  assert not np.isclose(float(loss), float(loss2))
  for i in (0, 1):
    chex.assert_trees_all_close(ensemble.member(grads2, i), ensemble.member(grads, i), atol=1e-7)
  assert not np.allclose(np.asarray(grads2["head"]["kernel"][2]),
                         np.asarray(grads["head"]["kernel"][2]))
  # Member i sees only its own data order x[i]: its loss is SM's loss on it.
  sm_losses = [task_base.masked_cross_entropy(
      method.apply_backbone(ensemble.member(learner.params, i), {}, x[i], train=True)[0], y[i],
      mask[i]) for i in range(3)]
  np.testing.assert_allclose(float(loss), float(sum(sm_losses)), rtol=1e-5)


def test_umix_loss_is_cross_entropy_of_mean_logits_and_differs_from_ens():
  umix, ens = make("umix", num_members=3), make("ens", num_members=3)
  learner = umix.init(jax.random.key(0))
  x, y, mask = batch(1)
  (loss, _), _ = loss_and_grads(umix, learner, x, y, mask)
  logits = [umix.apply_backbone(ensemble.member(learner.params, i), {}, x[0], train=True)[0]
            for i in range(3)]
  expected = task_base.masked_cross_entropy(sum(logits) / 3, y[0], mask[0])
  np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
  (ens_loss, _), _ = loss_and_grads(ens, learner, *(jnp.repeat(a, 3, 0) for a in (x, y, mask)))
  assert abs(float(ens_loss) - float(loss)) > 1e-3
  logp = umix.predict(learner.structure, learner.params, learner.model_state, x[0])
  np.testing.assert_allclose(np.asarray(logp), np.asarray(jax.nn.log_softmax(sum(logits) / 3)),
                             atol=1e-5)


def test_ens_predicts_log_mean_probability():
  method = make("ens", num_members=3)
  learner = method.init(jax.random.key(0))
  x = batch(1)[0][0]
  probs = [jax.nn.softmax(method.apply_backbone(ensemble.member(learner.params, i), {}, x,
                                                train=False)[0]) for i in range(3)]
  logp = method.predict(learner.structure, learner.params, learner.model_state, x)
  np.testing.assert_allclose(np.exp(np.asarray(logp)), np.asarray(sum(probs) / 3), atol=1e-6)


@pytest.mark.parametrize("model,width,shape", [("mlp", 4, MNIST), ("vgg", 2, CIFAR)])
@pytest.mark.parametrize("name", ["ens", "umix"])
def test_vmap_and_loop_strategies_agree(model, width, shape, name):
  # The two strategies compute the same sums in different orders. In float32
  # the VGG's BatchNorm over 8 images of width 2 amplifies those rounding
  # differences (observed up to 1.8e-4 in a gradient of ~1, i.e. ~3e3 ulps,
  # and the amount depends on the CPU's kernels), so the comparison runs in
  # float64: there the same amplification gives ~3e3 * 1.1e-16 < 1e-12, and a
  # tolerance of 1e-9 leaves a margin of 1e3 while any real difference between
  # the strategies (a wrong member, mask or statistic) is of order 1e-2..1.
  out = []
  with jax.enable_x64(True):
    for strategy in ("vmap", "loop"):
      method = make(name, model, width, shape, num_members=3, strategy=strategy)
      assert method.run_as == strategy
      learner = jax.tree.map(lambda a: a.astype(jnp.float64), method.init(jax.random.key(0)))
      x, y, mask = batch(method.num_data_orders(learner.structure), 8, shape, padded=True)
      x = x.astype(jnp.float64)
      (loss, state), grads = loss_and_grads(method, learner, x, y, mask)
      logp = jax.jit(method.predict, static_argnums=0)(learner.structure, learner.params,
                                                      learner.model_state, x[0])
      assert logp.dtype == jnp.float64 and jax.tree.leaves(grads)[0].dtype == jnp.float64
      out.append((loss, state, grads, logp))
  chex.assert_trees_all_close(out[0], out[1], atol=1e-9, rtol=1e-9)


def test_vmapped_vgg_gradient_on_a_padded_batch_matches_op_by_op():
  # Masked BatchNorm statistics made XLA:CPU's jitted gradient inside vmap wrong
  # (max difference ~7 against the op-by-op gradient); the VGG now normalises
  # over the whole batch, whose padding slots hold real images.
  method = make("ens", "vgg", 2, CIFAR, num_members=2, strategy="vmap")
  learner = method.init(jax.random.key(0))
  x, y, mask = batch(2, 8, CIFAR, padded=True)
  trainable, frozen = method.partition(learner)

  def loss(tr):
    return method.loss(learner.structure, tr, frozen, learner.model_state, x, y, mask,
                       jax.random.key(0))[0]

  jitted = jax.jit(jax.grad(loss))(trainable)
  with jax.disable_jit():
    op_by_op = jax.grad(loss)(trainable)
  # Rounding differences between the fused and the op-by-op float32 gradient, amplified by
  # BatchNorm over 8 images of width 2, stay below ~2e-4 (test_vmap_and_loop_strategies_agree);
  # the miscompile this guards against was off by ~7.
  chex.assert_trees_all_close(jitted, op_by_op, atol=2e-3, rtol=1e-3)


def test_chunked_vmap_matches_loop():
  stacked = (jnp.arange(5.0)[:, None] * jnp.ones((5, 3)), jnp.arange(5.0))
  fn = lambda a, b: {"s": jnp.sum(a) * b}
  chex.assert_trees_all_close(ensemble.map_members(fn, stacked, "vmap", chunk=2),
                              ensemble.map_members(fn, stacked, "loop"))


def test_auto_strategy_rule():
  assert ensemble.choose_strategy("auto", "vgg", "cpu") == "loop"
  assert ensemble.choose_strategy("auto", "mlp", "cpu") == "vmap"
  assert ensemble.choose_strategy("auto", "vgg", "gpu") == "vmap"
  assert ensemble.choose_strategy("loop", "mlp", "gpu") == "loop"


# -- training stages --------------------------------------------------------------------------------
def test_one_member_ens_is_sm():
  ds = helpers.synthetic_dataset(n_train=300, n_test=64)
  out = []
  with jax.enable_x64(True):  # the member axis changes the order of sums: see helpers.float64
    for name in ("sm", "ens"):
      c = helpers.small_config(method=name, width=4)
      c.method.num_members = 1
      method, steps = helpers.make_steps(c, ds)
      learner = helpers.float64(method.init(jax.random.key(3)))
      best, _, _ = train.fit_one(steps, learner, np.arange(250, dtype=np.int32),
                                 np.arange(250, 300, dtype=np.int32), jax.random.key(1))
      x = jnp.asarray(ds.test_x, jnp.float64) / 255.0
      out.append([method.predict(l.structure, l.params, l.model_state, x) for l in (learner, best)])
  chex.assert_trees_all_close(out[0], out[1], atol=1e-9, rtol=1e-9)


def test_gens_stage_trains_only_new_members_and_freezes_old_ones():
  ds = helpers.synthetic_dataset(n_train=200, n_test=32, shape=CIFAR)
  c = helpers.small_config("cifar10", method="gens", width=2)
  method, steps = helpers.make_steps(c, ds)
  train_idx, val_idx = np.arange(160, dtype=np.int32), np.arange(160, 200, dtype=np.int32)
  learner = method.init(jax.random.key(0))
  ctx = helpers.context(1)
  assert method.before_stage(learner, jax.random.key(1), ctx) is learner  # first stage: no growth
  first, _, _ = train.fit_one(steps, learner, train_idx, val_idx, jax.random.key(2))
  assert not np.allclose(np.asarray(first.params["head"]["kernel"]),
                         np.asarray(learner.params["head"]["kernel"]))
  grown = method.before_stage(first, jax.random.key(3), helpers.context(2))
  assert grown.structure == (2, 1) and method.num_data_orders(grown.structure) == 1
  trained, frozen = method.partition(grown)
  # Frozen members stay in the learner, out of the train state (its shapes do not grow).
  assert ensemble.num_members(trained) == 1 and frozen is None
  assert ensemble.num_members(grown.params) == 2
  np.testing.assert_array_equal(grown.model_state["slots"]["active"], [True, True])
  frozen_before = copy_tree((ensemble.member(first.params, 0), ensemble.member(first.model_state, 0)))
  second, _, stats = train.fit_one(steps, grown, train_idx, val_idx, jax.random.key(4), t=2)
  assert stats.steps_run[0] > 0
  chex.assert_trees_all_equal(
      (ensemble.member(second.params, 0), ensemble.member(second.model_state, 0)), frozen_before)
  for after, before in ((second.params, grown.params), (second.model_state, grown.model_state)):
    assert not np.allclose(np.asarray(jax.tree.leaves(after)[0][1]),
                           np.asarray(jax.tree.leaves(before)[0][1]))
  assert method.describe(second)["members"] == 2


def test_accounting_params_and_flops():
  ds = helpers.synthetic_dataset(n_train=256, n_test=32)
  flops, params = {}, {}
  for name, n in (("sm", 1), ("ens", 2), ("gens", 1)):
    c = helpers.small_config(method=name, width=8)
    c.method.num_members = n
    method, steps = helpers.make_steps(c, ds)
    learner = method.init(jax.random.key(0))
    if name == "gens":
      learner = method.before_stage(learner, jax.random.key(1), helpers.context(2))
      assert learner.structure == (2, 1)
    flops[name], params[name] = steps.flops(learner), method.num_params(learner)
  assert params["ens"] == params["gens"] == 2 * params["sm"]
  # gEns trains one of its two members: the step costs about one SM step.
  assert flops["gens"]["train_step"] < 0.6 * flops["ens"]["train_step"]
  assert flops["gens"]["train_step"] == pytest.approx(flops["sm"]["train_step"], rel=0.05)
  assert flops["gens"]["train_step_forward"] < 0.6 * flops["ens"]["train_step_forward"]
  for name in ("ens", "gens"):  # inference runs every member
    assert flops[name]["inference_per_example"] == pytest.approx(
        2 * flops["sm"]["inference_per_example"], rel=0.05)
  assert flops["ens"]["train_step"] == pytest.approx(2 * flops["sm"]["train_step"], rel=0.05)


def test_gens_checkpoint_structure_rebuilds_its_shapes():
  method = make("gens", "vgg", 2, CIFAR)
  learner = jax.eval_shape(lambda k: method.init(k, (3, 1)), jax.random.key(0))
  assert learner.structure == (3, 1)  # 3 members in 4 slots (method.slots="pow2")
  assert learner.params["head"]["kernel"].shape[0] == 4
  assert ensemble.backbone_state(learner.model_state)["batch_stats"]["block0"]["bn0"][
      "mean"].shape[0] == 4
  assert learner.model_state["slots"]["active"].shape == (4,)
  assert jax.tree.leaves(method.active_view(learner).params)[0].shape[0] == 3
  with pytest.raises(ValueError, match="does not fit gens"):
    method.init(jax.random.key(0), (1, 2))
  with pytest.raises(ValueError, match="num_members=5"):
    make("ens").init(jax.random.key(0), (3, 3))


# -- config validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,field,value,message", [
    ("ens", "num_members", 0, r"config.method.num_members=0 must be >= 1"),
    ("umix", "num_members", "5", r"config.method.num_members='5' must be an integer"),
    ("ens", "strategy", "pmap", r"config.method.strategy='pmap' is unknown; valid values: "
     r"\['auto', 'loop', 'vmap'\]"),
    ("gens", "new_member", "clone", r"config.method.new_member='clone' is unknown; valid values: "
     r"\['copy', 'fresh'\]"),
    ("gens", "grow_by", 0, r"config.method.grow_by=0 must be >= 1"),
    ("gens", "initial_members", -1, r"config.method.initial_members=-1 must be >= 1"),
])
def test_bad_method_fields_raise_clear_errors(name, field, value, message):
  with pytest.raises(ConfigError, match=message):
    make(name, **{field: value})


def test_gens_rejects_keeping_the_optimizer_state():
  c = helpers.small_config(method="gens", width=4, keep_optimizer_state=True)
  with pytest.raises(ConfigError, match="keep_optimizer_state=True is not supported by "
                     r"gens.*allowed values: \[False\]"):
    methods.make(c, MNIST, 10)


def test_config_files_set_the_method_fields():
  import importlib.util  # pylint: disable=g-import-not-at-top
  for stem in ("mnist_ens", "mnist_umix", "mnist_gens", "cifar_ens", "cifar_umix", "cifar_gens"):
    spec = importlib.util.spec_from_file_location(stem, os.path.join(ROOT, "configs", f"{stem}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("smoke")
    assert c.method.name == stem.split("_")[1] and c.method.strategy == "auto"
    assert ("initial_members" in c.method) == (c.method.name == "gens")
    shape = MNIST if stem.startswith("mnist") else CIFAR
    methods.make(c, shape, 10)
    assert mod.get_config("quick").model.width >= c.model.width


# -- end to end -----------------------------------------------------------------------------------------
@requires_mnist
def test_mnist_gens_smoke_end_to_end(tmp_path):
  cmd = [sys.executable, "-m", "alma_jax.main", "--config=configs/mnist_gens.py:smoke",
         f"--workdir={tmp_path}", "--config.mesh.num_devices=1", "--config.train.epochs=1",
         "--config.train.patience=1", helpers.NO_FIGURE]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  import json  # pylint: disable=g-import-not-at-top
  with open(os.path.join(tmp_path, "log.jsonl")) as f:
    records = [json.loads(l) for l in f]
  assert [r["t"] for r in records] == [0, 1, 2, 3, 4]
  # One member trained at t=1, then one new member per stage.
  p = [r["num_params"] for r in records]
  assert p[0] == p[1] and p[2:] == [2 * p[0], 3 * p[0], 4 * p[0]]
  flops = [r["train_flops"] for r in records[1:]]
  inference = [r["inference_flops_per_example"] for r in records]
  assert inference[4] == pytest.approx(4 * inference[0], rel=0.05)
  assert all(f > 0 for f in flops)
  assert records[-1]["test_error"] < records[0]["test_error"]


# -- best-epoch selection per member ----------------------------------------------------------------
def _filled(learner, value):
  return learner.replace(params=jax.tree.map(lambda a: jnp.full_like(a, value), learner.params))


def _rule_epochs(method, learner, unit_accs, m, delta, patience):
  """Runs the stage's best-epoch rule (`epoch.end_epoch`, compiled) over epochs 1, 2, ... whose parameters are all `epoch` and whose units score
  `unit_accs[epoch - 1]` (accuracies of m examples); returns (stop state, best learner)."""
  rule = epoch_lib.Rule(patience, delta, m, True, True)
  select = jax.vmap(lambda t, a, b: method.select_units(learner.structure, t, a, b))
  stop = epoch_lib.StopState.start(1, len(unit_accs[0]))
  best = population.stack([_filled(learner, 0.0)])
  for e, accs in enumerate(unit_accs, start=1):
    current = population.stack([_filled(learner, float(e))])
    scores = np.asarray([accs]) * m
    stop, best, _ = jax.jit(lambda *a: epoch_lib.end_epoch(rule, select, *a))(
        stop, best, current, np.ones(1, bool), np.asarray(scores, np.float32), np.int32(e),
        np.int32(1), rule.thresholds())
  return jax.device_get(stop), best


def test_each_ens_member_keeps_its_own_best_epoch():
  method = make("ens", num_members=2)
  learner = method.init(jax.random.key(0))
  # Member accuracies per epoch: member 0 is best at epoch 2, member 1 at epoch 1; an
  # ensemble-level rule would keep a single epoch for both.
  stop, best = _rule_epochs(method, learner, [[0.5, 0.9], [0.8, 0.6], [0.7, 0.7], [0.1, 0.1]],
                            10, 0.0, 2)
  kernel = np.asarray(best.params["head"]["kernel"][0])
  assert np.all(kernel[0] == 2.0) and np.all(kernel[1] == 1.0)
  np.testing.assert_array_equal(stop.best_score, [[8, 9]])
  # Patience restarts when any member improves (epoch 2), so the stage ends after epoch 4.
  assert stop.best_epoch.tolist() == [2] and stop.since_best.tolist() == [2]
  assert not stop.active.any()


def test_patience_delta_requires_a_clear_improvement():
  method = make("sm")
  learner = method.init(jax.random.key(0))
  stop, _ = _rule_epochs(method, learner, [[0.5], [0.505], [0.52]], 1000, 0.01, 5)
  assert stop.best_epoch.tolist() == [3] and stop.best_score.tolist() == [[520]]


def test_gens_selects_its_new_member_by_its_own_accuracy():
  method = make("gens", "mlp", 4)
  learner = method.init(jax.random.key(0))
  for t in (2, 3):
    learner = method.before_stage(learner, jax.random.key(t), helpers.context(t))
  assert learner.structure == (3, 1) and method.num_units(learner.structure) == 1
  x = batch(1)[0][0]
  logp, units = method.predict_units(learner.structure, learner.params, learner.model_state, x)
  logits = member_logits(method, learner, x)
  np.testing.assert_allclose(np.asarray(units[0]), np.asarray(jax.nn.log_softmax(logits[2])),
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(
      method.predict(learner.structure, learner.params, learner.model_state, x)), atol=1e-6)
  changed = _filled(learner, 5.0)
  kept = method.select_units(learner.structure, jnp.array([True]), changed, learner)
  head = np.asarray(kept.params["head"]["kernel"])
  assert np.all(head[2] == 5.0)  # the trained member from `new`
  np.testing.assert_array_equal(head[:2], np.asarray(learner.params["head"]["kernel"][:2]))


def test_gens_copies_the_last_member_by_default():
  method = make("gens", "mlp", 4)
  learner = method.init(jax.random.key(0))
  grown = method.before_stage(learner, jax.random.key(1), helpers.context(2))
  chex.assert_trees_all_equal(ensemble.member(grown.params, 1), ensemble.member(learner.params, 0))


def test_umix_sum_and_gens_logit_options():
  x = batch(1)[0][0]
  mean, summed = make("umix", num_members=3), make("umix", num_members=3, combine="sum")
  learner = mean.init(jax.random.key(0))
  logits = member_logits(mean, learner, x)
  for method, combined in ((mean, logits.mean(0)), (summed, logits.sum(0))):
    np.testing.assert_allclose(
        np.asarray(method.predict(learner.structure, learner.params, learner.model_state, x)),
        np.asarray(jax.nn.log_softmax(combined)), atol=1e-5)
  gens = make("gens", "mlp", 4, combine="logits")
  grown = gens.before_stage(gens.init(jax.random.key(0)), jax.random.key(1), helpers.context(2))
  grown = _filled(grown, 0.0).replace(params=jax.tree.map(
      lambda a: a.at[1].add(0.1), _filled(grown, 0.0).params))
  logits = member_logits(gens, grown, x)
  np.testing.assert_allclose(
      np.asarray(gens.predict(grown.structure, grown.params, grown.model_state, x)),
      np.asarray(jax.nn.log_softmax(logits.mean(0))), atol=1e-5)
