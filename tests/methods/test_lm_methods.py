"""Tests of the methods on text (SM, Ens, gEns and gMoE on the Switch Transformer, also under
the config names lm_sm, lm_ens, lm_gens and lm_gmoe) and of fixed-step stages."""

import os

import jax
import numpy as np
import pytest

from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.engine import orders
from alma_jax.engine import timing
from alma_jax.errors import ConfigError
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir
from alma_jax.stream import run as run_lib
from alma_jax.stream import validation
from tests.data.test_text import SMALL_VOCAB, requires_bpe, requires_shakespeare, smoke

V = 512  # a small vocabulary: its size plays no part in these tests


def lm_method(name, dropout=0.0, **method_fields):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", name), "smoke")
  c.model.dim, c.model.ffn_dim, c.model.dropout = 32, 48, dropout
  for k, v in method_fields.items():
    c.method[k] = v
  return methods.make(c, (16,), V)


def test_fixed_orders_give_exactly_the_steps_asked_for_from_reshuffled_data():
  rng = np.random.default_rng(0)
  idx = np.arange(10, 17)  # 7 examples
  order, mask, steps = orders.padded_orders(rng, idx, 2, 3, 4, num_steps=5)
  assert steps == 5 and order.shape == (8, 2, 3)  # padded to 2 calls of 4 steps
  assert mask[:5].all() and not mask[5:].any()
  for d in range(2):
    drawn = order[:5, d].reshape(-1)
    np.testing.assert_array_equal(np.sort(drawn[:7]), idx)  # a whole shuffle first
    np.testing.assert_array_equal(np.sort(drawn[7:14]), idx)
  # Without a fixed number of steps, one pass over the data (as before).
  _, mask, steps = orders.padded_orders(np.random.default_rng(0), idx, 1, 3, 1)
  assert steps == 3 and mask.sum() == 7


def test_a_one_member_lm_ensemble_is_the_single_model():
  sm, ens = lm_method("lm_sm"), lm_method("lm_ens", num_members=1)
  key = jax.random.key(3)
  a, b = sm.init(key), ens.init(key)
  tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, V)
  predict = lambda m, s: jax.jit(m.predict, static_argnums=0)(s.structure, s.params, {}, tokens)
  np.testing.assert_allclose(predict(sm, a), predict(ens, b), atol=1e-5)


@pytest.mark.parametrize("name", ["lm_sm", "lm_ens", "lm_gens", "lm_gmoe"])
def test_every_lm_method_trains_with_dropout_drawn_from_the_step_key(name):
  tokens = jax.random.randint(jax.random.key(4), (1, 2, 17), 0, V)
  x, y, mask = tokens[..., :-1], tokens[..., 1:], np.ones((1, 2), bool)

  def losses(dropout):
    m = lm_method(name, dropout=dropout)
    learner = m.init(jax.random.key(3))
    trainable, frozen = m.partition(learner)
    n = m.num_data_orders(learner.structure)
    xs, ys, ms = (np.repeat(np.asarray(a), n, axis=0) for a in (x, y, mask))
    loss = jax.jit(m.loss, static_argnums=0)
    return [float(loss(learner.structure, trainable, frozen, learner.model_state, xs, ys, ms,
                       jax.random.key(k))[0]) for k in (1, 2)]

  off, on = losses(0.0), losses(0.5)
  assert off[0] == off[1]  # no dropout: the key does not matter
  assert on[0] != on[1] and on[0] != off[0]


def test_lm_gmoe_grows_by_k_until_max_experts():
  m = lm_method("lm_gmoe", grow_by=2, grow_schedule="", max_experts=9)
  growths = [m.own.growth(s, e) for s, e in ((1, 4), (2, 4), (3, 6), (4, 8), (5, 9))]
  assert growths == [0, 2, 2, 1, 0]


def test_lm_gmoe_follows_its_growth_schedule_then_grow_by():
  # The paper's default: 4 -> 6 -> 8 -> 12, then k = grow_by.
  m = lm_method("lm_gmoe", grow_by=3)
  sizes, growths = [4], []
  for stage in range(1, 7):
    growths.append(m.own.growth(stage, sizes[-1]))
    sizes.append(sizes[-1] + growths[-1])
  assert growths == [0, 2, 2, 4, 3, 3]
  # Every second stage: the schedule indexes growths, not stages.
  m = lm_method("lm_gmoe", grow_schedule="1,5", grow_every=2)
  assert [m.own.growth(s, 4) for s in range(1, 8)] == [0, 0, 1, 0, 4, 0, 2]


def test_lm_gmoe_in_planned_slots_keeps_one_program_structure_over_its_growth():
  # 4 -> 6 -> 8 -> 12 over the smoke's four stages: twelve slots from the start, the
  # dispatch buffer sized for the fewest experts they hold.
  m = lm_method("lm_gmoe", slots="planned")
  sizes = [4]
  for stage in range(2, 5):
    sizes.append(sizes[-1] + m.own.growth(stage, sizes[-1]))
  assert sizes == [4, 6, 8, 12]
  assert {m.program_structure((n,)) for n in sizes} == {(12, 4)}
  capped = lm_method("lm_gmoe", slots="planned", max_experts=10)
  assert {capped.program_structure((n,)) for n in (4, 6, 8, 10)} == {(10, 4)}


@pytest.mark.parametrize("value", ["2,x", "2;4", "0,2"])
def test_lm_gmoe_refuses_a_bad_growth_schedule(value):
  with pytest.raises(ConfigError, match="config.method.grow_schedule="):
    lm_method("lm_gmoe", grow_schedule=value)


@pytest.mark.parametrize("name", ["lm_sm", "lm_ens", "lm_gens", "lm_gmoe"])
def test_every_lm_method_checks_its_model_s_sizes_with_the_config(name):
  # As `validation.validate` checks a config (`--print_config`, the launchers): before any
  # program is built.
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", name), "smoke")
  c.model.dim, c.model.num_heads = 30, 4
  with pytest.raises(ConfigError, match=r"^config\.model\.dim=30 must be a multiple of "
                                        r"config\.model\.num_heads=4"):
    validation.validate(c, data=False)


def architecture(wd):
  return io_utils.read_jsonl(os.path.join(wd, workdir.ARCH_FILE))


def perplexities(wd):
  return [r["test_perplexity"] for r in io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))]


@requires_bpe
@requires_shakespeare
def test_lm_gmoe_run_copies_experts_before_every_later_stage(tmp_path):
  wd = str(tmp_path / "gmoe")
  before = timing.compile_counts()["step_programs"]
  summary = run_lib.run(smoke("lm_gmoe"), wd)
  compiled = timing.compile_counts()["step_programs"] - before
  assert [a["experts"] for a in architecture(wd)] == [4, 6, 8, 12]
  # The experts live in slots of a power of two (4, 8, 8, 16): train and evaluation once per
  # slot count, the scoring pass once per slot count grown from (4, 8); 11 with exact slots.
  assert compiled == summary["num_compilations"] == 2 * 3 + 2, (compiled, summary)
  log = io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))
  assert [r["growth_flops"] > 0 for r in log] == [False, False, True, True, True]
  ppl = perplexities(wd)
  assert ppl[-1] < ppl[1] < ppl[0]


@requires_bpe
@requires_shakespeare
def test_lm_gens_run_adds_one_model_per_stage(tmp_path):
  # lm_ens shares this machinery (one model per member; a one-member lm_ens is lm_sm above).
  method, members = "lm_gens", [1, 2, 3, 4]
  wd = str(tmp_path / method)
  run_lib.run(smoke(method), wd)
  arch = architecture(wd)
  assert [a["members"] for a in arch] == members
  assert arch[-1]["num_params"] == members[-1] * arch[0]["num_params"] // members[0]
  ppl = perplexities(wd)
  assert len(ppl) == 5 and ppl[-1] < ppl[0]
  # The untrained model is near uniform over the cut vocabulary's tokens.
  assert 0.8 * SMALL_VOCAB < ppl[0] < 1.25 * SMALL_VOCAB
