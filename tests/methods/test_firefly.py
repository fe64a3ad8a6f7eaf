"""Tests of Firefly (alma_jax/methods/firefly.py with grow_width; per-layer widths of
alma_jax/models/vgg.py and mlp.py)."""

import dataclasses
import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.engine import train
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods import firefly as ff
from alma_jax.models import mlp as mlp_lib
from alma_jax.models import vgg as vgg_lib
from alma_jax.outputs import io_utils
from alma_jax.stream import run
from alma_jax.tasks import base as task_base
from tests import helpers
from tests.conftest import requires_mnist

MNIST = (28, 28, 1)
CIFAR = (32, 32, 3)
# In float64 the grown network sums the same products in another order (the halved rows of a
# split input appear twice, new inputs add exact zeros): ~1e-16 relative per operation,
# amplified through 16 layers and BatchNorm's division by small standard deviations to at
# most ~1e-13 (measured 6e-14). A wrong surgery (a row not halved, a statistic not copied, a
# column out of place) moves the logits by 1e-2 or more.
PRESERVE_ATOL = 1e-9


def make_method(dataset="cifar10", width=4, **fields):
  """The FF method of a small config with 3 new-neuron candidates per layer (shared)."""
  fields.setdefault("num_new", 3)
  return helpers.cached_method("ff", dataset, width, **fields)


def inputs(shape, n=8, seed=0, dtype=jnp.float64):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n,) + shape), dtype)


def warmed(method, x, seed=0):
  """A float64 learner whose BatchNorm running statistics are those of `x` (so that evaluation
  mode computes a non-trivial function; fresh statistics let 16 layers decay to ~0)."""
  learner = helpers.float64(method.init(jax.random.key(seed)))
  step = jax.jit(lambda p, s: method.logits(learner.structure, p, s, x, train=True)[1])
  state = learner.model_state
  for _ in range(60 if state else 0):  # momentum 0.9: 0.9^60 ~ 2e-3 of the start remains
    state = step(learner.params, state)
  return base.Learner(learner.params, state, learner.structure)


def plan(method, learner, eps, num_new=3, seed=1, split=True, new=True):
  """Two split neurons and new candidates 0 and 2 in every layer (or none of a kind)."""
  rng = np.random.default_rng(seed)
  widths = learner.structure
  cands = ff.init_candidates(jax.random.key(seed), method.layout, learner.params, widths,
                             num_new, (0.1, 0.1, 0.01))
  splits = tuple(np.sort(rng.choice(c, 2, replace=False)) if split else np.zeros(0, int)
                 for c in widths)
  news = tuple(np.array([0, 2]) if new else np.zeros(0, int) for _ in widths)
  return ff.GrowthPlan(splits, news, tuple(cands), eps)


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def _logits(method, structure, params, model_state, x, train):
  return method.logits(structure, params, model_state, x, train=train)


def logits(method, learner, x, train):
  """(logits, new model state), compiled per (method, structure, mode)."""
  return _logits(method, learner.structure, learner.params, learner.model_state, x, train)


def loss(method, learner, x, y):
  return float(task_base.masked_cross_entropy(logits(method, learner, x, False)[0], y,
                                         jnp.ones(y.shape, bool)))


# -- the backbones ---------------------------------------------------------------------------------
def test_equal_widths_build_the_sm_backbone():
  for dataset, shape in (("cifar10", CIFAR), ("mnist", MNIST)):
    c = helpers.small_config(dataset, method="sm", width=4)
    sm = methods.make(c, shape, 10)
    fire = make_method(dataset, slots="exact")  # no channel slots: the SM backbone's trees
    a, b = sm.init(jax.random.key(5)), fire.init(jax.random.key(5))
    chex.assert_trees_all_equal((a.params, a.model_state), (b.params, b.model_state))
    x = inputs(shape, dtype=jnp.float32)
    sm_logits = jax.jit(lambda p, s, x: sm.logits((), p, s, x, train=True))  # pylint: disable=cell-var-from-loop
    chex.assert_trees_all_equal(sm_logits(a.params, a.model_state, x), logits(fire, b, x, True))
  shapes = lambda module, x: jax.eval_shape(module.init, jax.random.key(0), x)  # pylint: disable=unnecessary-lambda-assignment
  p = shapes(mlp_lib.MLP(widths=(5, 7)), jnp.zeros((1, 4)))["params"]
  assert p["dense0"]["kernel"].shape == (4, 5) and p["dense1"]["kernel"].shape == (5, 7)
  p = shapes(vgg_lib.VGG(widths=tuple(range(1, 17))), jnp.zeros((1,) + CIFAR))
  assert [p["params"][f"block{b}"][f"conv{i}"]["kernel"].shape[-1] for b, n in
          enumerate(vgg_lib.BLOCKS) for i in range(n)] == list(range(1, 17))


# -- the surgery -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset, shape", [("cifar10", CIFAR), ("mnist", MNIST)])
def test_epsilon_zero_keeps_the_function_in_training_and_evaluation(dataset, shape):
  method = make_method(dataset)
  with jax.enable_x64(True):
    x = inputs(shape)
    learner = warmed(method, x)
    grown = ff.grow_width(learner, plan(method, learner, eps=0.0), method.layout)
    assert grown.structure == tuple(c + 4 for c in learner.structure)
    for train_mode in (False, True):
      before, state = logits(method, learner, x, train_mode)
      after, grown_state = logits(method, grown, x, train_mode)
      assert float(jnp.max(jnp.abs(before))) > 0.1  # a function worth keeping
      chex.assert_trees_all_close(before, after, atol=PRESERVE_ATOL, rtol=0)
      # Training updates the old neurons' statistics as before.
      chex.assert_trees_all_close(
          state, jax.tree.map(lambda a, b: a[..., :b.shape[-1]], grown_state, state),
          atol=PRESERVE_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["new", "split"])
def test_small_epsilon_changes_the_loss_by_order_epsilon(kind):
  """New neurons move the loss by eps times its derivative (+ O(eps^2)). A split's first order
  cancels: (f(z + eps u) + f(z - eps u)) / 2 = f(z) for this piecewise-linear network (ReLU,
  max-pool, BatchNorm on running statistics) wherever no kink lies within eps |u| of z, so
  its change is at most linear in eps and vanishes for small eps. In float64 rounding stays
  near 1e-14; a wrong surgery changes the loss by O(1) for every eps."""
  method = make_method("cifar10")
  epsilons = (1e-2, 1e-3, 1e-4, 1e-6)
  with jax.enable_x64(True):
    x = inputs(CIFAR)
    y = jnp.arange(8) % 10
    learner = warmed(method, x)
    base_loss = loss(method, learner, x, y)
    change = {eps: loss(method, ff.grow_width(learner, plan(method, learner, eps,
                                                            split=kind == "split",
                                                            new=kind == "new"), method.layout),
                        x, y) - base_loss
              for eps in epsilons}
  assert 1e-5 < abs(change[1e-2]) < 1e-1, change
  for eps in epsilons[1:]:
    assert abs(change[eps]) <= 1.5 * eps / 1e-2 * abs(change[1e-2]) + 1e-12, change
  if kind == "new":
    assert change[1e-4] / 1e-4 == pytest.approx(change[1e-3] / 1e-3, rel=0.05), change
  else:
    assert abs(change[1e-6]) < 1e-10, change


def test_split_neurons_copy_their_batchnorm_and_new_neurons_start_at_identity():
  method = make_method("cifar10")
  learner = method.init(jax.random.key(0))
  learner = base.Learner(learner.params, jax.tree.map(
      lambda a: a + jax.random.uniform(jax.random.key(1), a.shape), learner.model_state),
                         learner.structure)
  p = plan(method, learner, eps=0.01)
  grown = ff.grow_width(learner, p, method.layout)
  c = learner.structure[5]
  split, new = p.split[5], p.new[5]  # layer 5: block2/conv1
  for tree, old_tree, names in ((grown.params, learner.params, ("scale", "bias")),
                                (grown.model_state["batch_stats"],
                                 learner.model_state["batch_stats"], ("mean", "var"))):
    for name in names:
      now, before = tree["block2"]["bn1"][name], old_tree["block2"]["bn1"][name]
      np.testing.assert_array_equal(now[:c], before)
      np.testing.assert_array_equal(now[c:c + 2], before[split])  # the copies
      identity = {"scale": 1.0, "bias": 0.0, "mean": 0.0, "var": 1.0}[name]
      np.testing.assert_array_equal(now[c + 2:], np.full(len(new), identity))
  # The kernel: old columns (split ones + eps v), the other halves (- eps v), new columns a;
  # rows of the previous layer's split inputs halved and repeated, new inputs eps b.
  w, k = learner.params["block2"]["conv1"]["kernel"], grown.params["block2"]["conv1"]["kernel"]
  v, a = p.candidates[5]["v"], p.candidates[5]["a"]
  prev_split, prev_new, i = p.split[4], p.new[4], learner.structure[4]
  half = np.ones(i)
  half[prev_split] = 0.5
  np.testing.assert_allclose(k[:, :, :i, split], (w[..., split] + 0.01 * v[..., split])
                             * half[:, None], rtol=1e-6)
  np.testing.assert_allclose(k[:, :, :i, c:c + 2], (w[..., split] - 0.01 * v[..., split])
                             * half[:, None], rtol=1e-6)
  np.testing.assert_allclose(k[:, :, :i, c + 2:], a[..., new] * half[:, None], rtol=1e-6)
  np.testing.assert_array_equal(k[:, :, i:i + 2], k[:, :, prev_split])
  b = p.candidates[4]["b"][:, :, prev_new]
  np.testing.assert_allclose(k[:, :, i + 2:, :c], 0.01 * b[..., :c], rtol=1e-6)
  np.testing.assert_allclose(k[:, :, i + 2:, c + 2:], 0.01 * b[..., c + new], rtol=1e-6)
  # Every later shape is that of a fresh learner of the grown structure.
  fresh = jax.eval_shape(lambda key: method.init(key, grown.structure), jax.random.key(0))
  chex.assert_trees_all_equal_shapes_and_dtypes(fresh.params, grown.params)
  chex.assert_trees_all_equal_shapes_and_dtypes(fresh.model_state, grown.model_state)
  assert method.num_params(grown) == ff.base.count_params(fresh.params)
  with pytest.raises(ValueError, match="must be distinct"):
    ff.grow_width(learner, dataclasses.replace(p, split=(np.array([0, 0]),) + p.split[1:]),
                  method.layout)


# -- scores and selection --------------------------------------------------------------------
def test_selection_takes_the_most_negative_scores_across_layers_and_kinds():
  scores = [{"split": np.array([0.5, -2.0, 0.1]), "new": np.array([-3.0, 0.0])},
            {"split": np.array([-1.0, 0.2]), "new": np.array([-0.5, -4.0, 1.0])}]
  split, new = ff.select(scores, 4)
  assert [s.tolist() for s in split] == [[1], [0]]
  assert [n.tolist() for n in new] == [[0], [1]]
  split, new = ff.select(scores, 0)
  assert sum(len(s) + len(n) for s, n in zip(split, new)) == 0
  with pytest.raises(FloatingPointError):
    ff.select([{"split": np.array([np.nan]), "new": np.zeros(0)}], 1)


@pytest.fixture(scope="module")
def mlp_steps():
  ds = helpers.synthetic_dataset(n_train=160, n_test=16)
  c = helpers.small_config(method="ff", width=6, epochs=1)
  c.method.num_new = 4
  c.method.slots = "exact"  # one structure per growth (slots: tests/methods/test_growth_slots.py)
  c.train.eval_batch_size = 64
  return helpers.make_steps(c, ds)


def test_scores_are_the_derivatives_of_the_loss_in_the_candidate_scales(mlp_steps):
  """The score pass (`ctx.scan` over batches) against central differences of the mean loss
  of the candidate network, in float64 (truncation ~h^2 = 1e-8 relative)."""
  method, steps = mlp_steps
  with jax.enable_x64(True):
    learner = helpers.float64(method.init(jax.random.key(0)))
    cands = ff.init_candidates(jax.random.key(1), method.layout, learner.params,
                               learner.structure, 4, (0.1, 0.1, 0.3))
    idx = np.arange(100, dtype=np.int32)  # two batches of the pass, the second one partial
    _, sums = steps.scan(method.score_batch, (cands, method.zero_scales(learner.structure,
                                                                        jnp.float64)),
                         learner, idx)
    ds_x, ds_y = steps.task.inputs(steps.data, jnp.asarray(idx))

    @jax.jit
    def mean_loss(scales):
      out = method.candidate_logits(learner.structure, learner.params, learner.model_state,
                                    cands, scales, ds_x.astype(jnp.float64))
      return task_base.masked_cross_entropy(out, ds_y, jnp.ones(idx.shape, bool))

    zero, h = method.zero_scales(learner.structure, jnp.float64), 1e-4
    for layer, kind, j in ((0, "split", 2), (1, "split", 5), (0, "new", 1), (1, "new", 3)):
      bump = lambda d: [{k: s[k].at[j].add(d) if (l, k) == (layer, kind) else s[k] for k in s}  # pylint: disable=cell-var-from-loop
                        for l, s in enumerate(zero)]
      numeric = (mean_loss(bump(h)) - mean_loss(bump(-h))) / (2 * h)
      assert float(sums[layer][kind][j]) / len(idx) == pytest.approx(float(numeric), rel=1e-5,
                                                                      abs=1e-9)


def test_growth_adds_the_budget_before_later_stages_and_compiles_once(mlp_steps):
  method, steps = mlp_steps
  assert method.n_grow == 3  # int(0.25 * (6 + 6))
  train_idx, val_idx = np.arange(128, dtype=np.int32), np.arange(128, 160, dtype=np.int32)
  ctx = lambda stage: helpers.context(stage, steps=steps, train_idx=train_idx, val_idx=val_idx)
  learner = method.init(jax.random.key(0))
  assert method.before_stage(learner, jax.random.key(1), ctx(1)) is learner  # not the first
  structures = []
  for stage in (1, 2, 3):
    learner = method.before_stage(learner, jax.random.key(stage), ctx(stage))
    structures.append(learner.structure)
    assert sum(learner.structure) == 12 + 3 * (stage - 1)  # linear growth, n_grow each time
    learner, _, _ = train.fit_one(steps, learner, train_idx, val_idx, jax.random.key(stage))
  # Another stage of the same structure reuses every program.
  learner, _, _ = train.fit_one(steps, learner, train_idx, val_idx, jax.random.key(4))
  kinds = [(k[0].split()[0], k[1]) for k in steps.compiled]
  for s in structures:
    assert kinds.count(("train", s)) == 1 and kinds.count(("eval", s)) == 1
  # The candidates are fitted and scored once per grown-from structure.
  assert [k[1] for k in steps.compiled if "fit_batch" in k[0]] == structures[:2]
  assert [k[1] for k in steps.compiled if "score_batch" in k[0]] == structures[:2]
  chex.assert_tree_all_finite(learner.params)
  assert method.describe(learner) == {"num_params": method.num_params(learner),
                                      "widths": list(learner.structure)}


def test_a_growth_runs_as_its_own_compiled_programs_alone():
  """A growth is four compiled programs: the candidates' draw (which also splits the key), the
  fit and score passes, and the growth itself; the order of the fitting examples is drawn on
  the host. No JAX operation runs eagerly on the way (a key split, a permutation or an
  unstacking would each build a program of its own)."""
  names = helpers.compiled_in_a_new_process("""
      import numpy as np
      ds = helpers.synthetic_dataset(n_train=96, n_test=16)
      c = helpers.small_config(method="ff", width=7, epochs=1)
      c.method.num_new = 2
      method, steps = helpers.make_steps(c, ds)
      ctx = helpers.context(2, steps=steps, train_idx=np.arange(64, dtype=np.int32),
                            val_idx=np.arange(64, 96, dtype=np.int32))
      learner, key = method.init(jax.random.key(0)), jax.random.key(3)
  """, """
      grown = method.before_stage(learner, key, ctx)
      assert sum(grown.structure) == sum(learner.structure) + method.n_grow
  """)
  assert sorted(names) == sorted([
      "jit(draw_and_order_key)", "jit(alma_step_scan_Firefly_fit_batch)",
      "jit(alma_step_scan_Firefly_score_batch)", "jit(grow)"]), names


def test_growth_waits_for_grow_every():
  method = make_method("mnist", width=4, grow_every=2)
  ctx = lambda stage: helpers.context(stage)
  learner = method.init(jax.random.key(0))
  for stage in (1, 2, 4):  # growth only before stages 3, 5, ...
    assert method.before_stage(learner, jax.random.key(0), ctx(stage)) is learner


# -- configs and checkpoints ------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("growth_rate", -0.1, r"config\.method\.growth_rate=-0\.1 must be in"),
    ("num_new", -1, r"config\.method\.num_new=-1 must be >= 0"),
    ("fit_lr", 0.0, r"config\.method\.fit_lr=0\.0 must be in"),
])
def test_bad_fields_give_clear_errors(field, value, message):
  c = helpers.small_config(method="ff")
  c.method[field] = value
  with pytest.raises(ConfigError, match=message):
    methods.make(c, MNIST, 10)


@pytest.mark.parametrize("width, rate, bound", [(1, 0.25, "0.5"), (1, 0.499, "0.5"),
                                               (3, 0.16, "0.166667")])
def test_a_growth_rate_that_adds_no_neuron_is_refused_with_the_least_that_adds_one(
    width, rate, bound):
  # The MLP's two layers: an initial total width of 2 x width.
  c = helpers.small_config(method="ff", width=width)
  c.method.growth_rate = rate
  with pytest.raises(ConfigError, match=(
      rf"^config\.method\.growth_rate={rate} adds int\({rate} x {2 * width}\) = 0 neurons per "
      rf"growth to the initial total width {2 * width} \(config\.model\.width={width} x 2 "
      rf"layers\), so Firefly would never grow; allowed values: >= {bound} at this width, or 0 "
      r"for no growth$")):
    methods.make(c, MNIST, 10)
  c.method.growth_rate = float(bound)  # the least value named adds a neuron
  assert methods.make(c, MNIST, 10).n_grow == 1
  c.method.growth_rate = 0.0  # no growth, as asked
  assert methods.make(c, MNIST, 10).n_grow == 0


def test_keeping_the_optimizer_state_across_growth_is_refused():
  c = helpers.small_config(method="ff", keep_optimizer_state=True)
  with pytest.raises(ConfigError, match=r"config\.train\.keep_optimizer_state=True"):
    methods.make(c, MNIST, 10)


@pytest.mark.parametrize("name", ["mnist_ff", "cifar_ff"])
def test_config_files_set_every_method_field(name):
  import importlib.util  # pylint: disable=g-import-not-at-top
  root = helpers.ROOT
  spec = importlib.util.spec_from_file_location(name, os.path.join(root, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for variant in ("", "smoke", "quick"):
    c = module.get_config(variant)
    assert c.method.name == "ff" and {f.name for f in ff.Firefly.FIELDS} <= set(c.method.keys())
  assert module.get_config("").method.growth_rate == 0.25  # the paper's rate by default


def _outputs(wd):
  strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "timings", "provenance")}  # pylint: disable=unnecessary-lambda-assignment
  return ([strip(r) for r in io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))],
          io_utils.read_jsonl(os.path.join(wd, "architecture.jsonl")))


@pytest.fixture
def compilation_cache(tmp_path):
  """A private persistent compilation cache: the three runs below share their programs."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  old = [jax.config.values[n] for n in names]
  jax.config.update(names[0], str(tmp_path / "xla"))
  jax.config.update(names[1], 0.0)
  yield
  for n, v in zip(names, old):
    jax.config.update(n, v)


@requires_mnist
@pytest.mark.usefixtures("compilation_cache")
def test_a_run_resumes_across_a_growth(tmp_path, monkeypatch):
  c = config_lib.apply_variant(config_lib.base_config("mnist", "ff"), "smoke")
  c.stream.num_megabatches, c.train.epochs, c.train.patience = 3, 1, 1
  c.data.train_subset, c.data.test_subset, c.method.num_new = 600, 200, 2
  c.mesh.num_devices = 1
  run.run(c, str(tmp_path / "uninterrupted"))
  baseline = _outputs(str(tmp_path / "uninterrupted"))
  assert [sum(a["widths"]) for a in baseline[1]] == [16, 20, 24]
  wd = str(tmp_path / "resumed")
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_AT", "t=2:saved")  # after the first growth
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_SIGNAL", "SIGINT")
  with pytest.raises(run.RunInterrupted):
    run.run(c, wd)
  monkeypatch.delenv("ALMA_JAX_TEST_KILL_AT")
  run.run(c, wd)  # restores the grown structure from the checkpoint of t=2
  assert _outputs(wd) == baseline
