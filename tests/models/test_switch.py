"""Tests of the Switch Transformer (alma_jax/models/switch.py) and of copying its experts
(gMoE on its own expert layers: alma_jax/methods/expert_growth.py)."""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.engine import accounting
from alma_jax.engine import sharding
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods import gmoe
from alma_jax.outputs import workdir
from alma_jax.stream import validation
from alma_jax.models import switch
from alma_jax.tasks import base as task_base
from alma_jax.tasks import text as text_task
from tests import helpers

V = 50257  # GPT-2's vocabulary
SMALL_V = 512  # where the vocabulary's size plays no part: smaller programs


def tiny(num_experts=4, eval_capacity_factor=0.0, max_len=16, vocab=SMALL_V, **kw):
  return switch.SwitchTransformer(vocab_size=vocab, max_len=max_len, num_layers=2, dim=32,
                                  num_heads=2, ffn_dim=48, num_experts=num_experts,
                                  eval_capacity_factor=eval_capacity_factor, **kw)


def test_capacity_is_respected_and_dropped_tokens_get_zero():
  t, e, d = 12, 3, 5
  ffn = switch.SwitchFFN(num_experts=e, ffn_dim=7, capacity_factor=1.0)
  x = jax.random.normal(jax.random.key(0), (1, t, d))
  mask = jnp.ones((1, t), bool)
  params = ffn.init(jax.random.key(1), x, mask, True)["params"]
  # Send every token to expert 1: its capacity ceil(1.0 * 12 / 3) = 4 keeps the first 4.
  params = {**params, "router_bias": jnp.asarray([0.0, 50.0, 0.0])}
  y, _, experts = ffn.apply({"params": params}, x, mask, True)
  cap = switch.capacity(t, e, 1.0)
  assert cap == 4
  np.testing.assert_array_equal(experts[0], np.ones(t))
  y = np.asarray(y[0])
  assert np.all(np.abs(y[:cap]).sum(-1) > 0)
  # Dropped tokens: the layer adds exactly zero, so the block's residual passes them unchanged.
  np.testing.assert_array_equal(y[cap:], 0.0)


def test_route_keeps_at_most_capacity_tokens_per_expert_in_order():
  logits = jax.random.normal(jax.random.key(2), (40, 4)) * 3.0
  mask = jnp.arange(40) % 7 != 0  # masked tokens take no slot
  r = switch.route(logits, mask, cap=6)
  kept, expert, pos = map(np.asarray, (r.kept, r.expert, r.position))
  for e in range(4):
    mine = np.flatnonzero((expert == e) & np.asarray(mask))
    np.testing.assert_array_equal(pos[mine], np.arange(len(mine)))  # slots in token order
    np.testing.assert_array_equal(kept[mine], np.arange(len(mine)) < 6)
  assert not kept[~np.asarray(mask)].any()


def test_balance_loss_is_one_for_uniform_routing():
  t, e = 32, 4
  probs = jnp.full((t, e), 1.0 / e)
  r = switch.Routing(probs, jnp.arange(t) % e, jnp.zeros(t, jnp.int32), jnp.ones(t, bool),
                     jnp.ones(t))
  # E * sum_e (1/E) * (1/E) = 1
  np.testing.assert_allclose(switch.balance_loss(r, jnp.ones(t, bool)), 1.0, rtol=1e-6)
  # Equal router logits: every probability is 1/E; ties go to expert 0 (f_0 = 1): also 1.
  r = switch.route(jnp.zeros((t, e)), jnp.ones(t, bool), t)
  np.testing.assert_allclose(switch.balance_loss(r, jnp.ones(t, bool)), 1.0, rtol=1e-6)


def test_balance_loss_is_num_experts_for_one_hot_routing():
  t, e = 32, 4
  logits = jnp.zeros((t, e)).at[:, 2].set(200.0)  # probability 1 (in float32) for expert 2
  mask = jnp.arange(t) < 20
  # Masked tokens do not count, whatever their routing.
  logits = jnp.where(mask[:, None], logits, jnp.zeros((t, e)).at[:, 0].set(200.0))
  r = switch.route(logits, mask, t)
  np.testing.assert_allclose(switch.balance_loss(r, mask), float(e), rtol=1e-6)


def test_causal_mask_a_future_token_does_not_change_earlier_logits():
  # One sequence: a binding capacity fills the experts in token order, so a later token cannot
  # take an earlier one's place (across sequences of a batch it can: they share the capacity).
  model = tiny(eval_capacity_factor=1.0)
  tokens = jax.random.randint(jax.random.key(3), (1, 16), 0, SMALL_V)
  params = jax.jit(model.init)(jax.random.key(4), tokens)["params"]
  j = 9
  changed = tokens.at[:, j].set((tokens[:, j] + 123) % SMALL_V)
  apply = jax.jit(model.apply)
  a, _ = apply({"params": params}, tokens)
  b, _ = apply({"params": params}, changed)
  chex.assert_trees_all_close(a[:, :j], b[:, :j], atol=1e-6, rtol=0)
  assert float(jnp.max(jnp.abs(a[:, j:] - b[:, j:]))) > 1e-3


def test_untrained_perplexity_is_near_the_vocabulary_size():
  # Logits are h . e_v with LayerNorm'd h (unit variance per dimension) and N(0, 0.02^2)
  # embeddings: i.i.d. N(0, s^2), s^2 = 0.02^2 * d. The expected NLL of a random target is
  # then about log V + s^2 / 2 (= log V + 0.0064 for d = 32); 0.05 leaves room for sampling.
  model = tiny(vocab=V)
  tokens = jax.random.randint(jax.random.key(5), (4, 16), 0, V)
  params = jax.jit(model.init)(jax.random.key(6), tokens)["params"]
  logits, _ = jax.jit(model.apply)({"params": params}, tokens[:, :-1])
  nll = float(task_base.masked_cross_entropy(logits, tokens[:, 1:], jnp.ones(4, bool)))
  assert abs(nll - math.log(V)) < 0.05, (nll, math.log(V))


def test_capacity_limit():
  assert switch.capacity(100, 4, 1.0) == 25
  assert switch.capacity(10, 4, 1.0) == 3
  assert switch.capacity(10, 4, 0.0) == 10  # no limit
  assert switch.capacity(10, 4, 8.0) == 10


def gmoe_method(noise=0.0, scan_layers=True, ffn_dim=48, slots="exact"):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_gmoe"), "smoke")
  c.model.eval_capacity_factor = 0.0
  c.model.scan_layers = scan_layers
  c.model.dim, c.model.ffn_dim = 32, ffn_dim
  c.method.router_noise = noise
  c.method.slots = slots
  method = methods.make(c, (16,), SMALL_V)
  assert isinstance(method, gmoe.GrowingMoE) and method.own is not None
  return method


def unrolled(params):
  return switch.unstack_layers(params) if switch.LAYERS in params else params


def predict(method, learner, tokens):
  """The learner's predictions, through the program of its structure (slots or not)."""
  return jax.jit(method.predict, static_argnums=0)(
      method.program_structure(learner.structure), learner.params, learner.model_state, tokens)


@pytest.mark.parametrize("slots, held", [("exact", 6), ("pow2", 8)])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_copy_experts_leaves_the_outputs_unchanged_without_perturbation_or_capacity_limit(
    scan_layers, slots, held):
  method = gmoe_method(scan_layers=scan_layers, slots=slots)
  learner = method.init(jax.random.key(7))
  assert (switch.LAYERS in learner.params) == scan_layers
  tokens = jax.random.randint(jax.random.key(8), (3, 16), 0, SMALL_V)
  before = predict(method, learner, tokens)
  grown = method.own.copy(learner, [[1, 3], [0, 2]], jax.random.key(9))
  assert grown.structure == (6,)
  moe0 = unrolled(grown.params)["block0"]["moe"]
  chex.assert_shape(moe0["expert_wi"], (held, 32, 48))
  chex.assert_shape(moe0["router_kernel"], (32, held))
  np.testing.assert_array_equal(moe0["expert_wo"][4],
                                unrolled(learner.params)["block0"]["moe"]["expert_wo"][1])
  np.testing.assert_array_equal(moe0["expert_wi"][6:], 0.0)  # padding slots, if any
  after = predict(method, grown, tokens)
  chex.assert_trees_all_close(before, after, atol=1e-5, rtol=0)
  # The input is not modified, and the number of parameters grows by 2 experts x 2 blocks.
  assert learner.structure == (4,)
  per_expert = 32 * 48 + 48 + 48 * 32 + 32 + 32 + 1  # weights, biases, router column and bias
  assert method.num_params(grown) == method.num_params(learner) + 2 * 2 * per_expert


def _ffn_and_copy(router_bias, kernel_scale=1.0):
  """A 4-expert layer at the default capacity factors, its params (router kernel scaled by
  `kernel_scale`), and the params after copying experts 0 and 2 (`copy_experts`), on 64
  tokens."""
  fields = {f.path: f.default for f in text_task.TextTask.FIELDS}
  ffn = switch.SwitchFFN(num_experts=4, ffn_dim=24)
  assert (ffn.capacity_factor, ffn.eval_capacity_factor) == (
      fields["model.capacity_factor"], fields["model.eval_capacity_factor"])
  x = jax.random.normal(jax.random.key(0), (1, 64, 16))
  mask = jnp.ones((1, 64), bool)
  params = ffn.init(jax.random.key(1), x, mask, True)["params"]
  params = {**params, "router_bias": jnp.asarray(router_bias, jnp.float32),
            "router_kernel": kernel_scale * params["router_kernel"]}
  grown = switch.copy_experts({"block0": {"moe": params}}, [0, 2], jax.random.key(2))
  return ffn, x, mask, params, grown["block0"]["moe"]


@pytest.mark.parametrize("train, factor", [(True, 1.0), (False, 2.0)])
def test_at_the_default_capacity_a_copy_drops_the_tokens_beyond_the_smaller_capacity(
    train, factor):
  # Every token prefers expert 1, which is not copied: its capacity ceil(f * 64 / E) shrinks
  # from E = 4 to E = 6, and the tokens beyond it are dropped (the layer adds zero for them).
  ffn, x, mask, params, grown = _ffn_and_copy([0.0, 2.0, 0.0, 0.0])
  y4, _, e4 = ffn.apply({"params": params}, x, mask, train)
  y6, _, e6 = ffn.clone(num_experts=6).apply({"params": grown}, x, mask, train)
  np.testing.assert_array_equal(e4, e6)  # the routing is kept ...
  y4, y6 = np.asarray(y4[0]), np.asarray(y6[0])
  kept4, kept6 = np.abs(y4).sum(-1) > 0, np.abs(y6).sum(-1) > 0
  assert int(np.sum(np.asarray(e4) == 1)) == 64
  cap4, cap6 = switch.capacity(64, 4, factor), switch.capacity(64, 6, factor)
  assert (kept4.sum(), kept6.sum()) == (cap4, cap6) and cap6 < cap4  # ... the capacity is not
  assert not np.any(kept6 & ~kept4)
  np.testing.assert_array_equal(y6[kept4 & ~kept6], 0.0)
  # The tokens kept by both get the same output: the same expert weights and, up to float32
  # rounding of the softmax (relative 1e-6 on outputs of magnitude < 1), the same gate.
  np.testing.assert_allclose(y6[kept6], y4[kept6], atol=1e-5, rtol=0)


@pytest.mark.parametrize("step", [1e-6, 1e-3])
def test_the_first_step_that_separates_a_copied_pair_halves_its_tokens_output(step):
  # The tied pair counts as one expert only while its router logits are exactly equal; any
  # update that moves them apart gives each member its own probability, half the pair's. A
  # confident router (logits far apart: a scaled kernel) keeps the pair's tokens on the pair;
  # a less confident one can also send them to another expert.
  ffn, x, mask, _, grown = _ffn_and_copy([0.0, 0.0, 0.0, 0.0], kernel_scale=50.0)
  ffn6 = ffn.clone(num_experts=6, eval_capacity_factor=0.0)  # no token dropped: routing alone
  tied, _, e_tied = ffn6.apply({"params": grown}, x, mask, False)
  moved = {**grown, "router_bias": grown["router_bias"].at[4].add(step)}  # copy of expert 0
  apart, _, e_apart = ffn6.apply({"params": moved}, x, mask, False)
  e_tied, e_apart = np.asarray(e_tied[0]), np.asarray(e_apart[0])
  pair = (e_tied == 0) & (e_apart == 4)  # the pair's tokens that stay on it (all but one)
  assert pair.sum() >= 10 and np.all(e_apart[e_tied != 0] == e_tied[e_tied != 0])
  # The gate goes from the pair's probability 2p to p * exp(step) / (1 + p (exp(step) - 1)):
  # a relative change of 1/2 up to about `step`, plus float32 rounding (1e-6).
  np.testing.assert_allclose(np.asarray(apart[0])[pair], 0.5 * np.asarray(tied[0])[pair],
                             rtol=2 * step + 1e-5, atol=1e-7)
  others = e_tied != 0
  np.testing.assert_allclose(np.asarray(apart[0])[others], np.asarray(tied[0])[others],
                             rtol=0, atol=1e-5)


def test_one_adam_step_after_a_copy_ends_the_tie_wherever_it_moves_the_logits_apart(
    monkeypatch):
  ffn, x, mask, _, grown = _ffn_and_copy([0.0, 0.0, 0.0, 0.0], kernel_scale=50.0)
  ffn6 = ffn.clone(num_experts=6, eval_capacity_factor=0.0)
  target = jax.random.normal(jax.random.key(5), x.shape)
  loss = lambda p: jnp.sum(ffn6.apply({"params": p}, x, mask, True)[0] * target)
  tied, _, e_tied = ffn6.apply({"params": grown}, x, mask, False)
  tx = optax.adam(1e-7)
  updates, _ = tx.update(jax.grad(loss)(grown), tx.init(grown), grown)
  stepped = optax.apply_updates(grown, updates)
  # The pair's router biases get gradients of opposite sign (the gate is the first member's
  # probability times 2), so Adam's first step, +-1e-7 per parameter, separates them.
  assert float(stepped["router_bias"][0]) != float(stepped["router_bias"][4])
  seen = []  # the router logits the layer computes (eagerly, so a patched `route` sees them)
  route = switch.route
  monkeypatch.setattr(switch, "route", lambda logits, *a: seen.append(logits) or route(logits, *a))
  after, _, e_after = ffn6.apply({"params": stepped}, x, mask, False)
  logits, e_after = np.asarray(seen[-1]), np.asarray(e_after[0])
  pair = np.asarray(e_tied[0]) == 0
  ratio = (np.linalg.norm(np.asarray(after[0]), axis=-1)
           / np.linalg.norm(np.asarray(tied[0]), axis=-1))
  # The step moves a pair token's two logits apart by about 1e-7 x its input's 16 entries:
  # where that is below the float32 rounding of logits of size ~5 (half an ulp, 2.4e-7),
  # the two stay equal and the pair still acts as one expert; which tokens do depends on the
  # order of the sums (it differs between CPUs). Every token whose logits separated takes
  # one member's probability as its gate, about half the pair's: its output halves, a change
  # of order 1. Both ratios hold up to the step's own changes (1e-7 per weight, the members'
  # probabilities differing by ~1e-6): within 1e-4.
  apart = pair & (logits[:, 0] != logits[:, 4]) & np.isin(e_after, [0, 4])
  still = pair & (logits[:, 0] == logits[:, 4])
  assert np.any(e_after[apart] == 4), (apart, e_after)  # the tie ended for some
  np.testing.assert_allclose(ratio[apart], 0.5, atol=1e-4)
  np.testing.assert_allclose(ratio[still], 1.0, atol=1e-4)
  assert np.all(e_after[still] == 0)  # the first member of a tie


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_experts_in_slots_compute_the_exact_layer_under_a_binding_capacity(train):
  """6 experts in 8 slots (a buffer sized for 5, as pow2's slots of 5 to 8 experts) against
  the 6-expert layer: the same routing, outputs, balance loss and gradients; the padding
  slots, filled with other weights, take no token and get no gradient. The arithmetic is the
  same but for sums over 8 slots instead of 6 (the softmax's and the balance loss's), whose
  added terms are exact zeros: float32 round-off of a few ulps."""
  ffn6 = switch.SwitchFFN(num_experts=6, ffn_dim=24)
  ffn8 = switch.SwitchFFN(num_experts=8, ffn_dim=24, min_experts=5)
  x = jax.random.normal(jax.random.key(0), (1, 64, 16))
  mask = jnp.ones((1, 64), bool)
  p6 = ffn6.init(jax.random.key(1), x, mask, True)["params"]
  p6 = {**p6, "router_bias": jnp.asarray([0.0, 1.5, 0.0, 0.0, 0.0, 0.0])}  # expert 1 overflows
  others = ffn8.init(jax.random.key(2), x, mask, True)["params"]
  p8 = switch.resize_experts({"block0": {"moe": p6}}, 8)["block0"]["moe"]
  p8 = {k: v.at[6:].set(others[k][6:]) if k.startswith("expert_") else v
        for k, v in p8.items()}  # padding slots that would change the output if used
  p8["router_kernel"] = p8["router_kernel"].at[:, 6:].set(others["router_kernel"][:, 6:])
  target = jax.random.normal(jax.random.key(3), x.shape)

  def run(ffn, params, *active):
    def loss(p):
      y, balance, experts = ffn.apply({"params": p}, x, mask, train, *active)
      return jnp.sum(y * target) + balance, (y, balance, experts)
    return jax.jit(jax.grad(loss, has_aux=True))(params)

  g6, (y6, b6, e6) = run(ffn6, p6)
  g8, (y8, b8, e8) = run(ffn8, p8, jnp.int32(6))
  np.testing.assert_array_equal(e8, e6)
  cap = switch.capacity(64, 6, 1.0 if train else 2.0)
  dropped = np.abs(np.asarray(y6[0])).sum(-1) == 0
  assert dropped.sum() == int(np.sum(np.asarray(e6) == 1)) - cap > 0  # the capacity binds
  np.testing.assert_allclose(y8, y6, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(b8, b6, rtol=1e-6)
  for k in p6:
    cut = g8[k][..., :6] if k.startswith("router") else g8[k][:6]
    np.testing.assert_allclose(cut, g6[k], rtol=1e-5, atol=1e-7, err_msg=k)
    pad = g8[k][..., 6:] if k.startswith("router") else g8[k][6:]
    np.testing.assert_array_equal(pad, 0.0, err_msg=k)


def test_copy_experts_with_a_perturbation_changes_the_routing():
  method = gmoe_method()
  learner = method.init(jax.random.key(7))
  tokens = jax.random.randint(jax.random.key(8), (3, 16), 0, SMALL_V)
  before = predict(method, learner, tokens)
  grown = method.own.copy(learner, [0, 1], jax.random.key(9), noise=0.5)
  after = predict(method, grown, tokens)
  assert float(jnp.max(jnp.abs(before - after))) > 1e-4


def test_copies_of_other_experts_of_the_same_model_run_one_compiled_program():
  """The experts to copy and the key are arguments: the first copy compiles one program (no
  eager operations; in slots it also sets the count of active experts), copies of other
  experts or with another key reuse it. Scanned in slots and unrolled without."""
  names = helpers.compiled_in_a_new_process("""
      from alma_jax.models import switch
      from tests.models import test_switch
      models = [test_switch.gmoe_method(scan_layers=scan, slots=slots)
                for scan, slots in ((True, "pow2"), (False, "exact"))]
      learners = [m.init(jax.random.key(0)) for m in models]
      assert [m.own.has_slots(l) for m, l in zip(models, learners)] == [True, False]
      keys = [jax.random.key(k) for k in range(3)]
  """, """
      for method, learner in zip(models, learners):
        for experts, key in zip(([[1, 3], [0, 2]], [[0, 1], [2, 3]], [3, 2]), keys):
          grown = method.own.copy(learner, experts, key)
        assert grown.structure == (6,)
        if method.own.has_slots(grown):
          assert int(grown.model_state[switch.ROUTING][switch.ACTIVE]) == 6
  """)
  assert names == ["jit(_copied)"] * 2, names


def test_copy_experts_rejects_bad_indices():
  method = gmoe_method()
  learner = method.init(jax.random.key(0))
  with pytest.raises(ValueError, match="distinct indices"):
    method.own.copy(learner, [1, 1], jax.random.key(0))
  with pytest.raises(ValueError, match="distinct indices"):
    switch.copy_experts(learner.params, [4], jax.random.key(0))


def test_expert_losses_sum_the_nll_routed_to_each_expert():
  experts = jnp.asarray([[[0, 1, 1], [2, 0, 0]]])  # 1 block, b=2, L=3
  nll = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  out = switch.expert_losses(experts, nll, jnp.asarray([True, False]), 3)
  np.testing.assert_allclose(out, [[1.0, 5.0, 0.0]])


def _param_count(preset, num_experts):
  """Parameters of the built Switch Transformer of `preset` with GPT-2's vocabulary and
  sequences of 512 tokens (the paper's), counted from shapes alone."""
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"), preset)
  c.model.num_experts = num_experts
  model = switch.SwitchTransformer.from_config(c.model, V, max_len=512)
  shapes = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 512), jnp.int32)),
                          jax.random.key(0))
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes["params"]))


# The paper's Table 2 (appendix D): parameters of SM with E experts per block.
TABLE_2 = {"base": {4: 65e6, 8: 91e6, 12: 116e6}, "large": {4: 210e6, 8: 323e6, 12: 436e6}}


@pytest.mark.parametrize("preset", ["base", "large"])
def test_the_presets_have_the_paper_s_parameter_counts_within_3_percent(preset):
  counts = {e: _param_count(preset, e) for e in (4, 8, 12)}
  for e, paper in TABLE_2[preset].items():
    assert abs(counts[e] / paper - 1) < 0.03, (preset, e, counts[e], paper)
  # Per expert and shared, as fitted to the table: (116 - 65) / 8 = 6.375M and 65 - 4 x 6.375
  # = 39.5M (the text rounds them to 6M and 40M); (436 - 210) / 8 = 28.25M and 97M (28M, 96M).
  table = TABLE_2[preset]
  per_expert = (counts[12] - counts[4]) / 8
  paper_per_expert = (table[12] - table[4]) / 8
  assert abs(per_expert / paper_per_expert - 1) < 0.03, (per_expert, paper_per_expert)
  shared = counts[4] - 4 * per_expert
  paper_shared = table[4] - 4 * paper_per_expert
  assert abs(shared / paper_shared - 1) < 0.03, (shared, paper_shared)


def test_dropout_is_off_in_evaluation_and_draws_its_key_in_training():
  model = tiny(dropout=0.5)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, SMALL_V)
  params = jax.jit(model.init)(jax.random.key(4), tokens)["params"]
  plain = tiny().apply({"params": params}, tokens)[0]
  np.testing.assert_array_equal(model.apply({"params": params}, tokens)[0], plain)
  one = model.apply({"params": params}, tokens, train=True, rngs={"dropout": jax.random.key(1)})
  two = model.apply({"params": params}, tokens, train=True, rngs={"dropout": jax.random.key(2)})
  assert float(jnp.max(jnp.abs(one[0] - two[0]))) > 1e-3
  with pytest.raises(Exception, match="dropout"):  # no key: Flax names the missing stream
    model.apply({"params": params}, tokens, train=True)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_a_mixture_in_every_other_block_and_dense_layers_between(scan_layers):
  model = tiny(num_experts=4, moe_every=2, scan_layers=scan_layers)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, SMALL_V)
  params = jax.jit(model.init)(jax.random.key(4), tokens)["params"]
  assert (switch.LAYERS in params) == scan_layers
  blocks = unrolled(params)
  assert "moe" not in blocks["block0"] and "ffn_wi" in blocks["block0"]
  assert "moe" in blocks["block1"] and switch.blocks(blocks) == ["block1"]
  _, aux = model.apply({"params": params}, tokens)
  chex.assert_shape(aux["experts"], (1, 2, 16))  # one mixture layer


# -- the scanned layers -----------------------------------------------------------------------------
def _max_abs(tree):
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("num_layers, moe_every", [(2, 1), (5, 2)])
def test_the_scanned_and_the_unrolled_forms_are_the_same_function(num_layers, moe_every):
  """Same initial weights, the same logits, routing, balance loss and gradients up to float32
  round-off; blocks beyond the last whole group (5 = 2 x 2 + 1) stay unrolled."""
  loose = dict(num_layers=num_layers, moe_every=moe_every, eval_capacity_factor=2.0)
  model = switch.SwitchTransformer(vocab_size=97, max_len=16, dim=32, num_heads=2, ffn_dim=48,
                                   num_experts=4, scan_layers=False, **loose)
  scanned = model.clone(scan_layers=True)
  tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 97)
  init = lambda m: jax.jit(lambda k: base.init_variables(m, k, tokens))(jax.random.key(0))  # pylint: disable=unnecessary-lambda-assignment
  p, q = init(model)["params"], init(scanned)["params"]
  groups = num_layers // moe_every
  assert set(q) - set(p) == {switch.LAYERS}
  assert {k for k in p if k.startswith("block")} - set(q) == {
      f"block{i}" for i in range(groups * moe_every)}
  chex.assert_trees_all_equal(q, switch.stack_layers(p, moe_every))
  chex.assert_trees_all_equal(switch.unstack_layers(q), p)
  assert q[switch.LAYERS][f"block{moe_every - 1}"]["moe"]["expert_wi"].shape == (groups, 4, 32, 48)

  def loss(module, params):
    logits, aux = module.apply({"params": params}, tokens[:, :-1])
    nll = task_base.masked_cross_entropy(logits, tokens[:, 1:], jnp.ones(3, bool))
    return nll + 0.01 * aux["balance"], (logits, aux)

  grad = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=0)
  (lp, (logits_p, aux_p)), gp = grad(model, p)
  (lq, (logits_q, aux_q)), gq = grad(scanned, q)
  np.testing.assert_array_equal(aux_p["experts"], aux_q["experts"])  # routing: no near ties here
  # Float32 round-off of reordered sums: a few ulps (2^-23) of the largest magnitude involved,
  # times the longest reduction (d_ff = 48 products) -- 64 ulps of each quantity's scale.
  ulps = 64 * 2.0 ** -23
  chex.assert_trees_all_close(logits_q, logits_p, atol=ulps * _max_abs(logits_p), rtol=0)
  assert abs(float(aux_q["balance"] - aux_p["balance"])) <= ulps * float(aux_p["balance"])
  assert abs(float(lq - lp)) <= ulps * float(lp)
  chex.assert_trees_all_close(switch.unstack_layers(gq), gp, atol=ulps * _max_abs(gp), rtol=0)


@pytest.mark.parametrize("num_layers, moe_every", [(2, 1), (5, 2)])
def test_a_count_traces_the_scanned_form_as_the_unrolled_one(num_layers, moe_every):
  """Comp counts the function, not its compiled form: a scanned model's train step and
  prediction count exactly the unrolled form's FLOPs (`switch.as_unrolled`, entered by
  `accounting.count`), a path that computes the same logits and that traces outside a count
  do not take."""
  model = switch.SwitchTransformer(vocab_size=SMALL_V, max_len=16, dim=32, num_heads=2,
                                   ffn_dim=48, num_experts=4, num_layers=num_layers,
                                   moe_every=moe_every, dropout=0.1, eval_capacity_factor=2.0,
                                   scan_layers=False)
  scanned = model.clone(scan_layers=True)
  tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, SMALL_V)
  init = lambda m: jax.jit(lambda k: base.init_variables(m, k, tokens[:, :-1]))(jax.random.key(0))  # pylint: disable=unnecessary-lambda-assignment
  p, q = init(model)["params"], init(scanned)["params"]

  def train_step(module):
    def loss(params, rng):
      logits, aux = module.apply({"params": params}, tokens[:, :-1], train=True,
                                 rngs={"dropout": rng})
      nll = task_base.masked_cross_entropy(logits, tokens[:, 1:], jnp.ones(3, bool))
      return nll + 0.01 * aux["balance"]
    return jax.value_and_grad(loss)

  def predict(module):
    return lambda params: module.apply({"params": params}, tokens[:, :-1])[0]

  key = jax.random.key(2)
  counted = accounting.count(train_step(model), p, key)
  assert counted.macs > 0 and accounting.count(train_step(scanned), q, key) == counted
  assert accounting.count(predict(scanned), q) == accounting.count(predict(model), p)
  with switch.as_unrolled():
    unrolled_path = jax.jit(predict(scanned))(q)
    assert "scan[" not in str(jax.make_jaxpr(predict(scanned))(q))
  logits = jax.jit(predict(model))(p)
  ulps = 64 * 2.0 ** -23  # float32 round-off of reordered sums, as in the test above
  chex.assert_trees_all_close(unrolled_path, logits, atol=ulps * _max_abs(logits), rtol=0)
  assert "scan[" in str(jax.make_jaxpr(predict(scanned))(q))  # outside: the loop


def test_copy_experts_writes_the_same_weights_in_both_layouts():
  model = tiny(moe_every=1, scan_layers=False)
  tokens = jnp.zeros((1, 16), jnp.int32)
  p = jax.jit(model.init)(jax.random.key(4), tokens)["params"]
  q = switch.stack_layers(p, 1)
  chosen = [[1, 3], [0, 2]]
  grown_p = switch.copy_experts(p, chosen, jax.random.key(5), noise=0.1)
  grown_q = switch.copy_experts(q, chosen, jax.random.key(5), noise=0.1)
  assert switch.experts_per_block(grown_q) == switch.experts_per_block(grown_p) == 6
  chex.assert_trees_all_equal(switch.unstack_layers(grown_q), grown_p)
  with pytest.raises(ValueError, match=r"one per block \(2\)"):
    switch.copy_experts(q, [[1], [2], [3]], jax.random.key(5))


def test_the_stacked_experts_keep_their_logical_axis_in_both_layouts():
  axes = sharding.leaf_axes_by_pattern(switch.SwitchTransformer.LEAF_AXES)
  assert axes(".trainable['layers']['block1']['moe']['expert_wi']") == (None, "expert")
  assert axes(".trainable['block1']['moe']['expert_wi']") == ("expert",)
  assert axes(".trainable['layers']['block1']['moe']['router_kernel']") == ()


@pytest.mark.parametrize("method, section, field, old_value", [
    ("lm_sm", "model", "scan_layers", False), ("lm_gmoe", "method", "slots", "exact")])
def test_a_run_of_the_other_layout_is_not_resumed_and_the_error_names_the_field(
    tmp_path, method, section, field, old_value):
  """A run written before the scanned layout (no `model.scan_layers` in its config.json) ran
  unrolled, and one before the experts' slots (no `method.slots`) without padding: resuming
  it with the default is refused, naming the field to set."""
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", method), "smoke")
  c = validation.validate(c)
  old = workdir.config_dict(c)
  del old[section][field]
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  (tmp_path / workdir.LOG_FILE).write_text('{"t": 0}\n')
  with pytest.raises(ConfigError, match=rf"config\.{section}\.{field}: {old_value!r} → "
                     rf"{c[section][field]!r}; rerun"):
    workdir.check_resume(str(tmp_path), c)
  c[section][field] = old_value
  workdir.check_resume(str(tmp_path), validation.validate(c))  # the old layout resumes
