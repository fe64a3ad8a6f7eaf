"""Growth inside slots: gMoE experts, gEns members and FF channels allocated in power-of-two
slots.

A split or an added member that fits the slots is an edit of values and
masks (same shapes, same compiled programs); padding slots change neither
outputs nor gradients, and Mem/Comp count active parts only. Also the compile
counter of `alma_jax.engine.timing` against the steps' own cache, over whole runs.
"""

import copy

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alma_jax
from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.configuration.plugins import methods as declared_methods
from alma_jax.engine import plasticity
from alma_jax.engine import timing
from alma_jax.methods import ensemble
from alma_jax.methods import firefly as ff
from alma_jax.methods import gmoe
from alma_jax.models import moe
from alma_jax.models import slots as slots_lib
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir
from alma_jax.stream import config_resolve
from alma_jax.stream import run as run_lib
from alma_jax.stream import validation
from alma_jax.tuning import autotune
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
  assert [slots_lib.next_power_of_two(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
  with pytest.raises(ValueError, match="2 slots cannot hold the 3 experts"):
    moe.tree_arrays(moe.balanced_tree(3), 2)


def test_splits_within_the_same_slots_run_one_compiled_program():
  """The split's slot indices and gate are arguments of one program per layer shapes and
  slots: the first split inside the slots compiles it (no eager operations), later ones
  reuse it."""
  method = make_method(width=7, initial_experts=5)  # shapes of this test alone
  learner = randomize_gates(method.init(jax.random.key(0)), jax.random.key(1))
  assert gmoe.num_slots(learner, 0) == 8
  counts = [timing.compile_counts()["xla_programs"]]
  for leaf, key in ((1, 2), (0, 3), (4, 4)):  # 6, 7 and 8 experts in 8 slots
    learner = gmoe.split_expert(learner, 0, leaf, jax.random.key(key))
    counts.append(timing.compile_counts()["xla_programs"])
  assert gmoe.experts_per_layer(learner.structure)[0] == 8 and gmoe.num_slots(learner, 0) == 8
  assert np.diff(counts).tolist() == [1, 0, 0], counts


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


def test_planned_slots_hold_the_experts_the_growth_plans_over_the_run():
  # P4: one expert per layer, a split before each of its nine later stages: ten.
  p4 = alma_jax.load_config("bench/p4_mnist_gmoe")
  assert gmoe.planned_stages(p4) == 10
  assert declared_methods.GMoE.planned_experts(p4, 10) == 10
  with p4.unlocked():
    p4.method.max_experts = 6
  assert declared_methods.GMoE.planned_experts(p4, 10) == 6  # no split past max_experts
  with p4.unlocked():
    p4.method.max_experts, p4.method.grow_every = 0, 3
  assert declared_methods.GMoE.planned_experts(p4, 10) == 4  # before stages 4, 7 and 10
  with p4.unlocked():
    p4.method.grow = False
  assert declared_methods.GMoE.planned_experts(p4, 10) == 1
  # The method in planned slots: every layer in that many slots from the start, so every
  # growth up to them keeps the program structure; past them (a longer stream than planned),
  # as many as it has.
  method = make_method(slots="planned", initial_experts=1, grow_every=1)
  planned = declared_methods.GMoE.planned_experts(method.config, gmoe.planned_stages(
      method.config))
  assert planned == method.config.stream.num_megabatches > 2
  learner = method.init(jax.random.key(0))
  assert [gmoe.num_slots(learner, l) for l in (0, 1)] == [planned, planned]
  structures = {method.program_structure(learner.structure)}
  for _ in range(planned - 1):
    learner = method.grow_learner(learner, [np.arange(8.0)] * 2, jax.random.key(1))
    structures.add(method.program_structure(learner.structure))
  assert gmoe.experts_per_layer(learner.structure) == [planned, planned]
  assert len(structures) == 1 and gmoe.num_slots(learner, 0) == planned
  assert method.slots(planned + 1) == planned + 1


def test_a_tree_in_slots_cut_to_one_expert_is_a_cut_of_the_learner():
  # One expert in planned (or max) slots: the active view keeps the learner's tree, with
  # gates of no rows, so the plasticity diagnostics and L2 Init can cut the learner to it
  # (they refused it as another tree structure); its values are pow2's one expert's.
  planned = make_method(slots="planned", initial_experts=1, grow_every=1)
  pow2 = make_method(initial_experts=1, grow_every=1)
  learner, ref = planned.init(jax.random.key(0)), pow2.init(jax.random.key(0))
  assert gmoe.num_slots(learner, 0) > 1 == gmoe.num_slots(ref, 0)
  active = plasticity.active_params(planned, learner)
  for layer in ("mix0", "mix1"):
    assert active[layer]["gates"]["bias"].shape[0] == 0
    chex.assert_trees_all_equal(active[layer]["experts"], ref.params[layer]["experts"])
  assert planned.num_params(learner) == pow2.num_params(ref)


def test_the_slot_rule_plans_the_slots_of_a_short_growing_run_on_an_accelerator(monkeypatch):
  p4 = alma_jax.load_config("bench/p4_mnist_gmoe")  # 2,350 planned train steps
  paper = alma_jax.load_config("mnist_gmoe")  # 50,000
  lm = alma_jax.load_config("lm_gmoe:quick")  # 320
  assert [gmoe.slot_rule(c) for c in (p4, paper, lm)] == ["pow2"] * 3  # this CPU
  monkeypatch.setattr(gmoe.jax, "default_backend", lambda: "gpu")
  assert [gmoe.slot_rule(c) for c in (p4, paper, lm)] == ["planned", "pow2", "planned"]
  fixed = p4.copy_and_resolve_references()
  fixed.method.grow = False
  assert gmoe.slot_rule(fixed) == "pow2"  # nothing grows: nothing to plan
  # `auto`, the default, is decided by the rule with the run's other speed choices, and by a
  # method built from the config directly.
  assert p4.method.slots == lm.method.slots == "auto"
  assert autotune.by_rules(p4).method.slots == "planned"
  # The Switch Transformer's gMoE (method.name lm_gmoe) too.
  assert autotune.by_rules(lm).method.slots == "planned"
  assert gmoe.GrowingMoE(p4, (28, 28, 1), 10).slot_policy == "planned"
  monkeypatch.undo()
  assert autotune.by_rules(p4).method.slots == "pow2"
  assert autotune.by_rules(alma_jax.load_config("bench/p4_mnist_gmoe")).method.slots == "pow2"


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


# -- FF: channel slots ------------------------------------------------------------------------
# In float64 the slotted network sums the exact network's products plus exact zeros (padding
# channels), in another blocking order: ~1e-16 relative per operation, through at most 17
# layers and BatchNorm's division by small standard deviations, stays below ~1e-13 (as for a
# function-preserving growth, tests/methods/test_firefly.py). A channel out of place or an unmasked
# padding channel moves the logits by 1e-2 or more.
FF_ATOL = 1e-9


def ff_methods(dataset, width=6):
  """(pow2, exact) FF methods of a small config (width 6: 8 channel slots)."""
  return tuple(helpers.cached_method("ff", dataset, width, num_new=3, slots=s)
               for s in ("pow2", "exact"))


def ff_plan(method, learner, eps, seed=1):
  """Splits of neurons 1 and 3 and new candidates 0 and 2 in every layer (active channels)."""
  widths = learner.structure
  active = ff.resize_channels(method.layout, learner.params, learner.model_state, widths)[0]
  cands = ff.init_candidates(jax.random.key(seed), method.layout, active, widths, 3,
                             (0.1, 0.1, 0.01))
  return ff.GrowthPlan(tuple(np.array([1, 3]) for _ in widths),
                       tuple(np.array([0, 2]) for _ in widths), tuple(cands), eps)


def _ff_logits(method, learner, x, train):
  return jax.jit(lambda p, s: method.logits(learner.structure, p, s, x, train=train))(
      learner.params, learner.model_state)


def _garbage_in_padding(method, learner):
  """Every padding channel's values (incoming and outgoing weights, BatchNorm parameters and
  statistics) set to 5, the active values kept."""
  widths, slots = learner.structure, ff.layer_widths(method.layout, learner.params)
  active = ff.resize_channels(method.layout, learner.params, learner.model_state, widths)
  ones = jax.tree.map(jnp.ones_like, active)
  kept = ff.resize_channels(method.layout, *ones, slots)  # 1: active entry, 0: padding
  noisy = jax.tree.map(lambda a, k: jnp.where(k == 1, a, 5.0),
                       (learner.params, {k: v for k, v in learner.model_state.items()
                                         if k != ff.SLOTS_KEY}), kept)
  return learner.replace(params=noisy[0], model_state={
      **noisy[1], ff.SLOTS_KEY: learner.model_state[ff.SLOTS_KEY]})


@pytest.mark.parametrize("dataset,shape", [("mnist", (28, 28, 1)), ("cifar10", (32, 32, 3))])
def test_ff_channel_slots_compute_the_exact_network(dataset, shape):
  pow2, exact = ff_methods(dataset)
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8,) + shape))
    slotted = helpers.float64(pow2.init(jax.random.key(0)))
    tight = helpers.float64(exact.init(jax.random.key(0)))
    assert ff.layer_widths(pow2.layout, slotted.params) == (8,) * pow2.num_layers
    assert pow2.program_structure(slotted.structure) == (8,) * pow2.num_layers
    assert pow2.num_params(slotted) == exact.num_params(tight) < base_count(slotted)
    noisy = _garbage_in_padding(pow2, slotted)
    for train_mode in (True, False):
      ref, ref_state = _ff_logits(exact, tight, x, train_mode)
      for learner in (slotted, noisy):
        out, state = _ff_logits(pow2, learner, x, train_mode)
        chex.assert_trees_all_close(out, ref, atol=FF_ATOL, rtol=0)
        if train_mode and ref_state:
          # Active statistics move as the exact network's; inactive ones are kept as they were.
          cut = ff.resize_channels(pow2.layout, learner.params, state, tight.structure)[1]
          chex.assert_trees_all_close(cut, ref_state, atol=FF_ATOL, rtol=0)
          chex.assert_trees_all_equal(
              jax.tree.map(lambda a: a[..., 6:], state["batch_stats"]),
              jax.tree.map(lambda a: a[..., 6:], learner.model_state["batch_stats"]))
    # Padding channels get no gradient, whatever their values.
    grads = jax.jit(jax.grad(lambda p: jnp.sum(pow2.logits(
        noisy.structure, p, noisy.model_state, x, train=True)[0] ** 2)))(noisy.params)
    for l, path in enumerate(pow2.layout.kernels):
      g = ff._get(grads, path)  # pylint: disable=protected-access
      assert float(jnp.abs(g[..., 6:]).max()) == 0.0 and float(jnp.abs(g[..., :6]).max()) > 0
      if l > 0:
        assert float(jnp.abs(g[..., 6:, :]).max()) == 0.0


def test_ff_growth_inside_the_slots_keeps_shapes_programs_and_function():
  pow2, exact = ff_methods("cifar10")
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32, 32, 3)))
    learner = helpers.float64(pow2.init(jax.random.key(0)))
    tight = helpers.float64(exact.init(jax.random.key(0)))
    plan = ff_plan(pow2, learner, eps=0.0)
    assert plan.added() == [4] * pow2.num_layers  # 6 -> 10 channels: past 8 slots, into 16
    grown = ff.grow_width(learner, plan, pow2.layout, pow2.slots((10,) * pow2.num_layers))
    grown_tight = ff.grow_width(tight, plan, exact.layout)
    assert grown.structure == grown_tight.structure == (10,) * pow2.num_layers
    assert ff.layer_widths(pow2.layout, grown.params) == (16,) * pow2.num_layers
    for train_mode in (False, True):
      before = _ff_logits(pow2, learner, x, train_mode)[0]
      chex.assert_trees_all_close(_ff_logits(pow2, grown, x, train_mode)[0], before,
                                  atol=FF_ATOL, rtol=0)
      chex.assert_trees_all_close(_ff_logits(pow2, grown, x, train_mode)[0],
                                  _ff_logits(exact, grown_tight, x, train_mode)[0],
                                  atol=FF_ATOL, rtol=0)
    # A growth inside the slots (10 -> 14 of 16) edits values only.
    again = ff.grow_width(grown, ff_plan(pow2, grown, eps=0.01), pow2.layout)
    chex.assert_trees_all_equal_shapes_and_dtypes(again.params, grown.params)
    chex.assert_trees_all_equal_shapes_and_dtypes(again.model_state, grown.model_state)
    assert pow2.program_structure(again.structure) == pow2.program_structure(grown.structure)
    assert pow2.num_params(again) == exact.num_params(
        ff.grow_width(grown_tight, ff_plan(exact, grown_tight, eps=0.01), exact.layout))


@pytest.mark.parametrize("dataset,mode,growths,k", [
    ("mnist", "pow2", 3, 3), ("mnist", "exact", 2, 3), ("cifar10", "pow2", 1, 3),
    ("mnist", "pow2", 2, 0)])  # k = method.num_new = 0: splits only
def test_ff_draw_and_growth_in_slots_are_the_exact_computation(dataset, mode, growths, k):
  # The programs of the slots (widths and plan as arrays) give bitwise the values of drawing
  # on the active channels and growing them (`init_candidates`, `grow_width`, compiled as the
  # method ran them) then moving the result into the slots: padded learners, uneven widths
  # and plans, a growth into larger slots (6 -> 10 of 16) and within them, and exact learners
  # (slots = widths).
  method = ff_methods(dataset)[0 if mode == "pow2" else 1]
  scales = (0.1, 0.1, 0.01)
  rng = np.random.default_rng(0)
  learner, moves = method.init(jax.random.key(0)), []
  for step in range(growths):
    widths = learner.structure
    slots = ff.layer_widths(method.layout, learner.params)
    key = jax.random.key(10 + step)
    # Both sides compiled as a run compiles them: XLA may fold the scale of a normal draw
    # differently from the operations run one at a time (1 ulp), and the suite's older fusion
    # emitters evaluate a padded array's elements otherwise than its active part's.
    got = helpers.jit_as_runs(
        lambda p, key, w: ff.draw_in_slots(key, method.layout, p, w, k, scales))(
            learner.params, key, np.asarray(widths, np.int32))
    want = helpers.jit_as_runs(lambda p, s, key, w=widths, sl=slots: ff.resize_candidates(
        ff.init_candidates(key, method.layout, ff.resize_channels(method.layout, p, s, w)[0],
                           w, k, scales), w, sl))(learner.params, learner.model_state, key)
    chex.assert_trees_all_equal(got, want)
    split = tuple(np.sort(rng.choice(c, size=2 + step % 2, replace=False)) for c in widths)
    new = tuple(np.sort(rng.choice(k, size=min(k, 2 - step % 2), replace=False))
                for _ in widths)
    cands = tuple(ff.resize_candidates(want, slots, widths))
    grown = tuple(c + len(a) + len(b) for c, a, b in zip(widths, split, new))
    new_slots = method.slots(grown)
    moves.append(slots == new_slots)
    plan = ff.GrowthPlan(split, new, cands, 0.01)
    reference = helpers.jit_as_runs(
        lambda p, s, learner=learner, plan=plan, ns=new_slots: (lambda g: (
            g.params, g.model_state))(ff.grow_width(learner.replace(params=p, model_state=s),
                                                    plan, method.layout,
                                                    ns if mode == "pow2" else None)))(
                                                        learner.params, learner.model_state)
    indices = ff.growth_indices(widths, split, new, slots, new_slots)
    out = helpers.jit_as_runs(
        lambda p, s, c, i, e: ff.grow_in_slots(method.layout, p, s, i, c, e))(
            learner.params, learner.model_state, got, indices, np.asarray(0.01, np.float32))
    chex.assert_trees_all_equal(out, reference)
    learner = learner.replace(params=out[0], model_state=out[1], structure=grown)
  # pow2: 6 -> 10 channels (past 8 slots, into 16), then within 16 slots; exact: new shapes.
  # (The VGG case, 4-d kernels, grows once.) Splits only: 6 -> 8 within 8 slots, then 11.
  expected = [False, True, False] if k else [True, False]
  assert moves == (expected[:growths] if mode == "pow2" else [False] * growths)


def test_ff_growth_indices_refuse_a_plan_that_does_not_fit_the_slots():
  with pytest.raises(ValueError, match="do not fit in 8 slots"):
    ff.growth_indices((6,), (np.array([0, 1]),), (np.array([0, 1]),), (8,), (8,))
  with pytest.raises(ValueError, match="must be distinct"):
    ff.check_plan((6,), (np.array([1, 1]),), (np.array([], int),))


def test_ff_mem_and_flops_count_active_channels_only():
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  c = helpers.small_config(method="ff", width=6)
  c.method.num_new = 3
  method, steps = helpers.make_steps(c, ds)
  c.method.slots = "exact"
  method_exact, steps_exact = helpers.make_steps(c, ds)
  padded, tight = method.init(jax.random.key(0)), method_exact.init(jax.random.key(0))
  assert method.num_params(padded) == method_exact.num_params(tight) < base_count(padded)
  assert steps.flops(padded) == steps_exact.flops(tight)


# -- compiled programs over whole runs ---------------------------------------------------------
def _run(tmp_path, name, **fields):
  """(summary, step programs compiled, XLA programs built or loaded) of a smoke run."""
  c = helpers.smoke(name, **fields)
  before = timing.compile_counts()
  summary = run_lib.run(c, str(tmp_path / name))
  after = timing.compile_counts()
  return (summary, after["step_programs"] - before["step_programs"],
          after["xla_programs"] - before["xla_programs"])


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
  summary, compiled, programs = _run(tmp_path, method, **fields)
  # The monitoring count of step programs is the steps' cache: nothing compiled twice.
  assert compiled == summary["num_compilations"] <= bound, (compiled, summary)
  assert summary["timings"]["step_programs"] == compiled
  assert 0.0 <= summary["timings"]["compile_cache_hit_rate"] <= 1.0
  if method == "gmoe":
    # Every XLA program, steps and small ones: per slot structure (1, 2, 4, 8) the train step,
    # the evaluation, the population's stack and unstack, the start of a stage's train state
    # and the end of an epoch (6 x 4); one growth program per change of the slots (at most one
    # per growth: 6; both mixture layers in one); 3 programs for the rest of the run: the
    # seeds' keys, the initial learners, a key's fold. 62 when the layers split in programs of
    # their own, the population was stacked from learners placed in three ways, the optimizer
    # state that a stage discards was unstacked and stacked again; 42 with a copy of the
    # trained parameters as the combination of the trained and frozen parts (gMoE freezes
    # none), the keys and initial learners made an operation at a time.
    assert programs <= 6 * 4 + 6 + 3, programs


def test_a_gmoe_run_in_planned_slots_compiles_one_structure_and_grows_as_in_pow2(tmp_path):
  fields = {"stream__num_megabatches": 5, "train__epochs": 1, "checkpoint__enabled": False,
            "method__grow_every": 1}
  runs = {}
  for slots in ("planned", "pow2"):
    summary, compiled, _ = _run(tmp_path / slots, "gmoe", method__slots=slots, **fields)
    arch = io_utils.read_jsonl(str(tmp_path / slots / "gmoe" / "architecture.jsonl"))
    runs[slots] = (summary, compiled, [(a["experts"], a["num_params"]) for a in arch])
  # Experts 1 -> 5 per layer: the train step and the evaluation once (pow2: for 1, 2, 4, 8).
  assert runs["planned"][1] == runs["planned"][0]["num_compilations"] == 2
  assert runs["pow2"][1] == 2 * 4
  # The same growth, Mem and compute: the padding slots are not counted.
  assert runs["planned"][2] == runs["pow2"][2]
  assert runs["planned"][2][-1][0] == [5, 5]
  assert [runs[s][0][k] for s in runs for k in ("mem", "comp_paper")] == [
      runs["pow2"][0][k] for _ in runs for k in ("mem", "comp_paper")]


def test_ff_run_compiles_once_per_power_of_two_of_the_widest_layer(tmp_path):
  summary, compiled, programs = _run(tmp_path, "ff", stream__num_megabatches=7, train__epochs=1,
                                     checkpoint__enabled=False)
  widths = [tuple(r["widths"]) for r in
            io_utils.read_jsonl(str(tmp_path / "ff" / "architecture.jsonl"))]
  assert len(widths) == 7 and len(set(widths)) == 7  # a growth before every stage but the first
  slots = [slots_lib.next_power_of_two(max(w)) for w in widths]
  # Train and evaluation once per slot structure; the candidate fit and score passes once per
  # slot structure grown from (all but the last stage's).
  assert compiled == summary["num_compilations"] == 2 * len(set(slots)) + 2 * len(set(slots[:-1]))
  # A new slot structure only when the widest layer passes a power of two, far below one per
  # growth (2 x 7 + 2 x 6 = 26 programs).
  assert len(set(slots)) == 1 + int(np.log2(slots[-1] // slots[0])) and compiled < 26
  # Every XLA program: per slot structure the train step, the evaluation, the population's
  # stack and unstack, the start of the train state and the end of an epoch (6); per slot
  # structure grown from, the candidates' draw, fit and score (3) and at most two growth
  # programs (within the slots, into larger ones); at most 8 others (keys, initialisation,
  # folds, the fit's shuffle). 38 with jax 0.10.2; 74 when the draw and the growth were
  # compiled per growth (the widths and the plan constants), 399 when eager.
  grown_from = len(set(slots[:-1]))
  assert programs <= 6 * len(set(slots)) + 5 * grown_from + 8, programs


def test_ff_min_slots_holds_every_layer_in_that_many_slots_until_it_outgrows_them():
  held = helpers.cached_method("ff", "mnist", 6, num_new=3, slots="pow2", min_slots=32)
  _, exact = ff_methods("mnist")
  assert held.program_structure((6, 6)) == held.program_structure((30, 12)) == (32, 32)
  assert held.program_structure((33, 12)) == (64, 64)  # past the minimum: the next power of 2
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 28, 28, 1)))
    learner = helpers.float64(held.init(jax.random.key(0)))
    tight = helpers.float64(exact.init(jax.random.key(0)))
    assert ff.layer_widths(held.layout, learner.params) == (32, 32)
    assert held.num_params(learner) == exact.num_params(tight)
    for train_mode in (True, False):
      chex.assert_trees_all_close(_ff_logits(held, learner, x, train_mode)[0],
                                  _ff_logits(exact, tight, x, train_mode)[0], atol=FF_ATOL, rtol=0)


def test_ff_min_slots_is_refused_without_slots():
  with pytest.raises(ValueError, match=r"method.min_slots=32 .*method.slots='exact'"):
    helpers.cached_method("ff", "mnist", 6, slots="exact", min_slots=32)


def test_ff_runs_written_before_min_slots_resume_and_keep_their_hash():
  new = workdir.config_dict(validation.complete(config_lib.base_config("mnist", "ff")))
  old = copy.deepcopy(new)
  del old["method"]["min_slots"]
  assert new["method"]["min_slots"] == 0
  assert workdir.config_diff(old, new) == []
  assert config_resolve.config_hash(old) == config_resolve.config_hash(new)
  held = copy.deepcopy(new)
  held["method"]["min_slots"] = 16
  assert workdir.config_diff(old, held) == ["config.method.min_slots: '<absent>' → 16"]
  assert config_resolve.config_hash(held) != config_resolve.config_hash(new)


@pytest.mark.parametrize("dataset,method", [("mnist", "gmoe"), ("tiny_shakespeare", "lm_gmoe")])
def test_gmoe_runs_written_at_the_old_slots_default_keep_their_hash_and_resume_as_they_ran(
    dataset, method):
  config = validation.complete(config_lib.base_config(dataset, method))
  new = workdir.config_dict(config)
  assert new["method"]["slots"] == "auto"  # the default, pow2 before
  old = copy.deepcopy(new)
  old["method"]["slots"] = "pow2"
  # A sweep finds the folder of a point run at the old default, and its resume is refused
  # only where nothing keeps the value it ran with (`autotune.kept_from`).
  assert config_resolve.config_hash(old) == config_resolve.config_hash(new)
  assert workdir.config_diff(old, new) == ["config.method.slots: 'pow2' → 'auto'"]
  for value in ("planned", "max", "exact"):
    other = copy.deepcopy(new)
    other["method"]["slots"] = value
    assert config_resolve.config_hash(other) != config_resolve.config_hash(new), value
    # A run at any value resumes with that value where the config leaves it to be chosen.
    assert autotune.kept_from(config, other) == {"method.slots": value}
  assert autotune.kept_from(config, old) == {"method.slots": "pow2"}
  kept = autotune.with_choices(config, autotune.kept_from(config, old))
  assert workdir.config_diff(old, workdir.config_dict(kept)) == []
  assert autotune.kept_from(config, new) == {} and autotune.kept_from(config, None) == {}
  # Set in the config, the value is the config's: a run of another value is refused.
  pinned = autotune.with_choices(config, {"method.slots": "planned"})
  assert autotune.kept_from(pinned, old) == {}
  absent = copy.deepcopy(new)
  del absent["method"]["slots"]  # written before the field: its experts ran without slots
  assert autotune.kept_from(config, absent) == {"method.slots": "exact"}
  # The other methods' slots keep their default, and their hash takes the value as it is.
  gens = workdir.config_dict(validation.complete(config_lib.base_config(dataset, "gens")))
  assert gens["method"]["slots"] == "pow2"
  assert workdir.hashed_value("method.slots", "pow2", gens) == "pow2"
  assert workdir.hashed_value("method.slots", "auto", new) == "pow2"
  assert workdir.hashed_value("method.slots", "planned", new) == "planned"


def test_a_gmoe_run_resumes_in_the_slots_it_ran_with_where_the_config_leaves_them_to_be_chosen(
    tmp_path, monkeypatch):
  # Experts 1, 2, 3, 4 in 4 slots from the start (max); the resume's config says auto, which
  # this CPU's rule would take as pow2 (1, 2, 4 slots): the checkpoint at t=3 holds 4 slots.
  def config(slots):
    return helpers.smoke("gmoe", train__epochs=1, method__grow_every=1, method__max_experts=4,
                         method__slots=slots)

  run_lib.run(config("max"), str(tmp_path / "whole"))
  wd = str(tmp_path / "resumed")
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_AT", "t=3:checkpoint")
  monkeypatch.setenv("ALMA_JAX_TEST_KILL_SIGNAL", "SIGINT")
  with pytest.raises(run_lib.RunInterrupted):
    run_lib.run(config("max"), wd)
  monkeypatch.delenv("ALMA_JAX_TEST_KILL_AT")
  run_lib.run(config("auto"), wd)
  assert helpers.outputs(wd) == helpers.outputs(str(tmp_path / "whole"))
  assert io_utils.read_json(str(tmp_path / "resumed" / "config.json"))["method"]["slots"] == "max"
  # A config that sets another value is refused, naming the field.
  with pytest.raises(ValueError, match=r"config\.method\.slots: 'max' → 'pow2'"):
    run_lib.run(config("pow2"), wd)


def test_ff_run_with_min_slots_past_its_widest_layer_compiles_one_structure(tmp_path):
  # Smoke: H = 8 per layer, 4 neurons per growth, 6 growths: no layer passes 32 channels.
  summary, compiled, _ = _run(tmp_path, "ff", stream__num_megabatches=7, train__epochs=1,
                              checkpoint__enabled=False, method__min_slots=32)
  widths = [tuple(r["widths"]) for r in
            io_utils.read_jsonl(str(tmp_path / "ff" / "architecture.jsonl"))]
  assert len(set(widths)) == 7 and max(map(max, widths)) <= 32
  # The train step and the evaluation, the candidates' fit and score: each once.
  assert compiled == summary["num_compilations"] == 4


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
