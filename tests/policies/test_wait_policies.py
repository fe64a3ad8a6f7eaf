"""Tests of the waiting policies `geometric` and `triggered` (alma_jax/policies/)."""

import math
import signal
import types

import numpy as np
import pytest

from alma_jax import methods
from alma_jax import policies
from alma_jax.configuration import config_lib
from alma_jax.data import images
from alma_jax.data import stream as stream_lib
from alma_jax.engine.metrics import Log, Record
from alma_jax.errors import ConfigError
from alma_jax.outputs import io_utils
from alma_jax.policies import geometric
from alma_jax.policies.geometric import geometric_times
from alma_jax.state import RunState
from alma_jax.stream import run
from alma_jax.stream import run_setup
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist, requires_text
from tests.data.test_text import smoke as text_smoke


# -- geometric -------------------------------------------------------------------------------------
def test_geometric_times_are_the_distinct_ceilings_of_w0_r_to_the_k():
  assert geometric_times(20, 1.0, 2.0) == [1, 2, 4, 8, 16]
  # 10 * 1.1 is 11.000000000000002 in floats: still 11; 10 * 1.21 = 12.1 -> 13.
  assert geometric_times(16, 10.0, 1.1) == [10, 11, 13, 14, 15]
  assert geometric_times(5, 1.0, 1.1) == [1, 2, 3, 4, 5]  # repeated ceilings train once
  assert geometric_times(100, 3.0, 3.0) == [3, 9, 27, 81]


def _geometric_times_one_k_at_a_time(b, w0, r):
  """The times as they were first computed: every k in turn."""
  times, k = [], 0
  while True:
    t = math.ceil(round(w0 * r**k, geometric.ROUND_DIGITS))
    if t > b:
      return times
    if not times or t > times[-1]:
      times.append(t)
    k += 1


@pytest.mark.parametrize("b", [1, 7, 20, 100, 1000])
@pytest.mark.parametrize("w0", [1.0, 1.5, 2.0, 3.0, 10.0, 7.3])
@pytest.mark.parametrize("r", [1.001, 1.01, 1.05, 1.1, 1.21, 1.5, 2.0, 3.0, 10.0, 1000.0])
def test_geometric_times_are_those_of_every_k_in_turn(b, w0, r):
  assert geometric_times(b, w0, r) == _geometric_times_one_k_at_a_time(b, w0, r)


def test_a_ratio_close_to_one_gives_its_times_at_once():
  def too_long(*_):
    raise TimeoutError("geometric_times took more than 10 s")

  old = signal.signal(signal.SIGALRM, too_long)
  signal.alarm(10)
  try:
    assert geometric_times(1000, 1.0, 1.0000000001) == list(range(1, 1001))
    assert geometric_times(50, 2.0, 1.0 + 2**-52) == list(range(2, 51))
    assert geometric_times(10**6, 1.0, 1e300) == [1]  # the next power overflows: past B
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_geometric_policy_trains_at_its_times_and_records_why():
  c = helpers.small_config("mnist")
  c.stream.num_megabatches, c.stream.wait_policy = 20, "geometric"
  c.stream.geometric_w0, c.stream.geometric_ratio = 1.5, 2.0
  wait = policies.make_wait(validation.validate(c))
  assert wait.planned_times(20) == [2, 3, 6, 12]  # ceil(1.5, 3, 6, 12); 24 > 20
  assert [t for t in range(1, 21) if wait.trains_at(t, None)] == [2, 3, 6, 12]
  probe = types.SimpleNamespace(num_seeds=1)
  d = wait.decide(6, None, probe)
  assert d.train and d.fields == ({"wait_decision": "trained",
                                   "wait_reason": "scheduled: stage 3 of 4"},)
  d = wait.decide(7, None, probe)
  assert not d.train and d.fields[0]["wait_reason"] == "waiting for t=12"
  assert wait.decide(13, None, probe).fields[0]["wait_reason"] == "no stage left before B"


BAD_FIELDS = [
    ({"stream.geometric_w0": 0.5}, r"config\.stream\.geometric_w0=0\.5 must be in \[1\.0, inf\)"),
    ({"stream.geometric_ratio": 1.0},
     r"config\.stream\.geometric_ratio=1\.0 must be in \(1\.0, inf\)"),
    ({"stream.geometric_w0": 5.0},
     r"config\.stream\.geometric_w0=5\.0 is after the last time step \(config\.stream\."
     r"num_megabatches=4\).*allowed values: \[1, 4\]"),
    ({"stream.wait": 2},
     r"config\.stream\.wait=2 is read only by config\.stream\.wait_policy='fixed', not "
     r"'geometric'; leave it at 1"),
    ({"stream.trigger_margin": 0.1},
     r"config\.stream\.trigger_margin=0\.1 is read only by config\.stream\.wait_policy="
     r"triggered, not 'geometric'; set it, or leave the field at 0\.02"),
]


@pytest.mark.parametrize("fields,message", BAD_FIELDS)
def test_bad_geometric_fields_are_one_line_errors_naming_the_field(fields, message):
  c = helpers.smoke(stream__wait_policy="geometric")
  for path, value in fields.items():
    c.stream[path.split(".")[1]] = value
  with pytest.raises(ConfigError, match=message):
    validation.validate(c)


# -- triggered: the config -------------------------------------------------------------------------
BAD_TRIGGER_FIELDS = [
    ({"num_seeds": 2}, r"config\.stream\.wait_policy='triggered' decides each seed's training "
                       r"times .* set config\.num_seeds=1 \(one run per seed\), not 2"),
    ({"stream.trigger_fraction": 0.0},
     r"config\.stream\.trigger_fraction=0\.0 must be in \(0\.0, 1\.0\]"),
    ({"stream.trigger_margin": -0.1},
     r"config\.stream\.trigger_margin=-0\.1 must be in \[0\.0, 1\.0\]"),
    ({"stream.trigger_min_wait": 3, "stream.trigger_max_wait": 2},
     r"config\.stream\.trigger_max_wait=2 is below config\.stream\.trigger_min_wait=3; "
     r"allowed values: 0 \(no maximum\) or >= 3"),
    ({"stream.trigger_min_wait": 5}, r"config\.stream\.trigger_min_wait=5 is after the last "
                                     r"time step"),
    ({"stream.geometric_ratio": 3.0}, r"config\.stream\.geometric_ratio=3\.0 is read only by "
                                      r"config\.stream\.wait_policy=geometric, not 'triggered'"),
]


@pytest.mark.parametrize("fields,message", BAD_TRIGGER_FIELDS)
def test_bad_triggered_fields_are_one_line_errors_naming_the_field(fields, message):
  c = helpers.smoke(stream__wait_policy="triggered")
  for path, value in fields.items():
    node, leaf = (c.stream, path.split(".")[1]) if "." in path else (c, path)
    node[leaf] = value
  with pytest.raises(ConfigError, match=message):
    validation.validate(c)


def test_the_fixed_wait_refuses_the_other_policies_fields():
  c = helpers.smoke(stream__trigger_min_wait=2)
  with pytest.raises(ConfigError, match=r"config\.stream\.trigger_min_wait=2 is read only by "
                                        r"config\.stream\.wait_policy=triggered, not 'fixed'"):
    validation.validate(c)


@requires_text
def test_the_iid_language_model_stream_needs_the_fixed_wait():
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"),
                                  "smoke,iid")
  c.stream.wait_policy = "geometric"
  with pytest.raises(ConfigError, match=r"config\.stream\.iid=True trains once, at t=B, on the "
                                        r"whole stream: it needs config\.stream\.wait_policy="
                                        r"'fixed', not 'geometric'"):
    validation.validate(c)


# -- triggered: the decision on a constructed stream (the evaluation stubbed) ----------------------
def _record(t, trained, **extra):
  return Record(t=t, test_error=0.5, num_params=1, train_flops=0.0, train_flops_forward=0.0,
                train_macs=0.0, growth_flops=0.0, growth_macs=0.0,
                inference_flops_per_example=0.0,
                trained=trained, wall_s=0.0, extra=extra)


class _Steps:
  """Stands for the compiled steps: evaluates to a given accuracy; counts its calls."""

  def __init__(self, accuracy):
    self.accuracy, self.calls = accuracy, []

  def evaluate(self, learner, split, idx):
    self.calls.append((split, idx.tolist()))
    return np.asarray([self.accuracy]), np.asarray([0.0])


def _decide(t, stages, accuracy, num_megabatches=8, **fields):
  """The triggered decision at `t` after training at `stages` (each with validation error
  0.25), on a stream of `num_megabatches` mega-batches of 9 training and 1 validation
  examples; the model's error on the new data is 1 - `accuracy`."""
  c = helpers.small_config("mnist")
  c.stream.num_megabatches, c.stream.wait_policy = num_megabatches, "triggered"
  for k, v in fields.items():
    c.stream[k] = v
  wait = policies.make_wait(validation.validate(c))
  stream = stream_lib.make_stream(10 * num_megabatches, num_megabatches, 0.1, 0)
  steps = _Steps(accuracy)
  setup = types.SimpleNamespace(
      seeds=[0], streams=[stream], steps=steps,
      megabatch_val_idx=lambda i, t: stream.val[t - 1],
      seed_flops=lambda learners: {"inference_per_example": 100.0,
                                   "inference_macs_per_example": 40.0})
  probe = run_setup.Setup.probe.fget(setup)  # the run's probe, over this stand-in set-up
  records = [_record(s, s in stages, **({"stage_val_error": 0.25} if s in stages else {}))
             for s in range(t)]
  state = RunState(logs=[Log.from_records(records)], learner=np.zeros((1, 1)))
  return wait.decide(t, state, probe), steps.calls, stream


def test_the_trigger_fires_when_the_new_data_s_error_exceeds_the_last_stage_s_by_the_margin():
  # Stage at 2, t=3: 9 of 27 examples unseen (1/3 < 0.5); error 0.5 > 0.25 + 0.125.
  d, calls, stream = _decide(3, {2}, accuracy=0.5, trigger_margin=0.125)
  assert d.train and calls == [("train", stream.val[2].tolist())]
  assert d.fields[0] == {"wait_gap": 1, "unseen_fraction": 1 / 3, "trigger_error": 0.5,
                         "trigger_reference": 0.25, "wait_decision": "trained",
                         "wait_reason": "new data's error 0.5000 > 0.2500 + margin 0.125"}
  # One validation example: 100 FLOPs and 40 multiply-adds of prediction.
  assert d.flops.tolist() == [100.0] and d.macs.tolist() == [40.0]


def test_the_trigger_does_not_fire_within_the_margin():
  # 0.25 + 0.25 = 0.5 exactly in binary floats: an error of 0.5 does not exceed it.
  d, calls, _ = _decide(3, {2}, accuracy=0.5, trigger_margin=0.25)
  assert not d.train and len(calls) == 1
  assert d.fields[0]["wait_reason"] == "new data's error 0.5000 <= 0.2500 + margin 0.25"
  d, _, _ = _decide(3, {2}, accuracy=0.8, trigger_margin=0.0)  # better than the reference
  assert not d.train


def test_the_unseen_fraction_trains_without_evaluating():
  # Stage at 2, t=4: 18 of 36 training examples unseen, exactly rho = 0.5.
  d, calls, _ = _decide(4, {2}, accuracy=1.0, trigger_margin=0.0)
  assert d.train and calls == [] and d.flops.tolist() == [0.0]
  assert d.fields[0]["wait_reason"] == "unseen fraction 0.5000 >= 0.5"
  d, calls, _ = _decide(1, set(), accuracy=1.0)  # before any stage everything is unseen
  assert d.train and calls == []


def test_the_minimum_and_maximum_waits_decide_without_evaluating():
  d, calls, _ = _decide(1, set(), accuracy=0.0, trigger_min_wait=2)
  assert not d.train and calls == [] and d.fields[0]["wait_reason"] == "minimum wait (1 < 2)"
  d, calls, _ = _decide(5, {4}, accuracy=0.0, trigger_min_wait=2)  # would fire on its error
  assert not d.train and calls == []
  d, calls, _ = _decide(7, {4}, accuracy=1.0, trigger_fraction=1.0, trigger_max_wait=3)
  assert d.train and calls == [] and d.fields[0]["wait_reason"] == "maximum wait (3 >= 3)"


def test_the_counts_plan_the_triggered_stages_for_the_training_estimate():
  c = helpers.small_config("mnist")
  c.stream.num_megabatches, c.stream.wait_policy = 20, "triggered"
  c.stream.trigger_fraction, c.stream.trigger_max_wait = 0.5, 6
  wait = policies.make_wait(validation.validate(c))
  assert wait.planned_times(20) == [1, 2, 4, 8, 14, 20]  # doubling, then every 6


# -- runs on a constructed stream ------------------------------------------------------------------
def _constructed(monkeypatch, shift_from):
  """Makes MNIST runs (B=4, the smoke stream of 2000 examples) read a synthetic data set whose
  class y brightens rows 2y, 2y+1; from mega-batch `shift_from` on (None: never) the labels
  are y + 5 mod 10, so a model trained before then errs on nearly every new example."""
  ds = helpers.synthetic_dataset(n_train=2000, n_test=500)
  y = ds.train_y.copy()
  if shift_from is not None:
    stream = stream_lib.make_stream(2000, 4, 0.1, 0)
    for t in range(shift_from, 5):
      for part in (stream.train[t - 1], stream.val[t - 1]):
        y[part] = (y[part] + 5) % 10
  data = images.ImageDataset(name="mnist", train_x=ds.train_x, train_y=y, test_x=ds.test_x,
                             test_y=ds.test_y, num_classes=10, mean=ds.mean, std=ds.std)
  monkeypatch.setattr(images, "load_image_dataset", lambda *a, **k: data)


def _triggered(**fields):
  # rho = 1: after the first stage only the error (or B) can call for a stage.
  return helpers.smoke(stream__wait_policy="triggered", stream__trigger_fraction=1.0,
                       data__train_subset=0, data__test_subset=0, train__epochs=4,
                       train__patience=4, checkpoint__enabled=False, log__tensorboard=False,
                       **fields)


@requires_mnist
def test_the_trigger_fires_when_the_labels_shift_and_not_on_a_stationary_stream(
    tmp_path, monkeypatch):
  # The first stage's validation error is about 0.6; stationary new data scores about as
  # well (at most ~0.5 here), shifted labels about 1.0: delta = 0.2 lies between the two.
  _constructed(monkeypatch, shift_from=None)
  run.run(_triggered(stream__trigger_margin=0.2), str(tmp_path / "stationary"))
  log = io_utils.read_jsonl(str(tmp_path / "stationary" / "log.jsonl"))
  assert [r["trained"] for r in log] == [False, True, False, False, False], log
  assert all(r["trigger_error"] <= r["trigger_reference"] + 0.2 for r in log[2:])
  _constructed(monkeypatch, shift_from=3)
  run.run(_triggered(stream__trigger_margin=0.2), str(tmp_path / "shifted"))
  log = io_utils.read_jsonl(str(tmp_path / "shifted" / "log.jsonl"))
  assert [r["trained"] for r in log][:4] == [False, True, False, True], log
  assert log[3]["trigger_error"] > log[3]["trigger_reference"] + 0.2
  assert log[3]["wait_reason"].startswith("new data's error")


@requires_mnist
def test_triggered_costs_are_a_geometric_run_s_plus_its_evaluations(tmp_path):
  # delta = 1 never fires on the error, rho = 0.5 trains at 1, 2, 4: geometric(1, 2)'s times.
  geo, trig = str(tmp_path / "geometric"), str(tmp_path / "triggered")
  run.run(helpers.smoke(stream__wait_policy="geometric"), geo)
  run.run(helpers.smoke(stream__wait_policy="triggered", stream__trigger_margin=1.0), trig)
  (g_log, g_sum, g_arch), (t_log, t_sum, t_arch) = helpers.outputs(geo), helpers.outputs(trig)
  assert [r["trained"] for r in t_log] == [False, True, True, False, True]
  assert t_arch == g_arch
  same = ("test_error", "num_params", "train_flops", "train_macs", "trained")
  assert [[r[k] for k in same] for r in t_log] == [[r[k] for k in same] for r in g_log]
  assert [r["wait_decision"] for r in g_log[1:]] == ["trained", "trained", "waited", "trained"]
  # t=3 evaluated the new mega-batch's 50 validation examples (2000 / 4 x 0.1), nothing else.
  assert [r["trigger_flops"] for r in t_log[1:]] == [0, 0, 50 * t_log[3][
      "inference_flops_per_example"], 0]
  extra = t_log[3]["trigger_flops"]
  assert t_sum["comp_trigger"] == extra and "comp_trigger" not in g_sum
  assert t_sum["comp"] == g_sum["comp"] + extra  # integers below 2^53: exact in floats
  assert t_sum["cer"] == g_sum["cer"] and t_sum["mem"] == g_sum["mem"]


# -- resume ----------------------------------------------------------------------------------------
@requires_mnist
@pytest.mark.parametrize("fields", [
    {"stream__wait_policy": "geometric", "stream__geometric_ratio": 3.0},
    {"stream__wait_policy": "triggered", "stream__trigger_margin": 0.0},
], ids=["geometric", "triggered"])
def test_waiting_policies_resume_mid_stream_to_identical_records(fields, tmp_path, monkeypatch):
  config = helpers.smoke(train__progress_every_s=0.0, **fields)
  base = str(tmp_path / "uninterrupted")
  run.run(config, base)
  expected = helpers.outputs(base)
  trained = [r["t"] for r in expected[0] if r["trained"]]
  waited = [r["t"] for r in expected[0][1:] if not r["trained"]]
  assert waited and len(trained) >= 2, expected[0]  # the stream has both kinds of steps
  wd = str(tmp_path / "interrupted")
  # After a waited step's record (its checkpoint is the last stage's: the step is decided
  # again), then inside the last stage (its save continues it).
  helpers.interrupt(config, wd, f"t={waited[0]}:log", monkeypatch)
  helpers.interrupt(config, wd, f"t={trained[-1]}:epoch", monkeypatch)
  run.run(config, wd)
  assert helpers.outputs(wd) == expected


# -- every method ----------------------------------------------------------------------------------
IMAGE_METHODS = [pytest.param(m, marks=requires_mnist)
                 for m in ("sm", "ens", "umix", "gens", "gmoe", "ff")]
LM_METHODS = [pytest.param(m, marks=requires_text) for m in ("lm_sm", "lm_ens", "lm_gens",
                                                             "lm_gmoe")]


@pytest.mark.parametrize("method", IMAGE_METHODS + LM_METHODS)
def test_every_method_runs_with_the_triggered_policy(method, tmp_path):
  if method.startswith("lm_"):
    c = text_smoke(method, checkpoint__enabled=True)  # (a small vocabulary)
    if "num_members" in c.method:
      c.method.num_members = 2
  else:
    c = helpers.smoke(method)
  c.stream.wait_policy, c.stream.trigger_margin = "triggered", 0.0
  run.run(c, str(tmp_path / "wd"))
  log = io_utils.read_jsonl(str(tmp_path / "wd" / "log.jsonl"))
  assert log[1]["trained"] and log[1]["wait_reason"].startswith("unseen fraction")
  assert all(r["wait_decision"] == ("trained" if r["trained"] else "waited") for r in log[1:])
  evaluated = [r for r in log if "trigger_error" in r]
  assert all(r["trigger_flops"] > 0 for r in evaluated)


def test_gmoe_grows_about_ten_times_over_the_stages_its_waiting_policy_plans():
  def period(**stream):
    c = helpers.small_config("mnist", "gmoe")
    c.stream.num_megabatches = 500
    for k, v in stream.items():
      c.stream[k] = v
    return methods.make(validation.validate(c), *validation.KNOWN_SHAPES["mnist"]).grow_period
  assert period(wait=10) == 5  # 50 stages
  assert period(wait_policy="geometric", geometric_ratio=1.05) == 8  # 86 stages
  assert period(wait_policy="geometric", geometric_ratio=1.2) == 3  # 31 stages
  # Triggered: the stages its counts call for (doubling up to 64, then every 50 mega-batches:
  # 15), whatever its error adds.
  assert period(wait_policy="triggered", trigger_max_wait=50) == 1
