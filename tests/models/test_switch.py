"""Tests of the Switch Transformer (alma_jax/models/switch.py) and of copying its experts
(gMoE on its own expert layers: alma_jax/methods/expert_growth.py)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.methods import gmoe
from alma_jax.models import switch
from alma_jax.tasks import base as task_base

V = 50257


def tiny(num_experts=4, eval_capacity_factor=0.0, max_len=16, **kw):
  return switch.SwitchTransformer(vocab_size=V, max_len=max_len, num_layers=2, dim=32,
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
  model = tiny(eval_capacity_factor=1.0)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, V)
  params = model.init(jax.random.key(4), tokens)["params"]
  j = 9
  changed = tokens.at[:, j].set((tokens[:, j] + 123) % V)
  a, _ = model.apply({"params": params}, tokens)
  b, _ = model.apply({"params": params}, changed)
  chex.assert_trees_all_close(a[:, :j], b[:, :j], atol=1e-6, rtol=0)
  assert float(jnp.max(jnp.abs(a[:, j:] - b[:, j:]))) > 1e-3


def test_untrained_perplexity_is_near_the_vocabulary_size():
  # Logits are h . e_v with LayerNorm'd h (unit variance per dimension) and N(0, 0.02^2)
  # embeddings: i.i.d. N(0, s^2), s^2 = 0.02^2 * d. The expected NLL of a random target is
  # then about log V + s^2 / 2 (= log V + 0.0064 for d = 32); 0.05 leaves room for sampling.
  model = tiny()
  tokens = jax.random.randint(jax.random.key(5), (4, 16), 0, V)
  params = model.init(jax.random.key(6), tokens)["params"]
  logits, _ = model.apply({"params": params}, tokens[:, :-1])
  nll = float(task_base.masked_cross_entropy(logits, tokens[:, 1:], jnp.ones(4, bool)))
  assert abs(nll - math.log(V)) < 0.05, (nll, math.log(V))


def test_capacity_limit():
  assert switch.capacity(100, 4, 1.0) == 25
  assert switch.capacity(10, 4, 1.0) == 3
  assert switch.capacity(10, 4, 0.0) == 10  # no limit
  assert switch.capacity(10, 4, 8.0) == 10


def gmoe_method(noise=0.0):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_gmoe"), "smoke")
  c.model.eval_capacity_factor = 0.0
  c.model.dim, c.model.ffn_dim = 32, 48
  c.method.router_noise = noise
  method = methods.make(c, (16,), V)
  assert isinstance(method, gmoe.GrowingMoE) and method.own is not None
  return method


def test_copy_experts_leaves_the_outputs_unchanged_without_perturbation():
  method = gmoe_method()
  learner = method.init(jax.random.key(7))
  tokens = jax.random.randint(jax.random.key(8), (3, 16), 0, V)
  before = method.predict(learner.structure, learner.params, {}, tokens)
  grown = method.own.copy(learner, [[1, 3], [0, 2]], jax.random.key(9))
  assert grown.structure == (6,)
  moe0 = grown.params["block0"]["moe"]
  chex.assert_shape(moe0["expert_wi"], (6, 32, 48))
  chex.assert_shape(moe0["router_kernel"], (32, 6))
  np.testing.assert_array_equal(moe0["expert_wo"][4], learner.params["block0"]["moe"]["expert_wo"][1])
  after = method.predict(grown.structure, grown.params, {}, tokens)
  chex.assert_trees_all_close(before, after, atol=1e-5, rtol=0)
  # The input is not modified, and the number of parameters grows by 2 experts x 2 blocks.
  assert learner.structure == (4,)
  per_expert = 32 * 48 + 48 + 48 * 32 + 32 + 32 + 1  # weights, biases, router column and bias
  assert method.num_params(grown) == method.num_params(learner) + 2 * 2 * per_expert


def test_copy_experts_with_a_perturbation_changes_the_routing():
  method = gmoe_method()
  learner = method.init(jax.random.key(7))
  tokens = jax.random.randint(jax.random.key(8), (3, 16), 0, V)
  before = method.predict(learner.structure, learner.params, {}, tokens)
  grown = method.own.copy(learner, [0, 1], jax.random.key(9), noise=0.5)
  after = method.predict(grown.structure, grown.params, {}, tokens)
  assert float(jnp.max(jnp.abs(before - after))) > 1e-4


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
