"""Tests of several seeds as one population (alma_jax/engine/population.py, train.py, run.py)."""

import json
import os

import chex
import jax
import numpy as np
import pytest

from alma_jax.engine import population
from alma_jax.engine import train
from alma_jax.errors import ConfigError
from alma_jax.reports import plot_style
from alma_jax.runtime import executables
from alma_jax.stream import validation
from tests import helpers
from tests import kill_points
from tests.conftest import requires_mnist
from tests.test_main_e2e import check_outputs, run_main


@pytest.mark.parametrize("method_name,patience", [("sm", 1), ("ens", 3)])
def test_vmapped_stage_matches_separate_stages(method_name, patience):
  # Two seeds with different data, keys and (with patience 1) different stopping epochs.
  ds = helpers.synthetic_dataset(n_train=400, n_test=64)
  config = helpers.small_config(method=method_name, width=8, epochs=4, patience=patience)
  config.method.num_members = 2
  method, steps = helpers.make_steps(config, ds)
  rng = np.random.default_rng(0)
  train_idx = np.stack([rng.permutation(300)[:250] for _ in range(2)]).astype(np.int32)
  val_idx = np.stack([300 + rng.permutation(100)[:60] for _ in range(2)]).astype(np.int32)
  keys = [jax.random.key(10 + s) for s in (3, 4)]
  # vmap sums in another order than a single learner: compared in float64 (helpers.float64),
  # where rounding cannot flip an early-stopping decision either.
  with jax.enable_x64(True):
    learners = [helpers.float64(method.init(jax.random.key(s))) for s in (3, 4)]
    separate = [train.fit_one(steps, l, train_idx[i], val_idx[i], keys[i])
                for i, l in enumerate(learners)]
    best, _, stats = train.fit_stage(
        steps, population.stack(learners),
        train.StageData(train_idx, val_idx, population.stack_keys(keys), 1),
        hooks=train.StageHooks(labels=[3, 4]))
  for i, (learner, _, s) in enumerate(separate):
    chex.assert_trees_all_close(population.unstack(best, i).params, learner.params,
                                atol=1e-9, rtol=1e-9)
    assert stats.epochs_run[i] == s.epochs_run[0]
    assert stats.best_epoch[i] == s.best_epoch[0]
    assert stats.steps_run[i] == s.steps_run[0]
    assert stats.best_val_accuracy[i] == pytest.approx(s.best_val_accuracy[0])
  # The per-seed evaluation agrees with the single-learner one, on each seed's own
  # examples and on examples shared by all seeds.
  test_idx = np.arange(50, dtype=np.int32)
  with jax.enable_x64(True):
    acc, _ = steps.evaluate(best, "train", val_idx)
    shared, _ = steps.evaluate(best, "test", test_idx)
    for i in range(2):
      one = population.unstack(best, i)
      assert acc[i] == pytest.approx(helpers.evaluate(steps, one, val_idx[i]))
      assert shared[i] == pytest.approx(helpers.evaluate(steps, one, test_idx, "test"))


@requires_mnist
def test_num_seeds_is_validated():
  config = helpers.small_config(method="gmoe")
  config.num_seeds = 3
  # Methods whose growth depends on each seed's data (gMoE, FF, lm_gmoe) are not valid.
  with pytest.raises(ConfigError, match=r"config.num_seeds=3 .*valid names: "
                     r"\['ens', 'gens', 'lm_ens', 'lm_gens', 'lm_sm', 'sm', 'umix'\]"):
    validation.validate(config)
  config.num_seeds = 0
  with pytest.raises(ConfigError, match=r"config.num_seeds=0 must be >= 1"):
    validation.validate(config)
  config = helpers.small_config(method="gens")
  config.num_seeds = 2
  assert validation.validate(config).num_seeds == 2


def test_mean_summary():
  out = population.mean_summary([{"cer": 1.0, "mem": 4}, {"cer": 3.0, "mem": 4}])
  # Sample standard deviation: sqrt(((1 - 2)^2 + (3 - 2)^2) / (2 - 1)) = sqrt(2).
  assert out == {"cer": 2.0, "cer_std": np.sqrt(2.0), "mem": 4.0, "mem_std": 0.0,
                 "std_convention": "sample standard deviation over the seeds (ddof=1)"}


def test_summary_and_report_share_one_standard_deviation():
  errors = [0.1, 0.25, 0.4]
  out = population.mean_summary([{"final_error": e} for e in errors])
  assert (out["final_error"], out["final_error_std"]) == plot_style.mean_std(errors)


def _read(path):
  with open(path) as f:
    return [json.loads(l) for l in f] if path.endswith(".jsonl") else json.load(f)


@requires_mnist
def test_two_seeds_end_to_end_match_separate_runs_and_resume(tmp_path):
  cfg = "configs/mnist_gens.py:smoke"
  both = tmp_path / "both"
  proc = run_main(cfg, both, "--config.num_seeds=2", "--config.seed=5")
  assert proc.returncode == 0, proc.stderr[-2000:]
  top = _read(str(both / "summary.json"))
  assert top["seeds"] == [5, 6] and len(top["per_seed"]) == 2
  assert top["cer"] == pytest.approx(np.mean([s["cer"] for s in top["per_seed"]]))
  for seed in (5, 6):
    check_outputs(str(both / f"seed_{seed}"), 4)
    assert _read(str(both / f"seed_{seed}" / "config.json"))["seed"] == seed
    # The speed choices trained every seed: each seed's summary names them.
    assert _read(str(both / f"seed_{seed}" / "summary.json"))["choices"] == top["choices"]
  assert top["choices"]
  # The second seed is what a separate run with that seed gives.
  for seed in (6,):
    sep = tmp_path / f"sep{seed}"
    helpers.run_config(cfg, sep, seed=seed)
    records = _read(str(both / f"seed_{seed}" / "log.jsonl"))
    expected = _read(str(sep / "log.jsonl"))
    for r, e in zip(records, expected):
      assert r["num_params"] == e["num_params"] and r["trained"] == e["trained"]
      assert r["train_flops"] == pytest.approx(e["train_flops"], rel=1e-6)
      assert r["test_error"] == pytest.approx(e["test_error"], abs=0.01)
  # The two seeds differ (own streams, initialisations and data orders).
  errors = [[r["test_error"] for r in _read(str(both / f"seed_{s}" / "log.jsonl"))] for s in (5, 6)]
  assert errors[0] != errors[1]
  # The progress line's spread over the seeds is their sample standard deviation, as in the
  # summary and the reports.
  final = [e[-1] for e in errors]
  assert f"test_error={np.mean(final):.4f}±{np.std(final, ddof=1):.4f}" in proc.stderr, (
      proc.stderr[-2000:])

  # Killed after the checkpoint of t=2, the run resumes to the same logs.
  killed = tmp_path / "killed"
  env = kill_points.env(dict(os.environ, ALMA_JAX_TEST_KILL_AT="t=2:saved"))
  proc = run_main(cfg, killed, "--config.num_seeds=2", "--config.seed=5", env=env)
  assert proc.returncode != 0
  assert not (killed / "summary.json").exists()
  proc = run_main(cfg, killed, "--config.num_seeds=2", "--config.seed=5")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "resuming" in proc.stderr
  for seed in (5, 6):
    got = _read(str(killed / f"seed_{seed}" / "log.jsonl"))
    want = _read(str(both / f"seed_{seed}" / "log.jsonl"))
    for g, w in zip(got, want):
      g.pop("wall_s"), w.pop("wall_s")
    assert got == want


# -- keys and initial learners as few programs ----------------------------------------------------
SEEDS = (0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1)


def test_keys_and_their_folds_are_those_of_one_key_at_a_time():
  keys = population.keys(SEEDS)
  expected = np.stack([jax.random.key_data(jax.random.key(s)) for s in SEEDS])
  np.testing.assert_array_equal(jax.random.key_data(keys), expected)
  for i in (0, 3, 2**32 - 1):
    folded = jax.vmap(lambda k, i=i: jax.random.fold_in(k, i))(keys)
    np.testing.assert_array_equal(jax.random.key_data(population.fold(keys, i)),
                                  jax.random.key_data(folded))
  members = population.member_keys(keys)
  assert len(members) == len(SEEDS)
  for j, k in enumerate(members):
    np.testing.assert_array_equal(jax.random.key_data(k), expected[j])
  rngs = population.numpy_rngs(keys)
  for j, rng in enumerate(rngs):
    assert rng.integers(1 << 30) == np.random.default_rng(expected[j].tolist()).integers(1 << 30)


def test_member_keys_and_folds_build_no_program_of_their_own():
  names = helpers.compiled_in_a_new_process("""
      import numpy as np
      from alma_jax.engine import population
      keys = population.keys((3, 4))
      jax.random.fold_in(jax.random.key(0), np.asarray(1, np.uint32))  # the one single-key fold
  """, """
      population.fold(keys, 5)
      population.stack_keys(population.member_keys(keys))
  """)
  assert names == [], names


@pytest.mark.parametrize("method_name", ["sm", "gmoe", "ens", "ff"])
def test_initial_learners_are_each_keys_init_in_one_program(method_name):
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, _ = helpers.make_steps(helpers.small_config(method=method_name, width=6), ds)
  keys = population.keys((5, 6))
  learner, names = helpers.compiled(lambda: population.initial(method, keys))
  assert len(names) <= 1, names  # none when this test ran before in the process
  one_by_one = population.stack([method.init(jax.random.fold_in(k, 0))
                                 for k in population.member_keys(keys)])
  assert learner.structure == one_by_one.structure
  chex.assert_trees_all_equal((learner.params, learner.model_state),
                              (one_by_one.params, one_by_one.model_state))


@pytest.mark.parametrize("method_name", ["sm", "gmoe", "ff"])
def test_initial_learners_compile_as_a_program_that_runs_once(method_name, monkeypatch):
  """The initialisation runs once per run: it asks for `executables.ONCE_OPTIONS` (on a CPU,
  XLA's elemental emitters: a shorter compile, the same values; every `:smoke` record is the
  same with either, `benchmarks/smoke_records.py --compare`)."""
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  method, _ = helpers.make_steps(helpers.small_config(method=method_name, width=6), ds)
  keys = population.keys((5, 6))
  expected = population.initial(method, keys)
  # An option that XLA does not know shows that the program asks for them (then dropped).
  monkeypatch.setattr(executables, "ONCE_OPTIONS", {"xla_cpu_no_such_option": True})
  monkeypatch.setattr(executables, "_refused", [])
  monkeypatch.setattr(population._initial, "_top_jitted", None)  # pylint: disable=protected-access
  learner = population.initial(method, keys)
  assert "No such compile option" in executables._refused[0]  # pylint: disable=protected-access
  assert "xla_cpu_no_such_option" in executables._refused[0]  # pylint: disable=protected-access
  chex.assert_trees_all_equal(learner, expected)
