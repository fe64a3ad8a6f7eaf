"""Tests of the plasticity diagnostics (alma_jax/engine/plasticity.py) and of the stage
policies that keep a learner plastic: redo, continual_backprop and l2_init."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import policies
from alma_jax.engine import plasticity as plasticity_diagnostics
from alma_jax.methods import firefly
from alma_jax.methods import gmoe
from alma_jax.models import units as plasticity
from alma_jax.errors import ConfigError
from alma_jax.outputs import io_utils
from alma_jax.policies import continual_backprop
from alma_jax.stream import run
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist


def _dead_mlp(method, dead=(0, 1)):
  """The initial MLP of `method` (width 4) with the hidden units `dead` of its first layer
  silent on every input (zero incoming weights and a negative bias) and the others active
  on every input (a bias of 3, far above what the incoming weights add)."""
  learner = helpers.init(method)
  p = jax.tree.map(np.array, learner.params)
  p["dense0"]["bias"][:] = 3.0
  for u in dead:
    p["dense0"]["kernel"][:, u] = 0.0
    p["dense0"]["bias"][u] = -1.0
  return learner.replace(params=jax.tree.map(jnp.asarray, p))


def _mlp(**stream):
  c = helpers.small_config("mnist", "sm", width=4)
  for k, v in stream.items():
    c.stream[k] = v
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, steps = helpers.make_steps(c, ds)
  return validation.complete(c), method, steps, ds


def _hidden_by_hand(params, x):
  """The MLP's two hidden layers in float64 numpy."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h0 = np.maximum(x @ p["dense0"]["kernel"] + p["dense0"]["bias"], 0.0)
  h1 = np.maximum(h0 @ p["dense1"]["kernel"] + p["dense1"]["bias"], 0.0)
  return h0, h1


# -- the diagnostics -------------------------------------------------------------------------------
def test_unit_activity_and_dormant_units_of_a_constructed_network():
  _, method, steps, ds = _mlp()
  learner = _dead_mlp(method)
  idx = np.arange(40, dtype=np.int32)
  summed = steps.reduce(plasticity.activity_fn(method), learner, idx)
  activity = plasticity.mean_activity(summed)
  assert float(summed["count"]) == 40
  x = ((ds.train_x[:40].astype(np.float64) / 255.0 - 0.4) / 0.25).reshape(40, -1)
  h0, h1 = _hidden_by_hand(learner.params, x)
  # float32 sums of 784 products (relative error <= ~784 * 2^-24 ~ 5e-5) against float64.
  np.testing.assert_allclose(activity[0], h0.mean(0), rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(activity[1], h1.mean(0), rtol=2e-4, atol=1e-6)
  assert activity[0][0] == 0.0 and activity[0][1] == 0.0  # exactly silent
  assert [m.tolist() for m in plasticity.dormant(activity, 0.0)][0] == [True, True, False, False]
  # The score is the unit's activity over its layer's mean.
  s = plasticity.scores(activity)[0]
  np.testing.assert_allclose(s, activity[0] / activity[0].mean())
  tau = float(np.sort(s)[2])  # the next unit's score: it is dormant at that threshold
  assert plasticity.dormant(activity, tau)[0].sum() == 3
  # The Gram matrix of the last hidden layer's features.
  np.testing.assert_allclose(summed["gram"], h1.T @ h1, rtol=2e-4, atol=1e-5)


def test_scores_dormant_units_and_the_effective_rank_by_definition():
  activity = [np.array([0.0, 1.0, 2.0, 5.0]), np.zeros(3)]
  assert [s.tolist() for s in plasticity.scores(activity)] == [[0.0, 0.5, 1.0, 2.5],
                                                               [0.0, 0.0, 0.0]]
  assert [m.tolist() for m in plasticity.dormant(activity, 0.5)] == [
      [True, True, False, False], [True, True, True]]
  features = np.diag([3.0, 3.0, 0.0, 0.0])  # two equal singular values: rank 2
  assert plasticity.effective_rank(features.T @ features) == pytest.approx(2.0, rel=1e-12)
  features = np.diag([1.0, 1.0, 1.0, 1.0])
  assert plasticity.effective_rank(features.T @ features) == pytest.approx(4.0, rel=1e-12)
  uneven = np.diag([4.0, 1.0])
  p = np.array([0.8, 0.2])
  assert plasticity.effective_rank(uneven.T @ uneven) == pytest.approx(
      np.exp(-np.sum(p * np.log(p))), rel=1e-12)
  assert plasticity.effective_rank(np.zeros((3, 3))) == 0.0


def test_an_ensemble_s_units_are_scored_within_each_member():
  # Two members of two units each, side by side: each unit over its own member's mean.
  assert plasticity.scores([np.array([0.0, 1.0, 10.0, 30.0])], members=2)[0].tolist() == [
      0.0, 2.0, 0.5, 1.5]
  assert plasticity.dormant([np.array([0.0, 1.0, 10.0, 30.0])], 0.5, members=2)[0].tolist() == [
      True, False, True, False]


def test_padding_slots_are_neither_scored_nor_dormant():
  # Three active units and a padding slot: the layer's mean is over the active three.
  activity, active = [np.array([0.0, 2.0, 4.0, 0.0])], [np.array([True, True, True, False])]
  s = plasticity.scores(activity, active=active)[0]
  assert s[:3].tolist() == [0.0, 1.0, 2.0] and np.isnan(s[3])
  assert plasticity.dormant(activity, 0.5, active=active)[0].tolist() == [
      True, False, False, False]


def _ff_in_slots(**stream):
  """Firefly on the MLP with widths (3, 4) in 4 channel slots per layer, unit 0 of its first
  layer silent on every input and the other active units of that layer active on every
  input (as `_dead_mlp`); the padding channel is as `in_slots` made it (zero)."""
  c = helpers.small_config("mnist", "ff", width=4)
  for k, v in stream.items():
    c.stream[k] = v
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, steps = helpers.make_steps(c, ds)
  learner = method.init(jax.random.key(0), (3, 4))
  p = jax.tree.map(np.array, learner.params)
  p["dense0"]["bias"][:3] = 3.0
  p["dense0"]["kernel"][:, 0] = 0.0
  p["dense0"]["bias"][0] = -1.0
  return validation.complete(c), method, steps, ds, learner.replace(
      params=jax.tree.map(jnp.asarray, p))


def test_firefly_s_units_are_its_active_channels_and_its_diagnostics_its_active_parameters():
  _, method, steps, _, learner = _ff_in_slots()
  assert [m.tolist() for m in method.unit_active(learner)] == [[True, True, True, False],
                                                                [True] * 4]
  activity = plasticity.mean_activity(steps.reduce(plasticity.activity_fn(method), learner,
                                                   np.arange(64, dtype=np.int32)))
  assert activity[0][0] == 0.0 and activity[0][3] == 0.0 and np.all(activity[0][1:3] > 0)
  masks = plasticity.dormant(activity, 0.0, active=method.unit_active(learner))
  assert masks[0].tolist() == [True, False, False, False]  # the padding slot is no unit
  # The norms are of the active parameters' values: the learner cut to widths (3, 4).
  exact, _ = firefly.resize_channels(method.layout, learner.params, learner.model_state, (3, 4))
  got = plasticity_diagnostics.active_params(method, learner)
  assert jax.tree.structure(got) == jax.tree.structure(exact)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact)):
    np.testing.assert_array_equal(a, b)
  assert plasticity.param_norm(got) > 0


# -- resets ----------------------------------------------------------------------------------------
def test_redo_redraws_the_dead_units_and_keeps_the_function():
  c, method, steps, ds = _mlp(warm_start="redo", redo_threshold=0.0)
  learner = _dead_mlp(method)
  ctx = helpers.context(2, steps=steps, train_idx=np.arange(64, dtype=np.int32))
  started = policies.make_stage(c).start(method, learner, jax.random.key(7), ctx, None, None)
  after = started.learner
  x = ds.train_x[:32].astype(np.float32) / 255.0
  before_out = method.predict((), learner.params, learner.model_state, x)
  after_out = method.predict((), after.params, after.model_state, x)
  assert np.array_equal(np.asarray(before_out), np.asarray(after_out))  # exactly
  k0 = np.asarray(after.params["dense0"]["kernel"])
  k1 = np.asarray(after.params["dense1"]["kernel"])
  assert np.all(k1[:2] == 0.0)  # outgoing weights of the re-drawn units
  assert np.all(np.abs(k0[:, :2]).sum(0) > 0)  # incoming weights drawn afresh
  np.testing.assert_array_equal(k0[:, 2:], np.asarray(learner.params["dense0"]["kernel"])[:, 2:])
  dead_in_layer1 = int(np.sum(plasticity.mean_activity(steps.reduce(
      plasticity.activity_fn(method), learner, np.arange(64, dtype=np.int32)))[1] == 0.0))
  assert started.fields == {"units_reset": 2 + dead_in_layer1}
  assert started.memo is None
  # The re-drawn units now respond to the data.
  active = plasticity.mean_activity(steps.reduce(plasticity.activity_fn(method), after,
                                                 np.arange(64, dtype=np.int32)))
  assert np.all(active[0][:2] > 0)


def test_redo_on_firefly_redraws_dead_active_channels_and_leaves_the_padding_slots():
  c, method, steps, ds, learner = _ff_in_slots(warm_start="redo", redo_threshold=0.0)
  ctx = helpers.context(1, steps=steps, train_idx=np.arange(64, dtype=np.int32))  # no growth
  started = policies.make_stage(c).start(method, learner, jax.random.key(7), ctx, None, None)
  after = started.learner
  assert after.structure == (3, 4)
  x = ds.train_x[:32].astype(np.float32) / 255.0
  assert np.array_equal(
      np.asarray(method.predict(learner.structure, learner.params, learner.model_state, x)),
      np.asarray(method.predict(after.structure, after.params, after.model_state, x)))
  k0, b0 = np.asarray(after.params["dense0"]["kernel"]), np.asarray(after.params["dense0"]["bias"])
  k1 = np.asarray(after.params["dense1"]["kernel"])
  assert np.abs(k0[:, 0]).sum() > 0 and np.all(k1[0] == 0.0)  # unit 0: fresh in, zero out
  old = jax.tree.map(np.asarray, learner.params)
  np.testing.assert_array_equal(k0[:, 1:], old["dense0"]["kernel"][:, 1:])
  assert np.all(k0[:, 3] == 0.0) and b0[3] == 0.0 and np.all(k1[3] == 0.0)  # padding: as it was
  dead_in_layer1 = int(np.sum(plasticity.mean_activity(steps.reduce(
      plasticity.activity_fn(method), learner, np.arange(64, dtype=np.int32)))[1] == 0.0))
  assert started.fields == {"units_reset": 1 + dead_in_layer1}


def _redo_keeping_the_function(c, method, learner, ctx, x, masks):
  """(the learner after redo's start, its first two kernels): it re-draws the units of `masks`
  (their count in its record) and keeps the predictions on `x` bitwise (they were silent)."""
  started = policies.make_stage(c).start(method, learner, jax.random.key(7), ctx, None, None)
  after = started.learner
  assert started.fields == {"units_reset": int(sum(np.sum(m) for m in masks))}
  out = lambda l: np.asarray(method.predict(l.structure, l.params, l.model_state, x))
  assert np.array_equal(out(learner), out(after))
  return (after, np.asarray(after.params["dense0"]["kernel"]),
          np.asarray(after.params["dense1"]["kernel"]))


@pytest.mark.parametrize("name", ["ens", "umix"])
def test_an_ensemble_s_units_are_its_members_side_by_side_and_redo_resets_them_per_member(name):
  c = helpers.small_config("mnist", name, width=4)
  c.method.num_members = 2
  c.stream.warm_start, c.stream.redo_threshold = "redo", 0.0
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, steps = helpers.make_steps(c, ds)
  c = validation.complete(c)
  learner = helpers.init(method)
  p = jax.tree.map(np.array, learner.params)  # every leaf (2, ...): the members
  p["dense0"]["bias"][:] = 3.0
  p["dense0"]["kernel"][1, :, 0] = 0.0  # member 1's first unit silent on every input
  p["dense0"]["bias"][1, 0] = -1.0
  learner = learner.replace(params=jax.tree.map(jnp.asarray, p))
  member = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  x = ds.train_x[:16].astype(np.float32) / 255.0
  hidden = method.hidden_units(learner.structure, learner.params, learner.model_state, x)
  by_hand = [_hidden_by_hand(member(learner.params, i), x.reshape(16, -1).astype(np.float64))
             for i in range(2)]
  for l in range(2):  # member-major: unit u of member m at m * 4 + u
    assert hidden[l].shape == (16, 8)
    # float32 sums of at most 784 products against float64 (as above).
    np.testing.assert_allclose(hidden[l], np.concatenate([h[l] for h in by_hand], -1),
                               rtol=2e-4, atol=1e-6)
  layout = method.unit_layout()
  np.testing.assert_array_equal(
      plasticity.outgoing_weight(layout, learner.params, 0, members=2),
      np.concatenate([plasticity.outgoing_weight(layout, member(learner.params, i), 0)
                      for i in range(2)]))
  ctx = helpers.context(2, steps=steps, train_idx=np.arange(64, dtype=np.int32))
  masks = plasticity.dormant(plasticity.mean_activity(steps.reduce(
      plasticity.activity_fn(method), learner, ctx.train_idx)), 0.0, members=2)
  assert masks[0].tolist() == [False] * 4 + [True, False, False, False]
  after, k0, k1 = _redo_keeping_the_function(c, method, learner, ctx, x, masks)
  assert np.all(k1[1, 0] == 0.0) and np.abs(k0[1, :, 0]).sum() > 0  # member 1's unit 0
  if not masks[1][:4].any():  # member 0 had nothing to reset: it is untouched
    for a, b in zip(jax.tree.leaves(member(after.params, 0)),
                    jax.tree.leaves(member(learner.params, 0))):
      np.testing.assert_array_equal(a, b)


def test_gens_units_are_its_members_in_slots_and_redo_redraws_only_the_trained_ones():
  c = helpers.small_config("mnist", "gens", width=4)
  c.stream.warm_start, c.stream.redo_threshold = "redo", 0.0
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, steps = helpers.make_steps(c, ds)
  c = validation.complete(c)
  learner = method.init(jax.random.key(0), (3, 1))  # 3 members in 4 slots, the last trained
  p = jax.tree.map(np.array, learner.params)  # every leaf (4, ...): the member slots
  p["dense0"]["bias"][:] = 3.0
  for m, u in ((0, 0), (2, 1)):  # a silent unit in frozen member 0 and in trained member 2
    p["dense0"]["kernel"][m, :, u] = 0.0
    p["dense0"]["bias"][m, u] = -1.0
  learner = learner.replace(params=jax.tree.map(jnp.asarray, p))
  assert [m.tolist() for m in method.unit_active(learner)] == [[True] * 12 + [False] * 4] * 2
  assert [m.tolist() for m in method.unit_trained(learner)] == [
      [False] * 8 + [True] * 4 + [False] * 4] * 2
  member = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  x = ds.train_x[:16].astype(np.float32) / 255.0
  hidden = method.hidden_units(learner.structure, learner.params, learner.model_state, x)
  for l in range(2):  # member-major, every slot's units
    assert hidden[l].shape == (16, 16)
    for i in range(3):  # float32 sums of at most 784 products against float64 (as above)
      np.testing.assert_allclose(
          hidden[l][:, 4 * i:4 * i + 4],
          _hidden_by_hand(member(learner.params, i), x.reshape(16, -1).astype(np.float64))[l],
          rtol=2e-4, atol=1e-6)
  ctx = helpers.context(1, steps=steps, train_idx=np.arange(64, dtype=np.int32))  # no growth
  activity = plasticity.mean_activity(steps.reduce(plasticity.activity_fn(method), learner,
                                                   ctx.train_idx))
  masks = plasticity.dormant(activity, 0.0, method.unit_members_of(learner),
                             method.unit_trained(learner))
  assert masks[0].tolist() == [False] * 9 + [True] + [False] * 6  # member 0's unit 0 is frozen
  after, k0, k1 = _redo_keeping_the_function(c, method, learner, ctx, x, masks)
  assert np.all(k1[2, 1] == 0.0) and np.abs(k0[2, :, 1]).sum() > 0  # member 2's unit 1
  for i in (0, 1, 3):  # the frozen members (member 0's silent unit too) and the padding slot
    for a, b in zip(jax.tree.leaves(member(after.params, i)),
                    jax.tree.leaves(member(learner.params, i))):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "flat"])
def test_gmoe_s_units_are_its_mixtures_channels_and_redo_zeroes_every_reader(tree):
  c = helpers.small_config("mnist", "gmoe", width=4)
  c.method.tree = tree
  c.stream.warm_start, c.stream.redo_threshold = "redo", 0.0
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, steps = helpers.make_steps(c, ds)
  c = validation.complete(c)
  learner = method.init(jax.random.key(0))
  for layer in (0, 1, 1):  # mixture 0: 2 experts; mixture 1: 3 in 4 slots, read by gates
    learner = gmoe.split_expert(learner, layer, 0, jax.random.key(layer + 5))
  p = jax.tree.map(np.array, learner.params)
  e0 = p["mix0"]["experts"]["dense"]
  e0["bias"][:] = 3.0
  e0["kernel"][:, :, 0] = 0.0  # channel 0 of mixture 0: silent in every expert
  e0["bias"][:, 0] = -1.0
  learner = learner.replace(params=jax.tree.map(jnp.asarray, p))
  x = ds.train_x[:16].astype(np.float32) / 255.0
  hidden = method.hidden_units(learner.structure, learner.params, learner.model_state, x)
  assert [h.shape for h in hidden] == [(16, 4), (16, 4)]
  assert np.all(np.asarray(hidden[0])[:, 0] == 0.0) and np.all(np.asarray(hidden[0])[:, 1:] > 0)
  ctx = helpers.context(1, steps=steps, train_idx=np.arange(64, dtype=np.int32))  # no growth
  activity = plasticity.mean_activity(steps.reduce(plasticity.activity_fn(method), learner,
                                                   ctx.train_idx))
  masks = plasticity.dormant(activity, 0.0)
  assert masks[0].tolist() == [True, False, False, False]
  started = policies.make_stage(c).start(method, learner, jax.random.key(7), ctx, None, None)
  after = started.learner
  assert started.fields == {"units_reset": int(sum(np.sum(m) for m in masks))}
  out = lambda l: np.asarray(method.predict(l.structure, l.params, l.model_state, x))
  assert np.array_equal(out(learner), out(after))  # the channel was silent: bitwise the same
  old, new = jax.tree.map(np.asarray, learner.params), jax.tree.map(np.asarray, after.params)
  k = new["mix0"]["experts"]["dense"]["kernel"]
  assert np.all(np.abs(k[:2, :, 0]).sum(1) > 0)  # drawn afresh in both experts
  np.testing.assert_array_equal(k[..., 1:], old["mix0"]["experts"]["dense"]["kernel"][..., 1:])
  gate = "gates" if tree else "gate"
  readers = (new["mix1"]["experts"]["dense"]["kernel"], new["mix1"][gate]["kernel"])
  for r, o in zip(readers, (old["mix1"]["experts"]["dense"]["kernel"], old["mix1"][gate]["kernel"])):
    assert np.all(r[..., 0, :] == 0.0) and np.abs(o[..., 0, :]).sum() > 0  # row 0 read channel 0
  # Continual backprop's utility weighs a channel by its active readers: not the padding slot.
  weight = method.unit_outgoing(learner, 0)
  cut = jax.tree.map(lambda a: np.asarray(a, np.float64),
                     gmoe.active_view(learner).params["mix1"])
  g = cut[gate]["kernel"]  # tree: (gates, features, 2); flat: (features, experts)
  expected = (np.abs(cut["experts"]["dense"]["kernel"]).sum(axis=(0, 2))
              + np.abs(g).sum(axis=tuple(i for i in range(g.ndim) if i != g.ndim - 2)))
  np.testing.assert_allclose(weight, expected, rtol=1e-12)


def test_gmoe_on_the_vgg_exposes_its_stem_its_experts_inner_units_and_its_mixtures_channels():
  c = helpers.small_config("cifar10", "gmoe", width=4)
  c.stream.warm_start, c.stream.redo_threshold = "redo", 0.0
  ds = helpers.synthetic_dataset(n_train=8, n_test=8, shape=(32, 32, 3))
  method, steps = helpers.make_steps(c, ds)
  c = validation.complete(c)
  learner = method.init(jax.random.key(0))
  for layer in (0, 1, 1):  # mixture 0: 2 experts; mixture 1: 3 in 4 slots
    learner = gmoe.split_expert(learner, layer, 0, jax.random.key(layer + 5))
  p, st = (jax.tree.map(np.array, t) for t in (learner.params, learner.model_state))
  for bn in [v for k, v in p["stem"].items() if k.startswith("bn")] + [
      v for l in range(4) for k, v in p[f"mix{l}"]["experts"].items() if k.startswith("bn")]:
    bn["bias"][:] = 3.0  # every channel positive on every input ...
  silent = [(p["stem"]["bn1"], (0,)),  # ... but channel 0 of the stem's output,
            (p["mix1"]["experts"]["bn1"], (1, 2)),  # channel 2 of expert 1's second conv,
            (p["mix0"]["experts"]["bn1"], (slice(None), 1))]  # channel 1 of mixture 0's output
  for bn, at in silent:
    bn["scale"][at], bn["bias"][at] = 0.0, -1.0
  st["batch_stats"]["mix1"]["bn1"]["mean"][1, 2] = 0.7  # a statistic the reset must re-draw
  learner = learner.replace(params=jax.tree.map(jnp.asarray, p),
                            model_state=jax.tree.map(jnp.asarray, st))
  x = ds.train_x[:8].astype(np.float32) / 255.0
  hidden = method.hidden_units(learner.structure, learner.params, learner.model_state, x)
  # stem (2 convs), then per mixture: every slot's inner convs side by side, then its output
  assert [h.shape for h in hidden] == (
      [(8, 32, 32, 4)] * 2 + [(8, 16, 16, 8), (8, 8, 8, 4)] + [(8, 8, 8, 16)] * 3
      + [(8, 4, 4, 4)] + [(8, 4, 4, 4)] * 3 + [(8, 2, 2, 4)] + [(8, 2, 2, 4)] * 3
      + [(8, 1, 1, 4)])
  active = method.unit_active(learner)
  assert active[4].tolist() == [True] * 12 + [False] * 4  # mixture 1's padding slot
  assert all(np.all(a) for l, a in enumerate(active) if l not in (4, 5, 6))
  ctx = helpers.context(1, steps=steps, train_idx=np.arange(8, dtype=np.int32))  # no growth
  activity = plasticity.mean_activity(steps.reduce(plasticity.activity_fn(method), learner,
                                                   ctx.train_idx))
  masks = plasticity.dormant(activity, 0.0, 0, active)
  expected = [np.zeros(len(a), bool) for a in activity]
  expected[1][0] = expected[3][1] = expected[5][1 * 4 + 2] = True
  assert [m.tolist() for m in masks] == [e.tolist() for e in expected]
  started = policies.make_stage(c).start(method, learner, jax.random.key(7), ctx, None, None)
  after = started.learner
  assert started.fields == {"units_reset": 3}
  out = lambda l: np.asarray(method.predict(l.structure, l.params, l.model_state, x))
  assert np.array_equal(out(learner), out(after))  # the units were silent: bitwise the same
  old, new = jax.tree.map(np.asarray, learner.params), jax.tree.map(np.asarray, after.params)
  changed = lambda a, b: not np.array_equal(a, b)
  # incoming weights drawn afresh: the stem's channel 0, expert 1's channel 2 (not expert
  # 0's), channel 1 of mixture 0's last conv in both experts; the others kept
  assert changed(new["stem"]["conv1"]["kernel"][..., 0], old["stem"]["conv1"]["kernel"][..., 0])
  e1, o1 = new["mix1"]["experts"], old["mix1"]["experts"]
  assert changed(e1["conv1"]["kernel"][1, ..., 2], o1["conv1"]["kernel"][1, ..., 2])
  np.testing.assert_array_equal(e1["conv1"]["kernel"][0], o1["conv1"]["kernel"][0])
  assert float(e1["bn1"]["scale"][1, 2]) == 1.0
  assert float(after.model_state["batch_stats"]["mix1"]["bn1"]["mean"][1, 2]) == 0.0
  e0, o0 = new["mix0"]["experts"], old["mix0"]["experts"]
  assert all(changed(e0["conv1"]["kernel"][s, ..., 1], o0["conv1"]["kernel"][s, ..., 1])
             for s in range(2))
  np.testing.assert_array_equal(e0["conv1"]["kernel"][..., 0], o0["conv1"]["kernel"][..., 0])
  # outgoing weights zero: the rows that read a re-drawn channel, at every gate position
  assert np.all(e0["conv0"]["kernel"][..., 0, :] == 0.0)  # the stem's channel 0
  assert np.all(e1["conv2"]["kernel"][1, :, :, 2, :] == 0.0)  # expert 1's own next conv
  np.testing.assert_array_equal(e1["conv2"]["kernel"][0], o1["conv2"]["kernel"][0])
  assert np.all(e1["conv0"]["kernel"][..., 1, :] == 0.0)  # mixture 0's channel 1
  for mix, channel in (("mix0", 0), ("mix1", 1)):  # gates: 4 x 4 positions x 4 channels
    g, o = new[mix]["gates"]["kernel"], old[mix]["gates"]["kernel"]
    rows = np.arange(16) * 4 + channel
    assert g.shape[-2] == 64 and np.all(g[:, rows] == 0.0) and np.abs(o[:, rows]).sum() > 0
    others = np.setdiff1d(np.arange(64), rows)
    np.testing.assert_array_equal(g[:, others], o[:, others])
  # Continual backprop's utility: a slotted unit weighs its own slot's next conv, a
  # mixture's channel the active experts and gates that read it, at every position.
  cut = jax.tree.map(lambda a: np.asarray(a, np.float64), gmoe.active_view(learner).params)
  full = jax.tree.map(lambda a: np.asarray(a, np.float64), learner.params)
  np.testing.assert_allclose(method.unit_outgoing(learner, 5), np.abs(
      full["mix1"]["experts"]["conv2"]["kernel"]).sum(axis=(1, 2, 4)).reshape(-1), rtol=1e-12)
  g = np.abs(cut["mix1"]["gates"]["kernel"]).sum(axis=(0, 2)).reshape(16, 4).sum(0)
  np.testing.assert_allclose(method.unit_outgoing(learner, 3), np.abs(
      cut["mix1"]["experts"]["conv0"]["kernel"]).sum(axis=(0, 1, 2, 4)) + g, rtol=1e-12)


def test_a_reset_on_the_vgg_layout_redraws_channels_and_keeps_the_function():
  method = helpers.cached_method("sm", "cifar10", width=4)
  layout = method.unit_layout()
  learner = helpers.init(method)
  p = jax.tree.map(np.array, learner.params)
  p["block2"]["bn1"]["scale"][1] = 0.0  # channel 1 of the sixth conv: ReLU(-1) = 0 everywhere
  p["block2"]["bn1"]["bias"][1] = -1.0
  learner = learner.replace(params=jax.tree.map(jnp.asarray, p))
  fresh = method.init(jax.random.key(5))
  masks = [np.zeros(4, bool) for _ in layout.kernels]
  masks[5][1] = True  # block2/conv1 (blocks of 2, 2, 4, ... convs)
  after = plasticity.reset_units(layout, learner, fresh, masks)
  x = np.random.default_rng(0).normal(size=(3, 32, 32, 3)).astype(np.float32)
  before_out = method.predict((), learner.params, learner.model_state, x)
  after_out = method.predict((), after.params, after.model_state, x)
  np.testing.assert_array_equal(np.asarray(before_out), np.asarray(after_out))
  assert float(after.params["block2"]["bn1"]["scale"][1]) == 1.0  # fresh BatchNorm
  assert np.all(np.asarray(after.params["block2"]["conv2"]["kernel"])[:, :, 1, :] == 0.0)
  assert not np.array_equal(np.asarray(after.params["block2"]["conv1"]["kernel"])[..., 1],
                            np.asarray(learner.params["block2"]["conv1"]["kernel"])[..., 1])


def test_continual_backprop_chooses_the_least_useful_mature_units():
  utility = np.array([0.5, 0.1, 0.2, 0.05, 0.9])
  age = np.array([3, 3, 0, 1, 3])
  take, carry = continual_backprop.choose(utility, age, carry=0.0, fraction=0.5, maturity=2)
  assert take.tolist() == [False, True, False, False, False]  # 0.5 x 3 mature = 1.5: one
  assert carry == pytest.approx(0.5)
  take, carry = continual_backprop.choose(utility, age, carry=carry, fraction=0.5, maturity=2)
  assert take.tolist() == [True, True, False, False, False]  # 0.5 + 1.5 = 2
  assert carry == pytest.approx(0.0)
  take, _ = continual_backprop.choose(utility, age, carry=0.0, fraction=0.2, maturity=0)
  assert take.tolist() == [False, False, False, True, False]  # every unit mature: 1 of 5


def test_continual_backprop_remembers_the_units_ages():
  c, method, steps, _ = _mlp(warm_start="continual_backprop", cbp_fraction=0.5, cbp_maturity=1)
  policy = policies.make_stage(c)
  learner = helpers.init(method)
  ctx = helpers.context(1, steps=steps, train_idx=np.arange(64, dtype=np.int32))
  first = policy.start(method, learner, jax.random.key(1), ctx, None, None)
  assert first.fields == {"units_reset": 0}  # nothing is mature before the first stage
  assert first.memo == {"age": [[1] * 4, [1] * 4], "carry": [0.0, 0.0]}
  second = policy.start(method, first.learner, jax.random.key(2), ctx, None, first.memo)
  assert second.fields == {"units_reset": 4}  # half of each layer's four mature units
  for l in range(2):
    assert sorted(second.memo["age"][l]) == [1, 1, 2, 2]
  util0 = plasticity.mean_activity(steps.reduce(plasticity.activity_fn(method), learner,
                                                np.arange(64, dtype=np.int32)))[0]
  util0 = util0 * plasticity.outgoing_weight(method.unit_layout(), learner.params, 0)
  replaced = np.asarray(second.memo["age"][0]) == 1
  assert set(np.flatnonzero(replaced)) == set(np.argsort(util0, kind="stable")[:2])


def test_continual_backprop_ages_only_the_trained_units_and_starts_grown_ones_at_zero():
  c = helpers.small_config("mnist", "gens", width=4)
  c.stream.warm_start, c.stream.cbp_fraction, c.stream.cbp_maturity = "continual_backprop", 0.5, 0
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, steps = helpers.make_steps(c, ds)
  c = validation.complete(c)
  learner = method.init(jax.random.key(0), (3, 1))  # 3 members in 4 slots, the last trained
  ctx = helpers.context(1, steps=steps, train_idx=np.arange(64, dtype=np.int32))  # no growth
  # The memory of a learner of 2 members in 2 slots: 2 x 4 units per layer, all of age 5.
  memo = {"age": [[5] * 8, [5] * 8], "carry": [0.0, 0.0]}
  started = policies.make_stage(c).start(method, learner, jax.random.key(1), ctx, None, memo)
  for l in range(2):
    # Frozen members 0 and 1 keep their ages; member 2's units, new, trained once; padding 0.
    assert started.memo["age"][l] == [5] * 8 + [1] * 4 + [0] * 4
  assert started.fields == {"units_reset": 4}  # half of the trained member's 4 units, per layer
  member = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  for i in (0, 1, 3):  # nothing but the trained member's units was re-drawn
    for a, b in zip(jax.tree.leaves(member(started.learner.params, i)),
                    jax.tree.leaves(member(learner.params, i))):
      np.testing.assert_array_equal(a, b)


# -- theta_0 after growth ---------------------------------------------------------------------------
def test_theta_0_of_a_grown_learner_keeps_initial_values_and_draws_what_growth_added():
  c = helpers.small_config("mnist", "gmoe", width=4)
  method, _ = helpers.make_steps(c, helpers.synthetic_dataset(n_train=64, n_test=16))
  initial = method.init(jax.random.key(0))  # one expert per mixture, in one slot
  trained = initial.replace(params=jax.tree.map(lambda a: a + 1.0, initial.params))
  assert plasticity_diagnostics.initial_values(method, initial, trained, trained) is initial
  grown = gmoe.split_expert(gmoe.split_expert(trained, 0, 0, jax.random.key(1)), 0, 1,
                            jax.random.key(2))  # mixture 0: 3 experts in 4 slots, 2 gates
  p = jax.tree.map(np.array, grown.params)
  for leaf in jax.tree.leaves(p["mix0"]["experts"]):
    leaf[3] = 5.0  # the padding slot: values the network does not use
  grown = grown.replace(params=p)
  fresh = method.init(jax.random.key(3), grown.structure)
  got = plasticity_diagnostics.initial_values(method, initial, fresh, grown).params
  assert jax.tree.structure(got) == jax.tree.structure(grown.params)
  for name in ("head", "mix1"):  # not grown: the initial values
    for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(initial.params[name])):
      np.testing.assert_array_equal(a, b)
  for a, b, f, g in zip(*(jax.tree.leaves(t["mix0"]["experts"])
                          for t in (got, initial.params, fresh.params, grown.params))):
    np.testing.assert_array_equal(a[0], b[0])  # the initial expert
    np.testing.assert_array_equal(a[1:3], f[1:3])  # the two that growth added
    np.testing.assert_array_equal(a[3], g[3])  # padding: the learner's own, no pull
    assert np.all(a[3] == 5.0)
  for a, f in zip(jax.tree.leaves(got["mix0"]["gates"]),
                  jax.tree.leaves(fresh.params["mix0"]["gates"])):
    np.testing.assert_array_equal(a[:2], f[:2])  # both gates are new (slot 2 pads: 3 slots)


def test_theta_0_of_a_wider_firefly_learner_follows_its_channels():
  c = helpers.small_config("mnist", "ff", width=4)
  method, _ = helpers.make_steps(c, helpers.synthetic_dataset(n_train=64, n_test=16))
  initial = method.init(jax.random.key(0), (2, 4))  # widths (2, 4) in 4 channel slots
  grown = method.init(jax.random.key(1), (3, 4))  # a third channel in layer 0
  grown = grown.replace(params=jax.tree.map(lambda a: np.asarray(a) + 1.0, grown.params))
  fresh = method.init(jax.random.key(2), (3, 4))
  got = plasticity_diagnostics.initial_values(method, initial, fresh, grown).params
  i, f, g = initial.params, fresh.params, grown.params
  for name in ("kernel", "bias"):  # layer 0: channels 0-1 initial, 2 added, 3 padding
    for cut, source in (((Ellipsis, slice(0, 2)), i), ((Ellipsis, slice(2, 3)), f),
                        ((Ellipsis, slice(3, 4)), g)):
      np.testing.assert_array_equal(got["dense0"][name][cut], source["dense0"][name][cut])
  k = got["dense1"]["kernel"]  # layer 1 reads channel 2 through a row that growth added
  np.testing.assert_array_equal(k[:2], i["dense1"]["kernel"][:2])
  np.testing.assert_array_equal(k[2], f["dense1"]["kernel"][2])
  np.testing.assert_array_equal(k[3], g["dense1"]["kernel"][3])
  np.testing.assert_array_equal(got["head"]["kernel"], i["head"]["kernel"])


# -- config checks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method, fields, message", [
    ("tiny_shakespeare/gmoe", {"stream.warm_start": "redo"},
     r"config\.stream\.warm_start='redo' re-draws hidden units, which method 'gmoe' on backbone "
     r"'switch' does not expose; valid: config\.method\.name in \['ens', 'ff', 'gens', 'sm', "
     r"'umix'\] with config\.model\.name in \['mlp', 'vgg'\], or in \['gmoe'\] with "
     r"config\.model\.name in \['mlp', 'vgg'\]"),
    ("tiny_shakespeare/gmoe", {"stream.warm_start": "continual_backprop"},
     r"config\.stream\.warm_start='continual_backprop' re-draws hidden units, which method "
     r"'gmoe' on backbone 'switch' does not expose"),
    ("sm", {"stream.warm_start": "continual_backprop", "train.keep_optimizer_state": True},
     r"config\.train\.keep_optimizer_state=True is not supported by config\.stream\.warm_start="
     r"'continual_backprop'.*allowed values: \[False\]"),
    ("sm", {"stream.cbp_fraction": 0.2},
     r"config\.stream\.cbp_fraction=0\.2 and config\.stream\.cbp_maturity=2 are used only by "
     r"config\.stream\.warm_start='continual_backprop', not 'finetune'"),
    ("sm", {"train.l2_init": 0.1, "stream.warm_start": "redo"},
     r"config\.train\.l2_init=0\.1 is used only by config\.stream\.warm_start='l2_init', not "
     r"'redo'"),
    ("sm", {"stream.warm_start": "redo", "stream.redo_threshold": 1.5},
     r"config\.stream\.redo_threshold"),
])
def test_the_policies_refuse_what_they_cannot_serve(method, fields, message):
  dataset, method = method.split("/") if "/" in method else ("mnist", method)
  c = helpers.small_config(dataset, method)
  for path, value in fields.items():
    section, name = path.split(".")
    c[section][name] = value
  with pytest.raises(ConfigError, match=message):
    validation.validate(c)


# -- whole runs ------------------------------------------------------------------------------------
@requires_mnist
def test_the_records_carry_the_diagnostics_and_the_summary_their_last_values(tmp_path, caplog):
  wd = str(tmp_path / "wd")
  with caplog.at_level(logging.INFO):
    run.run(helpers.smoke(log__plasticity=True, stream__wait=2), wd)
  log = io_utils.read_jsonl(f"{wd}/log.jsonl")
  # The full progress line of each stage shows the first seed's diagnostics.
  last = log[-1]
  line = (f"dormant_fraction={last['dormant_fraction']:.3g} feature_rank="
          f"{last['feature_rank']:.3g} param_norm={last['param_norm']:.3g} init_distance="
          f"{last['init_distance']:.3g}")
  assert re.search(rf"t=4/4 \(100%\) epochs=.* {re.escape(line)}", caplog.text), caplog.text[-2000:]
  keys = {"param_norm", "init_distance", "dormant_fraction", "dormant_fraction_0",
          "dormant_fraction_1", "feature_rank"}
  assert all(keys <= set(r) for r in log)
  assert log[0]["init_distance"] == 0.0  # the untrained learner is its initialisation
  for r, previous in zip(log[1:], log):
    same = [r[k] == previous[k] for k in keys]
    assert all(same) if not r["trained"] else not all(same)  # measured when it changed
  assert all(0.0 <= r["dormant_fraction"] <= 1.0 and 1.0 <= r["feature_rank"] <= 8.0
             for r in log)
  summary = io_utils.read_json(f"{wd}/summary.json")
  assert summary["final_dormant_fraction"] == log[-1]["dormant_fraction"]
  assert summary["final_feature_rank"] == log[-1]["feature_rank"]
  assert summary["comp"] == sum(r["train_flops"] for r in log)  # the probe is not compute


@requires_mnist
def test_an_ensemble_run_records_its_members_units_and_resets_them(tmp_path):
  wd = str(tmp_path / "wd")
  run.run(helpers.smoke("ens", method__num_members=2, log__plasticity=True,
                        stream__warm_start="redo", stream__redo_threshold=0.5), wd)
  log = io_utils.read_jsonl(f"{wd}/log.jsonl")
  assert all({"dormant_fraction", "dormant_fraction_0", "feature_rank"} <= set(r) for r in log)
  # The smoke MLP has 2 x 8 units per layer: the features of both members, side by side.
  assert all(1.0 <= r["feature_rank"] <= 16.0 for r in log)
  assert sum(r["units_reset"] for r in log if r["trained"]) > 0


@requires_mnist
@pytest.mark.parametrize("method, warm_start", [
    ("ff", "redo"), ("gens", "redo"), ("ff", "continual_backprop"),
    ("gens", "continual_backprop"), ("gmoe", "redo"), ("gmoe", "continual_backprop")])
def test_runs_in_slots_record_the_norms_of_their_active_parameters(method, warm_start, tmp_path):
  # A learner in slots reports its parameters' values, not the zeros of a view of shapes.
  wd = str(tmp_path / "wd")
  run.run(helpers.smoke(method, log__plasticity=True, stream__warm_start=warm_start,
                        stream__num_megabatches=3), wd)  # t=2 trains a grown learner
  log = io_utils.read_jsonl(f"{wd}/log.jsonl")
  assert all(r["param_norm"] > 0 for r in log)
  assert log[1]["init_distance"] > 0  # trained once, the structure unchanged since t=0
  # hidden units over the active channels or members only, a mixture's channels
  assert all(0.0 <= r["dormant_fraction"] <= 1.0 and r["feature_rank"] > 0 for r in log)
  assert all("units_reset" in r for r in log if r["trained"])


@requires_mnist
@pytest.mark.parametrize("method", ["sm", "gmoe"])
def test_l2_init_at_coefficient_0_is_finetune_exactly_and_above_it_pulls_toward_the_start(
    method, tmp_path):
  finetune, zero, pulled = (str(tmp_path / n) for n in ("finetune", "zero", "pulled"))
  run.run(helpers.smoke(method, log__plasticity=True), finetune)
  run.run(helpers.smoke(method, log__plasticity=True, stream__warm_start="l2_init"), zero)
  assert helpers.outputs(zero) == helpers.outputs(finetune)
  run.run(helpers.smoke(method, log__plasticity=True, stream__warm_start="l2_init",
                        train__l2_init=0.05), pulled)
  free, held = io_utils.read_jsonl(f"{finetune}/log.jsonl"), io_utils.read_jsonl(
      f"{pulled}/log.jsonl")
  if method != "sm":  # the last stage trains a grown learner: theta_0 follows its structure
    assert free[-1]["num_params"] > free[0]["num_params"]
  assert held[-1]["init_distance"] < free[-1]["init_distance"]
  # Its term's arithmetic counts in the train step's FLOPs.
  assert held[1]["train_flops"] > free[1]["train_flops"]


@requires_mnist
@pytest.mark.parametrize("fields", [
    {"stream__warm_start": "redo", "stream__redo_threshold": 0.5},
    {"stream__warm_start": "continual_backprop", "stream__cbp_fraction": 0.3,
     "stream__cbp_maturity": 1},
    {"stream__warm_start": "l2_init", "train__l2_init": 0.05},
    {"method": "ff", "stream__warm_start": "continual_backprop", "stream__cbp_fraction": 0.3,
     "stream__cbp_maturity": 1},
    {"method": "gmoe", "stream__warm_start": "l2_init", "train__l2_init": 0.05},
    {"method": "gmoe", "stream__warm_start": "continual_backprop", "stream__cbp_fraction": 0.3,
     "stream__cbp_maturity": 1},
], ids=["redo", "continual_backprop", "l2_init", "continual_backprop_ff", "l2_init_gmoe",
        "continual_backprop_gmoe"])
def test_the_policies_resume_to_identical_records(fields, tmp_path, monkeypatch):
  fields = dict(fields)  # Firefly grows: its units' ages outlive a change of their count
  config = helpers.smoke(fields.pop("method", "sm"), train__progress_every_s=0.0,
                         log__plasticity=True, **fields)
  base = str(tmp_path / "uninterrupted")
  run.run(config, base)
  expected = helpers.outputs(base)
  if fields["stream__warm_start"] != "l2_init":  # the policy acted
    assert sum(r["units_reset"] for r in expected[0] if r["trained"]) > 0, expected[0]
  wd = str(tmp_path / "interrupted")
  # After the second step's record (the policy's memory is in its checkpoint), then inside
  # the last stage (its save continues it).
  helpers.interrupt(config, wd, "t=2:log", monkeypatch)
  helpers.interrupt(config, wd, f"t={expected[0][-1]['t']}:epoch", monkeypatch)
  run.run(config, wd)
  assert helpers.outputs(wd) == expected
