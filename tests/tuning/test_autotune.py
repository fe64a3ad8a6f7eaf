"""Tests of choices made by measurement (alma_jax/tuning/autotune.py)."""

import json
import logging
import os
import threading
import types

import jax
import numpy as np

import pytest

import alma_jax
from alma_jax.configuration import config_lib
from alma_jax.engine import population
from alma_jax.runtime import executables
from alma_jax.stream import run as run_lib
from alma_jax.stream import validation
from alma_jax.tuning import autotune
from tests import helpers
from tests.conftest import requires_mnist

MNIST = validation.KNOWN_SHAPES["mnist"][0]


def _small(*args, **kwargs):
  """A small config whose stage program and evaluation options are given (these tests are
  about the fields timed on the train step)."""
  c = helpers.small_config(*args, **kwargs)
  c.train.stage_program = "per_epoch"
  c.train.step_fusion = c.train.eval_fusion = "same"
  return c


def each(fn):
  """The measurement of `choose` ({candidate: Steps} -> {candidate: seconds}) from a function
  of one candidate's Steps."""
  return lambda built: {k: fn(steps) for k, steps in built.items()}


def test_the_stage_program_is_decided_by_its_rule_without_timing_anything(tmp_path):
  build, measure, calls = _fake({})
  cache = str(tmp_path / "machine.json")
  c = helpers.small_config()  # an MLP and SM: the whole stage as one program on a CPU
  c.train.step_fusion = c.train.eval_fusion = "same"
  got = autotune.choose(c, MNIST, build, mode="measure", cache_file=cache, measure=measure)
  assert got == {"train.stage_program": autotune.stage_program_rule(c)} and not calls
  assert not os.path.exists(cache)  # a rule's answer is not a measurement


def _fake(seconds: dict):
  """(build, measure, calls): Steps stand-ins whose 'time' is `seconds[value]` of the
  tunable field; `calls` records the measured configs."""
  calls = []

  def build(cfg):
    return types.SimpleNamespace(config=cfg)

  def measure(steps):
    c = steps.config
    key = (c.train.steps_per_call, c.model.conv_impl, c.method.get("strategy"))
    calls.append(key)
    return seconds[key]

  return build, each(measure), calls


def test_the_fastest_candidate_is_chosen_remembered_and_reused(tmp_path, caplog):
  c = _small(steps_per_call=0)
  build, measure, calls = _fake({(1, "auto", None): 2.0, (8, "auto", None): 1.0})
  cache, mine = str(tmp_path / "machine.json"), str(tmp_path / "wd" / autotune.FILE)
  with caplog.at_level(logging.INFO):
    got = autotune.choose(c, MNIST, build, mode="measure", workdir_file=mine, cache_file=cache,
                          measure=measure)
  assert got == {"train.steps_per_call": 8} and sorted(calls) == [(1, "auto", None),
                                                                 (8, "auto", None)]
  assert "train.steps_per_call: 8 measured (1 64 img/s, 8 128 img/s)" in caplog.text
  key = autotune.machine_key(c, MNIST, "train.steps_per_call")
  assert json.load(open(cache)) == {key: 8} == json.load(open(mine))
  # The machine's record spares the measurement; the workdir's record wins over it.
  calls.clear()
  again = autotune.choose(c, MNIST, build, mode="measure", cache_file=cache, measure=measure)
  assert again == got and not calls
  autotune.remember(mine, key, 1)
  kept = autotune.choose(c, MNIST, build, mode="measure", workdir_file=mine, cache_file=cache,
                         measure=measure)
  assert kept == {"train.steps_per_call": 1} and not calls
  # Another shape is another key: measured again.
  c.train.batch_size = 64
  autotune.choose(c, MNIST, build, mode="measure", cache_file=cache, measure=measure)
  assert len(calls) == 2 and len(json.load(open(cache))) == 2


def test_rules_explicit_values_and_fields_that_do_not_apply_are_not_measured(tmp_path):
  build, measure, calls = _fake({})
  cache = str(tmp_path / "machine.json")
  vgg = _small("cifar10", method="ens", width=4, steps_per_call=0)
  vgg.method.num_members = 2
  ruled = autotune.choose(vgg, (32, 32, 3), build, mode="rules", cache_file=cache,
                          measure=measure)
  assert ruled == {"model.conv_impl": autotune.conv.resolve_impl("auto", 4),
                   "method.strategy": autotune.ensemble.choose_strategy("auto", "vgg"),
                   "train.steps_per_call": autotune.steps_per_call_rule(vgg)}
  assert not calls and not os.path.exists(cache)
  vgg.model.conv_impl, vgg.method.strategy, vgg.train.steps_per_call = "xla", "loop", 2
  assert autotune.pending(vgg) == []
  mlp = _small(method="gens")  # an MLP, one member at the start
  assert autotune.pending(mlp) == []
  mlp.method.initial_members = 2
  assert [t.path for t in autotune.pending(mlp)] == ["method.strategy"]


def test_a_short_run_on_an_accelerator_takes_the_rules_and_a_long_one_measures(
    tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(autotune, "_accelerator", lambda: True)
  build, measure, calls = _fake({(1, "auto", "vmap"): 2.0, (1, "auto", "loop"): 1.0})
  cache = str(tmp_path / "machine.json")
  vgg = _small("cifar10", method="ens", width=4)
  vgg.method.num_members = 2
  steps = config_lib.planned_steps(vgg)
  assert steps < autotune.gpu_autotune.MIN_STEPS
  assert autotune.short_accelerator_run(vgg) == steps
  with caplog.at_level(logging.INFO):
    got = autotune.choose(vgg, (32, 32, 3), build, mode="measure", cache_file=cache,
                          measure=measure)
  assert got == autotune.choose(vgg, (32, 32, 3), build, mode="rules", cache_file=cache,
                                measure=measure)
  assert set(got) == {"model.conv_impl", "method.strategy"}
  assert not calls and not os.path.exists(cache)  # nothing compiled, timed or remembered
  assert (f"by rule ({steps:,} planned train steps on an accelerator < 8,000: measuring "
          "would compile more than it can save)") in caplog.text
  # A run of at least MIN_STEPS planned steps measures (an MLP's ensemble: its strategy).
  mlp = _small(method="ens")
  mlp.method.num_members = 2
  assert [t.path for t in autotune.pending(mlp)] == ["method.strategy"]
  assert autotune.short_accelerator_run(mlp) is not None
  mlp.train.epochs = -(-autotune.gpu_autotune.MIN_STEPS // config_lib.planned_steps(
      mlp)) * mlp.train.epochs
  assert autotune.short_accelerator_run(mlp) is None
  long = autotune.choose(mlp, MNIST, build, mode="measure", cache_file=cache, measure=measure)
  assert long == {"method.strategy": "loop"} and sorted(calls) == [(1, "auto", "loop"),
                                                                  (1, "auto", "vmap")]
  # What this machine measured serves a short run of the same step (the epochs are not in
  # the key), though the rule would say otherwise.
  calls.clear()
  mlp.train.epochs = 2
  assert autotune.short_accelerator_run(mlp) is not None
  assert autotune.by_rules(mlp).method.strategy == "vmap"
  assert autotune.choose(mlp, MNIST, build, mode="measure", cache_file=cache,
                         measure=measure) == {"method.strategy": "loop"} and not calls
  # On a CPU no run is a short accelerator run (the CPU's measurements: the tests above).
  monkeypatch.setattr(autotune, "_accelerator", lambda: False)
  assert autotune.short_accelerator_run(vgg) is None


def test_a_candidate_that_fails_leaves_the_choice_to_the_rule(tmp_path, caplog):
  c = _small(steps_per_call=0)

  def build(cfg):
    if cfg.train.steps_per_call == 8:
      raise RuntimeError("out of memory")
    return cfg

  cache = str(tmp_path / "machine.json")
  with caplog.at_level(logging.WARNING):
    got = autotune.choose(c, MNIST, build, mode="measure", cache_file=cache,
                          measure=each(lambda steps: 1.0))
  assert got == {"train.steps_per_call": autotune.steps_per_call_rule(c)}
  assert "train.steps_per_call=8 could not be timed (RuntimeError: out of memory)" in caplog.text
  assert not os.path.exists(cache)  # a rule's answer is not a measurement


def test_runs_that_start_together_measure_a_choice_once_and_share_it(tmp_path, caplog):
  # Two runs (here threads: each takes the lock through a file of its own, as two processes
  # do) reach the same unmeasured choice of one machine. The first measures; the second waits
  # for it instead of timing the candidates while the first loads the cores, and takes its
  # answer.
  caplog.set_level(logging.INFO)
  c = _small(steps_per_call=0)
  cache = str(tmp_path / "machine.json")
  key = autotune.machine_key(c, MNIST, "train.steps_per_call")
  inside, release, calls, got = threading.Event(), threading.Event(), [], {}

  def slow(built):  # the first run's measurement, held until the second waits for it
    calls.append(("first", sorted(built)))
    inside.set()
    assert release.wait(30)
    return {1: 2.0 * 128, 8: 1.0 * 128}

  def never(built):
    calls.append(("second", sorted(built)))
    return {1: 1.0, 8: 2.0}

  def run(name, measure):
    got[name] = autotune.choose(c, MNIST, lambda cfg: cfg, mode="measure", cache_file=cache,
                                measure=measure)

  first = threading.Thread(target=run, args=("first", slow))
  first.start()
  assert inside.wait(30)
  second = threading.Thread(target=run, args=("second", never))
  second.start()
  helpers.wait_for_log(
      caplog, "waiting for the measurement of train.steps_per_call in another process")
  release.set()
  first.join(30)
  second.join(30)
  assert got == {"first": {"train.steps_per_call": 8}, "second": {"train.steps_per_call": 8}}
  assert calls == [("first", [1, 8])]
  assert json.load(open(cache)) == {key: 8}
  assert f"train.steps_per_call: 8 measured earlier on this machine ({cache})" in caplog.text
  assert os.path.isfile(autotune.lock_file(cache, key))
  # Another shape's choice has a lock of its own.
  c.train.batch_size = 64
  assert autotune.lock_file(cache, autotune.machine_key(c, MNIST, "train.steps_per_call")
                            ) != autotune.lock_file(cache, key)


def test_a_waiting_run_measures_itself_when_the_first_fell_back_on_the_rule(tmp_path, caplog):
  # A rule's answer (a candidate failed to build) is not a measurement: the run that waited
  # measures the choice itself and remembers it.
  caplog.set_level(logging.INFO)
  c = _small(steps_per_call=0)
  cache = str(tmp_path / "machine.json")
  inside, release, got = threading.Event(), threading.Event(), {}

  def failing(cfg):
    if cfg.train.steps_per_call == 8:
      inside.set()
      assert release.wait(30)
      raise RuntimeError("out of memory")
    return cfg

  first = threading.Thread(target=lambda: got.update(first=autotune.choose(
      c, MNIST, failing, mode="measure", cache_file=cache, measure=each(lambda s: 1.0))))
  first.start()
  assert inside.wait(30)
  second = threading.Thread(target=lambda: got.update(second=autotune.choose(
      c, MNIST, lambda cfg: cfg, mode="measure", cache_file=cache,
      measure=each(lambda s: {1: 2.0, 8: 1.0}[s.train.steps_per_call]))))
  second.start()
  helpers.wait_for_log(
      caplog, "waiting for the measurement of train.steps_per_call in another process")
  release.set()
  first.join(30)
  second.join(30)
  assert got == {"first": {"train.steps_per_call": autotune.steps_per_call_rule(c)},
                 "second": {"train.steps_per_call": 8}}
  key = autotune.machine_key(c, MNIST, "train.steps_per_call")
  assert json.load(open(cache)) == {key: 8}


def test_a_measurement_initialises_its_learner_with_the_run_s_program():
  # The run's initial learners then need no program of their own (a width no other test
  # uses, so that nothing compiled earlier in this process can make it pass).
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  steps = helpers.make_steps(_small(width=5, batch_size=16), ds)[1]
  assert autotune.time_evaluations({0: steps})[0] > 0
  _, names = helpers.compiled(lambda: population.initial(steps.method, population.keys([0])))
  assert names == []


def test_a_real_measurement_times_both_strategies_of_an_ensemble(tmp_path):
  c = _small(method="ens", width=4, batch_size=16)
  c.method.num_members = 2
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  timed = []

  def measure(built):
    timed.extend(steps.method.run_as for steps in built.values())
    seconds = autotune.time_train_steps(built)
    assert all(s > 0 for s in seconds.values())
    return seconds

  got = autotune.choose(c, MNIST, lambda cfg: helpers.make_steps(cfg, ds)[1], mode="measure",
                        cache_file=str(tmp_path / "machine.json"), measure=measure)
  assert sorted(timed) == ["loop", "vmap"] and got["method.strategy"] in timed


@requires_mnist
def test_a_run_records_its_choices_in_the_workdir_the_cache_and_the_summary(tmp_path):
  c = helpers.smoke(train__steps_per_call=0, stream__num_megabatches=2,
                    train__autotune="measure", train__stage_program="per_epoch")  # (smoke's own choices are by rule)
  wd = str(tmp_path / "wd")
  summary = run_lib.run(c, wd)
  chosen = {autotune.machine_key(c, MNIST, path): summary["choices"][path]
            for path in ("train.steps_per_call", autotune.STEP_FUSION, autotune.EVAL_FUSION)}
  assert summary["choices"]["train.steps_per_call"] in autotune.STEPS_PER_CALL_CANDIDATES
  assert summary["choices"][autotune.STEP_FUSION] in autotune.MEASURED_FUSIONS
  assert summary["choices"][autotune.EVAL_FUSION] in autotune.MEASURED_FUSIONS
  assert autotune.read(os.path.join(wd, autotune.FILE)) == chosen
  machine = autotune.read(autotune.default_cache_file())
  assert {k: machine[k] for k in chosen} == chosen


def test_the_measurement_of_a_language_model_is_logged_in_tokens_per_second(tmp_path, caplog):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"), "smoke")
  c.train.stage_program = "per_epoch"
  c.train.step_fusion = c.train.eval_fusion = "same"
  c.train.steps_per_call, c.mesh.num_devices = 0, 1
  per_call = {1: 2.0, 8: 1.0}
  with caplog.at_level(logging.INFO):
    got = autotune.choose(c, (c.data.seq_len,), lambda cfg: cfg, mode="measure",
                          cache_file=str(tmp_path / "machine.json"),
                          measure=each(lambda cfg: per_call[cfg.train.steps_per_call]))
  assert got == {"train.steps_per_call": 8}
  b, l = c.train.batch_size, c.data.seq_len
  assert (f"train.steps_per_call: 8 measured (1 {b * l / 2.0:,.0f} tokens/s, "
          f"8 {b * l / 1.0:,.0f} tokens/s)") in caplog.text
  assert "img/s" not in caplog.text


def test_the_evaluation_options_are_timed_on_the_evaluation_and_remembered(tmp_path, caplog):
  c = helpers.small_config(stage_program="per_epoch", step_fusion="same")
  assert [t.path for t in autotune.pending(c)] == [autotune.EVAL_FUSION]
  per_example = {"same": 4e-6, "no_ynn": 1e-6, "onednn": 2e-6}
  timed = []

  def measure_eval(steps):
    timed.append(steps.config.train.eval_fusion)
    return per_example[timed[-1]]

  build, measure, calls = _fake({})
  cache = str(tmp_path / "machine.json")
  with caplog.at_level(logging.INFO):
    got = autotune.choose(c, MNIST, build, mode="measure", cache_file=cache, measure=measure,
                          measure_eval=each(measure_eval))
  assert got == {autotune.EVAL_FUSION: "no_ynn"} and not calls  # no train step timed
  assert sorted(timed) == sorted(autotune.MEASURED_FUSIONS)
  assert ("train.eval_fusion: 'no_ynn' measured ('same' 250,000 img/s, 'no_ynn' "
          "1,000,000 img/s, 'onednn' 500,000 img/s)") in caplog.text
  # The evaluation batch is part of what the choice depends on; the train batch too.
  key = autotune.machine_key(c, MNIST, autotune.EVAL_FUSION)
  assert json.load(open(cache)) == {key: "no_ynn"}
  assert json.loads(key)["eval_batch"] == c.train.eval_batch_size
  c.train.eval_batch_size //= 2
  assert autotune.machine_key(c, MNIST, autotune.EVAL_FUSION) != key
  # The rule: the train step's options, nothing timed.
  timed.clear()
  ruled = autotune.choose(c, MNIST, build, mode="rules", cache_file=cache, measure=measure,
                          measure_eval=each(measure_eval))
  assert ruled == {autotune.EVAL_FUSION: "same"} and not timed


def test_the_train_step_options_are_timed_on_the_train_step_of_an_mlp_only(tmp_path):
  timed = []

  def measure(steps):
    timed.append(steps.config.train.step_fusion)
    return {"same": 2.0, "no_ynn": 1.0, "onednn": 3.0}[timed[-1]]

  build, cache = (lambda cfg: types.SimpleNamespace(config=cfg)), str(tmp_path / "machine.json")
  mlp = helpers.small_config(stage_program="per_epoch", eval_fusion="same")
  got = autotune.choose(mlp, MNIST, build, mode="measure", cache_file=cache,
                        measure=each(measure), measure_eval=None)
  assert got == {autotune.STEP_FUSION: "no_ynn"}
  assert sorted(timed) == sorted(autotune.MEASURED_FUSIONS)
  # A convolution-heavy backbone's flags are the process's (train.cpu_fusion): not timed here.
  timed.clear()
  vgg = helpers.small_config("cifar10", width=4, stage_program="per_epoch", eval_fusion="same")
  vgg.model.conv_impl = "xla"
  got = autotune.choose(vgg, (32, 32, 3), build, mode="measure", cache_file=cache,
                        measure=each(measure), measure_eval=None)
  assert got == {autotune.STEP_FUSION: "same"} and not timed


def test_each_evaluation_option_compiles_with_its_options_and_evaluates_the_same(monkeypatch):
  """The options reach XLA (without YNNPACK fusions the compiled MLP evaluation has none,
  with XLA's defaults of the pinned jax it has), the timing runs, and the results agree: the
  same predictions, and the mean NLL to float32 round-off in another order: each example's
  goes through dots of length at most d = 784 and the mean sums n of them, so each of the
  two computations is within (d + n) * 2^-24 of the exact one, relative to the magnitudes.
  The tests' process compiles with XLA:CPU's older emitters (tests/conftest.py), so the
  MLIR fusion emitters of a run's "same" are compared too, as one more option."""
  monkeypatch.setitem(autotune.programs.FUSIONS, "fusion_emitters", helpers.RUN_EMITTERS)
  ds = helpers.synthetic_dataset(n_train=64, n_test=300)
  results, texts = {}, {}
  for value in autotune.programs.FUSIONS:
    c = helpers.small_config(width=16, eval_batch_size=128, eval_fusion=value)
    method, steps = helpers.make_steps(c, ds)
    learner = population.stack([helpers.init(method)])
    acc, nll = steps.evaluate(learner, "test", np.arange(300))
    results[value] = (acc, nll)
    batch = steps.programs.timing_eval_batch(1)
    program = steps.programs.eval_fn(learner, False, batch)
    texts[value] = program.jitted.lower(learner.params, learner.model_state, steps.programs.data,
                                        batch).compile().as_text()
    assert autotune.time_evaluations({value: steps})[value] > 0
  for ynn, none in (("same", "no_ynn"), ("elemental", "elemental_no_ynn")):
    assert "ynn_fusion" in texts[ynn] and "ynn_fusion" not in texts[none]
  d, n, u = 784, 300, 2.0**-24
  for value, (acc, nll) in results.items():
    np.testing.assert_array_equal(acc, results["same"][0], err_msg=value)
    np.testing.assert_allclose(nll, results["same"][1], rtol=2 * (d + n) * u, atol=0,
                               err_msg=value)


def test_the_options_offered_are_those_this_xla_knows(monkeypatch):
  """The pinned jaxlib knows every option of `FUSIONS`; one that XLA does not know (a jaxlib
  that dropped it) is not a candidate, and a change of the options offered changes the key of a
  remembered choice (a new option is measured again)."""
  c = helpers.small_config(stage_program="per_epoch")
  key = autotune.machine_key(c, MNIST, autotune.STEP_FUSION)
  assert all(autotune.programs.accepts(v) for v in autotune.programs.FUSIONS)
  assert autotune.step_fusion_candidates(c) == autotune.MEASURED_FUSIONS
  monkeypatch.setitem(autotune.programs.FUSIONS, "unknown", {"xla_cpu_no_such_option": True})
  monkeypatch.setattr(autotune, "MEASURED_FUSIONS", autotune.MEASURED_FUSIONS + ("unknown",))
  assert autotune.step_fusion_candidates(c) == autotune.eval_fusion_candidates(c)
  assert autotune.eval_fusion_candidates(c) == ("same", "no_ynn", "onednn")
  assert autotune.machine_key(c, MNIST, autotune.STEP_FUSION) != key


@pytest.mark.parametrize("kind, evaluates", [("train", False), ("stage", False),
                                             ("scan fit", False), ("eval", True),
                                             ("eval_shared", True), ("reduce score", True)])
def test_each_program_kind_gets_the_options_of_what_it_does(kind, evaluates):
  """Programs that only evaluate take train.eval_fusion's options, the others
  train.step_fusion's: here no YNNPACK fusion for one and XLA's defaults (with YNNPACK
  fusions, in the pinned jax) for the other."""
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  c = helpers.small_config(step_fusion="same", eval_fusion="no_ynn")
  if not evaluates:
    c.train.step_fusion, c.train.eval_fusion = "no_ynn", "same"
  args = helpers.gathered_dot_args()
  program = _gathered_dot_program(helpers.make_steps(c, ds)[1].programs, kind)
  assert "ynn_fusion" not in program.jitted.lower(*args).compile().as_text()
  c.train.step_fusion = c.train.eval_fusion = "same"
  same = _gathered_dot_program(helpers.make_steps(c, ds)[1].programs, kind)
  assert "ynn_fusion" in same.jitted.lower(*args).compile().as_text()


def _gathered_dot_program(programs, kind: str):
  """The run's program of kind `kind` for `helpers.gathered_dot`."""
  rep = programs.layout.replicated
  return programs.program((kind, (), 1), lambda: helpers.gathered_dot,
                          lambda: ((rep, rep, rep), rep))


@pytest.mark.parametrize("kind, once", [("train", False), ("eval", False), ("scan fit", True),
                                        ("reduce score", True)])
def test_the_passes_that_growth_runs_get_the_options_of_programs_that_run_once(
    kind, once, monkeypatch):
  """A pass over data (a growth's fit or score, a probe) runs about once per structure: its
  program takes `executables.ONCE_OPTIONS` on top of its kind's (here made the option that
  keeps YNNPACK's fusions out, visible in the compiled text)."""
  monkeypatch.setattr(executables, "ONCE_OPTIONS", {"xla_cpu_experimental_ynn_fusion_type": ""})
  monkeypatch.setattr(executables, "_refused", [])
  c = helpers.small_config(step_fusion="same", eval_fusion="same")
  programs = helpers.make_steps(c, helpers.synthetic_dataset(n_train=64, n_test=16))[1].programs
  program = _gathered_dot_program(programs, kind)
  text = program.top_jitted().lower(*helpers.gathered_dot_args()).compile().as_text()
  assert ("ynn_fusion" not in text) == once


@pytest.mark.parametrize("dataset,method,model,stage,rule,measured", [
    ("mnist", "gmoe", "mlp", "auto", 8, True),  # an MLP trained call by call: short steps
    ("mnist", "sm", "mlp", "per_epoch", 8, True),
    ("mnist", "sm", "mlp", "auto", 1, False),  # the whole stage is one program: no calls
    ("cifar10", "gmoe", "vgg", "auto", 1, False),  # convolution-heavy steps dwarf a launch
    ("tiny_shakespeare", "lm_sm", "switch", "per_epoch", 1, True),  # text: steps of any size
])
def test_the_steps_per_call_rule_and_candidates_on_a_cpu(dataset, method, model, stage, rule,
                                                          measured):
  c = config_lib.base_config(dataset, method)
  c.model.name, c.train.stage_program = model, stage
  assert jax.default_backend() == "cpu" and c.train.steps_per_call == 0  # chosen by default
  assert autotune.steps_per_call_rule(c) == rule
  # Where nothing is measured the rule's answer is the one candidate: no program is compiled.
  assert autotune.steps_per_call_candidates(c) == ((1, 8) if measured else (rule,))


def test_a_method_field_decided_by_rule_is_keyed_at_the_rule_s_value(monkeypatch):
  # gMoE's slots: `auto` keys the machine's choices as the slots it takes, so those measured
  # at `pow2` (the default before `auto`) serve the same step on a CPU.
  c = validation.complete(config_lib.base_config("mnist", "gmoe"))
  pow2 = autotune.with_choices(c, {"method.slots": "pow2"})
  planned = autotune.with_choices(c, {"method.slots": "planned"})
  key = lambda cfg: autotune.machine_key(cfg, MNIST, "train.steps_per_call")  # pylint: disable=unnecessary-lambda-assignment
  assert c.method.slots == "auto" and key(c) == key(pow2) != key(planned)
  monkeypatch.setattr(autotune.gmoe.jax, "default_backend", lambda: "gpu")
  p4 = validation.complete(alma_jax.load_config("bench/p4_mnist_gmoe"))
  assert key(p4) == key(autotune.with_choices(p4, {"method.slots": "planned"}))
