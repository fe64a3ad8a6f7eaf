"""Growth inside slots: gMoE experts and gEns members allocated in power-of-two slots.

A split or an added member that fits the slots is an edit of values and
masks (same shapes, same compiled programs); padding slots change neither
outputs nor gradients, and Mem/Comp count active parts only. Also the compile
counter of `alma_jax.core.timing` against the steps' own cache, over whole runs.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.core import run as run_lib
from alma_jax.core import timing
from alma_jax.methods import ensemble
from alma_jax.methods import gmoe
from alma_jax.models import moe
from tests import helpers
from tests.methods.test_gmoe import SPLIT_ATOL, batch, loss_and_predictions, make_method, randomize_gates


def _fill_padding(learner, layer, value):
  """Every padding slot of mixture `layer` (experts, gates) set to `value`."""
  name = moe.layer_name(layer)
  e = moe.num_experts(learner.structure[layer][1])
  lp = dict(learner.params[name])
  lp["experts"] = jax.tree.map(lambda a: a.at[e:].set(value), lp["experts"])
  if "gates" in lp:
    lp["gates"] = jax.tree.map(lambda a: a.at[max(e - 1, 0):].set(value), lp["gates"])
  return learner.replace(params={**learner.params, name: lp})


def test_tree_arrays_round_trip_and_slots():
  tree = moe.balanced_tree(3)
  for _ in range(4):
    tree = moe.split_leaf(tree, moe.leaves(tree)[-1])
  arrays = moe.tree_arrays(tree, 8)
  assert arrays["path"].shape == (8, 7) and arrays["active"].sum() == 7
  assert moe.tree_from_arrays(arrays["active"], arrays["path"]) == tree
  assert moe.tree_from_arrays(*moe.tree_arrays(0, 1).values()) == 0
  assert moe.tree_from_arrays(*moe.tree_arrays(("flat", 3), 4).values(), flat=True) == ("flat", 3)
  assert [moe.next_power_of_two(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
  with pytest.raises(ValueError, match="2 slots cannot hold the 3 experts"):
    moe.tree_arrays(moe.balanced_tree(3), 2)


@pytest.mark.parametrize("gating", ["soft", "hard"])
def test_split_inside_the_slots_keeps_shapes_and_function(gating):
  method = make_method(initial_experts=3, gating=gating)
  learner = randomize_gates(method.init(jax.random.key(0)), jax.random.key(1))
  assert gmoe.num_slots(learner, 0) == 4
  program = method.program_structure(learner.structure)
  grown = gmoe.split_expert(learner, 0, 1, jax.random.key(2))
  # Same shapes and program structure: only values and routing arrays changed.
  chex.assert_trees_all_equal_shapes_and_dtypes(grown.params, learner.params)
  chex.assert_trees_all_equal_shapes_and_dtypes(grown.model_state, learner.model_state)
  assert method.program_structure(grown.structure) == program
  assert grown.structure != learner.structure
  x, y, mask = batch()
  before = loss_and_predictions(method, learner, x, y, mask, jax.random.key(5))
  after = loss_and_predictions(method, grown, x, y, mask, jax.random.key(5))
  chex.assert_trees_all_close(before[0], after[0], atol=SPLIT_ATOL)
  chex.assert_trees_all_close(before[2], after[2], atol=SPLIT_ATOL)
  # A full layer grows to the next power of two; the function is still unchanged.
  full = gmoe.split_expert(grown, 0, 0, jax.random.key(3))
  assert gmoe.num_slots(full, 0) == 8 and gmoe.experts_per_layer(full.structure)[0] == 5
  chex.assert_trees_all_close(loss_and_predictions(method, full, x, y, mask,
                                                   jax.random.key(5))[2], before[2],
                              atol=SPLIT_ATOL)


def test_padding_slots_change_no_output_and_get_no_gradient():
  method = make_method(initial_experts=3)
  learner = randomize_gates(method.init(jax.random.key(0)), jax.random.key(1))
  x, y, mask = batch()
  ref = loss_and_predictions(method, learner, x, y, mask, jax.random.key(5))
  noisy = _fill_padding(_fill_padding(learner, 0, 7.0), 1, -3.0)
  out = loss_and_predictions(method, noisy, x, y, mask, jax.random.key(5))
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
  np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(ref[2]))
  grads = jax.grad(lambda p: method.loss(learner.structure, p, None, learner.model_state,
                                         x[None], y[None], mask[None], jax.random.key(5))[0])(
                                             learner.params)
  for layer in (0, 1):
    g = grads[moe.layer_name(layer)]
    assert all(float(jnp.abs(a[3:]).max()) == 0.0 for a in jax.tree.leaves(g["experts"]))
    assert all(float(jnp.abs(a[:3]).max()) > 0.0 for a in jax.tree.leaves(g["experts"]))
    assert all(float(jnp.abs(a[2:]).max()) == 0.0 for a in jax.tree.leaves(g["gates"]))


def test_mem_and_flops_count_active_experts_only():
  pow2 = make_method(initial_experts=3)
  exact = make_method(initial_experts=3, slots="exact")
  padded, tight = pow2.init(jax.random.key(0)), exact.init(jax.random.key(0))
  assert gmoe.num_slots(padded, 0) == 4 and gmoe.num_slots(tight, 0) == 3
  assert pow2.num_params(padded) == exact.num_params(tight) < base_count(padded)
  # The active experts are the same draws whatever the slots.
  chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:3], padded.params["mix0"]["experts"]),
                              tight.params["mix0"]["experts"])
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  c = helpers.small_config(method="gmoe", width=4)
  c.method.initial_experts = 3
  _, steps = helpers.make_steps(c, ds)
  c.method.slots = "exact"
  _, steps_exact = helpers.make_steps(c, ds)
  assert steps.flops(padded) == steps_exact.flops(tight)


def base_count(learner):
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(learner.params))


def test_slots_fields_are_checked():
  with pytest.raises(Exception, match=r"config\.method\.slots='max' needs config\.method\.max_experts"):
    make_method(slots="max")
  method = make_method(slots="max", max_experts=6)
  assert gmoe.num_slots(method.init(jax.random.key(0)), 0) == 6
  with pytest.raises(Exception, match=r"config\.method\.slots='many' is unknown"):
    make_method(slots="many")


def test_gens_member_slots_keep_the_programs_and_the_prediction():
  method = ensemble_method()
  learner = method.init(jax.random.key(0))
  grown = ensemble.add_member(learner, jax.random.key(1), init="fresh", k=1,
                              init_fn=method.init_backbone, slots=method.slots(2))
  again = ensemble.add_member(grown, jax.random.key(2), init="fresh", k=1,
                              init_fn=method.init_backbone, slots=method.slots(3))
  assert [method.program_structure(l.structure) for l in (grown, again)] == [(2, 1), (4, 1)]
  assert method.num_params(again) == 3 * method.num_params(learner)
  fourth = ensemble.add_member(again, jax.random.key(3), init="copy", k=1, slots=method.slots(4))
  chex.assert_trees_all_equal_shapes_and_dtypes(fourth.params, again.params)
  assert method.program_structure(fourth.structure) == (4, 1)
  # The padded prediction is the mean over the active members alone.
  x = batch(n=8)[0]
  cut = lambda t: jax.tree.map(lambda a: a[:3], t)
  logits, _ = method.member_logits(cut(again.params),
                                   cut(ensemble.backbone_state(again.model_state)), x,
                                   train=False, stacked_x=False)
  ref = jax.nn.logsumexp(jax.nn.log_softmax(logits), axis=0) - np.log(3.0)
  chex.assert_trees_all_close(method.predict(again.structure, again.params, again.model_state, x),
                              ref, atol=1e-6)
  # Frozen members are not in the train state; the trained one is the last active slot.
  trainable, frozen = method.partition(again)
  assert frozen is None
  chex.assert_trees_all_equal(trainable, jax.tree.map(lambda a: a[2:3], again.params))


def ensemble_method():
  return methods.make(helpers.small_config(method="gens", width=4), (28, 28, 1), 10)


# -- compiled programs over whole runs ---------------------------------------------------------
def _run(tmp_path, name, **fields):
  c = helpers.smoke(name, **fields)
  before = timing.compile_counts()
  summary = run_lib.run(c, str(tmp_path / name))
  after = timing.compile_counts()
  return summary, after["step_programs"] - before["step_programs"]


@pytest.mark.parametrize("method,extra,bound", [
    ("sm", {}, 3),
    # Experts 1 -> 7 per layer: slots 1, 2, 4, 8; train and evaluation (which also scores the
    # experts) per slot size.
    ("gmoe", {"method__grow_every": 1}, 2 * 4),
    # Members 1 -> 7: slots 1, 2, 4, 8; train and evaluation per slot size.
    ("gens", {}, 2 * 4),
])
def test_compiled_programs_per_run_are_bounded(tmp_path, method, extra, bound):
  fields = {"stream__num_megabatches": 7, "train__epochs": 1,
            "checkpoint__enabled": False, **extra}
  summary, compiled = _run(tmp_path, method, **fields)
  # The monitoring count of step programs is the steps' cache: nothing compiled twice.
  assert compiled == summary["num_compilations"] <= bound, (compiled, summary)
  assert summary["timings"]["step_programs"] == compiled
  assert 0.0 <= summary["timings"]["compile_cache_hit_rate"] <= 1.0


# -- resume across growth in slots ---------------------------------------------------------
@pytest.mark.parametrize("method", ["gmoe", "gens"])
def test_interrupted_growing_run_resumes_to_identical_outputs(tmp_path, monkeypatch, method):
  def config():
    # gmoe: experts 1, 2, 3, 4: t=3 restores 3 experts in 4 slots
    return helpers.smoke(method, train__epochs=1,
                         **({"method__grow_every": 1} if method == "gmoe" else {}))

  run_lib.run(config(), str(tmp_path / "whole"))
  wd = str(tmp_path / "resumed")
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_AT", "t=3:checkpoint")
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_SIGNAL", "SIGINT")
  with pytest.raises(run_lib.RunInterrupted) as info:
    run_lib.run(config(), wd)
  assert info.value.last_checkpoint == 3  # the asynchronous write completed first
  monkeypatch.delenv("ALMA_JAX_TEST_KILL_AT")
  run_lib.run(config(), wd)
  assert helpers.outputs(wd) == helpers.outputs(str(tmp_path / "whole"))
