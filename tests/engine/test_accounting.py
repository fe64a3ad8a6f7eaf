"""Tests of FLOP and multiply-add counting (alma_jax/engine/accounting.py, Steps.flops, comp_paper)."""

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.engine import accounting
from alma_jax.engine import timing
from alma_jax.engine.programs import Batch
from alma_jax.methods import firefly
from alma_jax.methods import gmoe
from alma_jax.methods.base import Learner
from alma_jax.runtime import background
from alma_jax.runtime import executables
from alma_jax.stream import run as run_lib
from tests import helpers
from tests.conftest import requires_mnist


def test_products_elementwise_scans_and_conditionals():
  a, b = jnp.ones((3, 5)), jnp.ones((5, 7))
  c = accounting.count(lambda a, b: a @ b, a, b)
  assert (c.flops, c.macs) == (2 * 3 * 5 * 7, 3 * 5 * 7)
  assert accounting.count(lambda a: jnp.exp(a) + 1.0, a).flops == 2 * 15
  assert accounting.count(lambda a: jnp.sum(a), a).flops == 15
  assert accounting.count(lambda a: a.astype(jnp.int32).reshape(15), a).flops == 0  # no arithmetic
  # Every floating type counts, bfloat16 (whose numpy type is not `np.inexact`) and float16 too.
  for dtype in (jnp.bfloat16, jnp.float16):
    low = a.astype(dtype)
    assert accounting.count(lambda a: jnp.exp(a) + 1.0, low).flops == 2 * 15, dtype
    assert accounting.count(lambda a: jnp.sum(a), low).flops == 15, dtype

  def scanned(a, b):
    return jax.lax.scan(lambda carry, _: (carry, a @ b), 0.0, None, length=4)[1]

  assert accounting.count(scanned, a, b).macs == 4 * 3 * 5 * 7
  branches = lambda p, a, b: jax.lax.cond(p, lambda: (a @ b).sum(), lambda: a.sum())
  assert accounting.count(branches, True, a, b).macs == 3 * 5 * 7  # the costlier branch
  x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
  conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  assert accounting.count(conv, x, k).macs == 2 * 8 * 8 * 4 * (3 * 3 * 3)


def _built(dataset, width, method="sm", train=None, **model):
  """(method, Steps) of a small config of `method` on synthetic `dataset` images; `train` and
  `model` override fields of those sections."""
  c = helpers.small_config(dataset, method=method, width=width, **(train or {}))
  for k, v in model.items():
    c.model[k] = v
  shape = (28, 28, 1) if dataset == "mnist" else (32, 32, 3)
  return helpers.make_steps(c, helpers.synthetic_dataset(n_train=64, n_test=8, shape=shape))


def _flops(dataset, width, method="sm", train=None, **model):
  method, steps = _built(dataset, width, method, train, **model)
  return steps.flops(helpers.init(method))


def test_counting_traces_are_not_compilation():
  # A function never traced before in this process: its trace emits the compile events.
  scale = float(np.random.default_rng().integers(2, 1 << 20))
  fn = lambda x: jnp.tanh(x @ x.T) * scale  # pylint: disable=unnecessary-lambda-assignment
  x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  before = timing.compile_seconds()
  assert accounting.count(fn, x).flops > 0
  assert timing.compile_seconds() == before
  with timing.counting():
    assert timing.counting_now()
    jax.make_jaxpr(lambda x: fn(x) + 1.0)(x)
  assert not timing.counting_now() and timing.compile_seconds() == before
  jax.make_jaxpr(lambda x: fn(x) + 2.0)(x)  # outside: a trace is compilation time
  assert timing.compile_seconds() > before


def test_mlp_inference_is_two_flops_per_multiply_add():
  h = 64
  macs = 784 * h + h * h + h * 10
  flops = _flops("mnist", h)
  assert flops["train_macs_per_example"] == macs
  # Besides the products: 2h + 10 bias adds and 2h ReLUs per example, 0.5% of the total.
  assert flops["inference_per_example"] == pytest.approx(2 * macs, rel=0.01)


@pytest.mark.parametrize("width,impl", [(4, "xla"), (8, "chunked_dw"), (8, "native_dw"), (8, "native")])
def test_vgg_multiply_adds_match_the_analytic_count(width, impl):
  # 16 3x3 convolutions on 32x32 inputs halved after each block (2, 2, 4, 4, 4 layers):
  # 9 * C^2 * (2*1024 + 2*256 + 4*64 + 4*16 + 4*4 - 1024) + 9*3*C*1024 (the first one)
  # = 16848 C^2 + 27648 C, and 10 C for the classifier.
  flops = _flops("cifar10", width, conv_impl=impl)
  assert flops["train_macs_per_example"] == 16848 * width ** 2 + 27658 * width


@pytest.mark.parametrize("method", ["sm", "gmoe", "ff"])
def test_counts_do_not_depend_on_the_convolution_implementation(method):
  # chunked_dw's custom gradient computes the first layer's input gradient (the images need
  # none) and adds up chunks; the native kernels are custom calls, which no count sees: the
  # count is that of XLA's convolutions whichever runs, in the backbone (SM), in experts
  # (gMoE's VGG) and in the networks a growing method builds for each width (FF).
  expected = _flops("cifar10", 8, method, conv_impl="xla")
  assert expected["train_macs_per_example"] > 16848 * 8 ** 2  # the convolutions are counted
  for impl in ("chunked_dw", "native_dw", "native"):
    assert _flops("cifar10", 8, method, conv_impl=impl) == expected, impl


@pytest.mark.parametrize("method", ["sm", "gmoe", "ff"])
def test_a_count_leaves_the_programs_their_own_convolutions(method):
  # The count traces XLA's convolutions (`conv.as_xla`) in its own traces only: a prediction
  # traced after it still calls the native kernels, and none of XLA's convolutions.
  m, steps = _built("cifar10", 8, method, conv_impl="native")
  learner = helpers.init(m)
  assert steps.flops(learner)["train_macs_per_example"] > 16848 * 8 ** 2
  structure = m.program_structure(learner.structure)
  x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
  text = str(jax.make_jaxpr(lambda p, s, x: m.predict(structure, p, s, x))(
      learner.params, learner.model_state, x))
  assert "conv_general_dilated" not in text and "alma_conv3x3_forward" in text


def test_counts_do_not_depend_on_the_compute_dtype():
  # bfloat16 runs the same arithmetic at a lower precision: its elementwise operations and
  # reductions count as float32's do.
  assert (_flops("mnist", 16, train={"compute_dtype": "bfloat16"})
          == _flops("mnist", 16, train={"compute_dtype": "float32"}))


@pytest.mark.parametrize("name", ["lm_sm", "lm_ens", "lm_gmoe"])
def test_counts_do_not_depend_on_scanning_the_switch_transformer(name):
  # One model, an ensemble's members in one vmap, and experts in slots: the scanned form's
  # train loss and prediction count as the unrolled form's, FLOP for FLOP.
  def counts(scan):
    c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", name), "smoke")
    c.model.dim, c.model.ffn_dim, c.model.dropout = 32, 48, 0.1
    c.model.num_layers, c.model.moe_every, c.model.scan_layers = 4, 2, scan
    m = methods.make(c, (16,), 97)
    learner = jax.eval_shape(m.init, jax.random.key(0))
    trainable, frozen = jax.eval_shape(m.partition, learner)
    n, spec = m.num_data_orders(learner.structure), jax.ShapeDtypeStruct
    tokens, mask = spec((n, 2, 16), jnp.int32), spec((n, 2), jnp.bool_)
    loss = lambda *a: m.loss(learner.structure, *a)[0]  # pylint: disable=unnecessary-lambda-assignment
    train = accounting.count(jax.value_and_grad(loss), trainable, frozen, learner.model_state,
                             tokens, tokens, mask, jax.eval_shape(lambda: jax.random.key(1)))
    infer = accounting.count(lambda p, s, x: m.predict(learner.structure, p, s, x),
                             learner.params, learner.model_state, spec((2, 16), jnp.int32))
    return train, infer

  scanned = counts(True)
  assert scanned[0].macs > 0 and scanned == counts(False)


def test_firefly_candidate_network_counts_do_not_depend_on_the_convolution_implementation():
  # The growth passes (PassCosts) count the candidate network, built by the method itself.
  def candidate_macs(impl):
    method = _built("cifar10", 4, "ff", conv_impl=impl)[0]
    learner = jax.eval_shape(method.init, jax.random.key(0))
    widths = tuple(learner.structure)
    cands = jax.eval_shape(lambda p: firefly.init_candidates(
        jax.random.key(0), method.layout, p, widths, 2, (0.1, 0.1, 0.01)), learner.params)
    x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    return accounting.count(
        lambda p, s, c_, x_: method.candidate_logits(widths, p, s, c_, method.zero_scales(
            widths), x_), learner.params, learner.model_state, cands, x).macs

  expected = candidate_macs("xla")
  assert expected > 2 * 9 * 3 * 12 * 1024  # the first layer's 2 C + K = 12 channels at least
  for impl in ("chunked_dw", "native"):
    assert candidate_macs(impl) == expected, impl


def test_counts_do_not_use_the_backends_cost_analysis(monkeypatch):
  expected = _flops("mnist", 16)
  # A backend without cost analysis (some GPU builds return none).
  monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
  monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", lambda self: None)
  assert _flops("mnist", 16) == expected
  assert expected["train_step"] > 0


def _read(path):
  with open(path) as f:
    return [json.loads(l) for l in f] if path.endswith(".jsonl") else json.load(f)


@requires_mnist
def test_comp_paper_is_forward_multiply_adds_times_examples(tmp_path, monkeypatch):
  # P3 smoke: 1000 training images in B=10 mega-batches of 100 (10 validation, 90 training
  # each), one epoch per stage: 900 examples through the 784-64-64-10 MLP.
  counted_on, step_flops = [], accounting.step_flops

  def recorded(*args):
    counted_on.append(threading.get_ident())
    return step_flops(*args)

  monkeypatch.setattr(accounting, "step_flops", recorded)
  helpers.run_config("configs/bench/p3_mnist_sm.py:smoke", tmp_path)
  # One structure, counted once, while its first stage trained.
  assert len(counted_on) == 1 and counted_on[0] != threading.get_ident()
  summary = _read(str(tmp_path / "summary.json"))
  records = _read(str(tmp_path / "log.jsonl"))
  macs = 784 * 64 + 64 * 64 + 64 * 10
  assert summary["comp_paper"] == macs * 900 * 1
  assert [r["train_macs"] for r in records] == [0.0] + [macs * 90.0] * 10
  assert summary["comp_growth"] == 0.0 and summary["cer_percent"] == pytest.approx(
      100 * summary["cer"])
  # The full train-step count also covers backward passes, updates and padded slots.
  assert summary["comp"] > 3 * 2 * summary["comp_paper"]


@requires_mnist
def test_gmoe_mem_equals_sm_until_its_first_growth(tmp_path):
  logs = {}
  for name in ("sm", "gmoe"):
    helpers.run_config(f"mnist_{name}:smoke", tmp_path / name)
    logs[name] = _read(str(tmp_path / name / "log.jsonl"))
  params = {n: [r["num_params"] for r in log] for n, log in logs.items()}
  # One expert per layer is the SM network; the first split comes before stage 2 (t=2).
  assert params["gmoe"][:2] == params["sm"][:2]
  assert all(g > s for g, s in zip(params["gmoe"][2:], params["sm"][2:]))
  growth = [r["growth_flops"] for r in logs["gmoe"]]
  assert growth[:2] == [0.0, 0.0] and all(g > 0 for g in growth[2:])
  assert all(r["growth_flops"] == 0.0 and r["growth_macs"] == 0.0 for r in logs["sm"])
  # The scoring passes' multiply-adds: at least one per two FLOPs counted besides them.
  macs = [r["growth_macs"] for r in logs["gmoe"]]
  assert macs[:2] == [0.0, 0.0] and all(0 < 2 * m < g for m, g in zip(macs[2:], growth[2:]))
  assert np.all(np.diff(params["gmoe"][1:]) > 0)  # one split per layer before each later stage


class _WholeLearner:
  """The two methods' hooks that `PassCosts` calls, for a learner without padding slots."""

  def active_view(self, learner):
    return learner

  def program_structure(self, structure):
    return structure


def test_growth_passes_count_only_the_real_examples_of_a_padded_batch():
  data = jnp.ones((20, 5))
  learner = Learner(params=jnp.ones((5, 7)), model_state={}, structure=())
  build = lambda structure: lambda params, model_state, data, batch: (data[batch.idx] @ params)
  costs = accounting.PassCosts(_WholeLearner(), data)
  full = Batch(np.arange(8, dtype=np.int32), np.ones((8,), bool))
  padded = Batch(np.arange(8, dtype=np.int32), np.arange(8) < 3)
  costs.add("reduce", build, learner, build, full)
  per_example = 2 * 5 * 7  # one row of the product: 5 x 7 multiply-adds, 2 FLOPs each
  assert costs.total == 8 * per_example and costs.total_macs == 8 * per_example / 2
  costs.add("reduce", build, learner, build, padded)
  assert costs.total == (8 + 3) * per_example  # exact: small integers in float64
  assert costs.total_macs == (8 + 3) * 5 * 7


def test_growth_pass_costs_are_counted_on_the_background_thread_and_added_in_order():
  data = jnp.ones((20, 5))
  learner = Learner(params=jnp.ones((5, 7)), model_state={}, structure=())
  traced_on, gate = [], threading.Event()

  def build(structure):
    def body(params, model_state, data, batch, carry):
      traced_on.append(threading.get_ident())
      return carry + data[batch.idx] @ params
    return body

  costs = accounting.PassCosts(_WholeLearner(), data)
  background.later(gate.wait, 30)  # the thread is busy: the batches below are not counted yet
  carry = jnp.zeros((8, 7))
  for n in (8, 3):
    costs.add("scan", build, learner, build, Batch(np.arange(8, dtype=np.int32),
                                                  np.arange(8) < n), carry)
  assert traced_on == []
  gate.set()
  # per example: a row of the product (2 x 5 x 7) and the sum with the carry (7)
  assert costs.total == (8 + 3) * (2 * 5 * 7 + 7) and costs.total_macs == (8 + 3) * 5 * 7
  assert len(traced_on) == 1 and traced_on[0] != threading.get_ident()


# -- Comp counts the learning algorithm, not how it was executed ----------------------------------
def _comps(wd):
  with open(wd / "summary.json") as f:
    s = json.load(f)
  return {k: s[k] for k in ("comp", "comp_forward", "comp_paper", "comp_total")}


@requires_mnist
def test_ensemble_comp_is_the_same_for_every_strategy_and_device_count(tmp_path):
  # Counts are sums of integers (FLOPs of traced programs times steps and examples) well below
  # 2**53, so every strategy and mesh must give exactly the same numbers, not close ones.
  # loop on 1 and 8 devices: the mesh; loop and vmap on 8: the strategy.
  comps = {}
  for strategy, devices in (("loop", 1), ("loop", 8), ("vmap", 8)):
    c = helpers.smoke("ens", method__strategy=strategy)
    c.mesh.num_devices = devices
    wd = tmp_path / f"{strategy}_{devices}"
    run_lib.run(c, str(wd))
    comps[(strategy, devices)] = _comps(wd)
  first = comps[("loop", 1)]
  assert first["comp"] > 0
  assert all(c == first for c in comps.values()), comps


@pytest.mark.parametrize("name", ["umix", "gens"])
def test_step_counts_do_not_depend_on_the_strategy(name):
  ds = helpers.synthetic_dataset(n_train=64, n_test=8)
  counts = []
  for strategy in ("loop", "vmap"):
    c = helpers.small_config("mnist", method=name, width=8)
    for field, value in ({"num_members": 3} if name == "umix"
                         else {"initial_members": 2, "grow_by": 2}).items():
      c.method[field] = value
    c.method.strategy = strategy
    method, steps = helpers.make_steps(c, ds)
    learner = helpers.init(method)
    if name == "gens":  # 2 frozen members and 2 trained ones, in slots
      learner = method.before_stage(learner, jax.random.key(1), helpers.context(2, stage=2))
    counts.append(steps.flops(learner))
  assert counts[0] == counts[1]


def test_a_kept_count_serves_learners_whose_trees_differ_in_shape_only_not_in_experts(
    tmp_path, monkeypatch):
  # A count is kept under what the counted programs are built from (each layer's active
  # experts, the shapes), not under the gMoE tree: two seeds that split different experts
  # share it, and it is the count of either.
  c = helpers.small_config("mnist", method="gmoe")
  method, steps = helpers.make_steps(c, helpers.synthetic_dataset(n_train=64, n_test=8))
  key = jax.random.key(0)
  one = gmoe.split_expert(helpers.init(method), 0, 0, key)
  left, right = gmoe.split_expert(one, 0, 0, key), gmoe.split_expert(one, 0, 1, key)
  assert left.structure != right.structure
  own = steps.flops(right)  # outside `keeping`: counted
  counted = []
  real = accounting._step_flops  # pylint: disable=protected-access
  monkeypatch.setattr(accounting, "_step_flops", lambda *a: counted.append(1) or real(*a))
  with executables.keeping(str(tmp_path), "one run's context"):
    assert steps.flops(left) == own
    assert steps.flops(right) == own and len(counted) == 1
    assert steps.flops(one) != own and len(counted) == 2  # fewer experts: counted again
