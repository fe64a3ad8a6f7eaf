"""Tests of the process's XLA:CPU fusion flags chosen before JAX starts (alma_jax/tuning/cpu_fusion.py)."""

import json
import logging
import os
import subprocess
import sys
import threading

import pytest

from alma_jax.configuration import config_lib
from alma_jax.kernels import native
from alma_jax.models import conv
from alma_jax.runtime import caches
from alma_jax.stream import validation
from alma_jax.tuning import autotune
from alma_jax.tuning import cpu_fusion
from tests import helpers

CIFAR = validation.KNOWN_SHAPES["cifar10"]


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")


def _vgg(**fields):
  c = config_lib.base_config("cifar10", "sm")
  c.model.width = 4
  c.train.stage_program = "per_epoch"  # (the measured fields are what these tests are about)
  c.train.step_fusion = c.train.eval_fusion = "same"
  for k, v in fields.items():
    section, name = k.split("__")
    c[section][name] = v
  return c


def _fake(seconds: dict, fails=lambda setting: None):
  """measure(...) whose 'seconds per step' is seconds[(setting, impl)] and whose child of
  `setting` fails where `fails(setting)` gives why; `calls` records the settings measured."""
  calls = []

  def measure(config, input_shape, num_classes, settings, impls):
    assert (tuple(input_shape), num_classes) == CIFAR
    times, failed = {}, {}
    for setting in settings:
      calls.append((setting, tuple(impls)))
      if fails(setting):
        failed[setting] = fails(setting)
        continue
      times.update({(setting, i): seconds[(setting, i)] for i in impls})
    return times, failed

  return measure, calls


def _choose(config, workdir=None, *, multiprocess=False, **kwargs):
  return cpu_fusion.choose(config, workdir, shapes=CIFAR, multiprocess=multiprocess, **kwargs)


def test_a_run_waits_for_the_measurement_another_process_is_making(tmp_path, caplog):
  # While another process of the machine measures the same choice (it holds the choice's
  # lock), a run waits, then takes the remembered answer without starting children.
  caplog.set_level(logging.INFO)
  c = _vgg()
  measure, calls = _fake({})
  cache = str(tmp_path / "machine.json")
  key = cpu_fusion.process_key(c, CIFAR[0])
  got = []
  with caches.exclusive(autotune.lock_file(cache, key), "the test"):
    waiting = threading.Thread(target=lambda: got.append(_choose(c, cache_file=cache,
                                                                 measure=measure)))
    waiting.start()
    helpers.wait_for_log(caplog, "waiting for the measurement of train.cpu_fusion")
    autotune.remember(cache, key, "onednn")  # what the other process measured
  waiting.join(30)
  assert got == [("onednn", f"measured earlier on this machine ({cache})")] and not calls
  assert cpu_fusion.decision(c, CIFAR[0]) == (key, "onednn")


def test_the_fastest_pair_is_chosen_remembered_and_given_to_the_run(tmp_path, caplog,
                                                                   monkeypatch):
  monkeypatch.setattr(conv, "candidates", lambda backend=None: ("xla", "chunked_dw"))
  c = _vgg()
  measure, calls = _fake({("none", "xla"): 4.0, ("none", "chunked_dw"): 3.0,
                          ("ynn", "xla"): 2.0, ("ynn", "chunked_dw"): 2.5,
                          ("onednn", "xla"): 3.2, ("onednn", "chunked_dw"): 3.2,
                          ("ynn_onednn", "xla"): 2.0, ("ynn_onednn", "chunked_dw"): 4.0})
  cache = str(tmp_path / "machine.json")
  value, how = _choose(c, cache_file=cache, measure=measure)
  # A tie keeps the first setting measured (ynn before ynn_onednn).
  assert value == "ynn" and calls == [(s, ("xla", "chunked_dw")) for s in cpu_fusion.SETTINGS]
  assert how == ("measured in child processes (none/xla 32 img/s, none/chunked_dw 43 img/s, "
                 "ynn/xla 64 img/s, ynn/chunked_dw 51 img/s, onednn/xla 40 img/s, "
                 "onednn/chunked_dw 40 img/s, ynn_onednn/xla 64 img/s, "
                 "ynn_onednn/chunked_dw 32 img/s)")
  key = cpu_fusion.process_key(c, CIFAR[0])
  assert json.load(open(cache)) == {key: "ynn"}
  assert cpu_fusion.decision(c, CIFAR[0]) == (key, "ynn")
  assert cpu_fusion.decision(_vgg(model__width=8), CIFAR[0]) is None  # another config
  # The run's own choice of the convolution gradient takes the pair's, without measuring.
  def no_measure(_):
    raise AssertionError("measured again")
  with caplog.at_level(logging.INFO):
    got = autotune.choose(c, CIFAR[0], lambda cfg: cfg, mode="measure", cache_file=cache,
                          measure=no_measure, given=cpu_fusion.measured_with_flags())
  # (a convolution-heavy step's steps per call: the rule's one candidate, nothing measured)
  assert got == {"model.conv_impl": "xla", "train.steps_per_call": 1}
  assert "model.conv_impl: 'xla' measured with train.cpu_fusion in child processes" in caplog.text
  # The machine's record spares the measurement; a workdir's record wins over it.
  calls.clear()
  assert _choose(c, cache_file=cache, measure=measure)[0] == "ynn" and not calls
  assert cpu_fusion.measured_with_flags() == {}  # nothing measured this time
  os.makedirs(tmp_path / "wd")
  autotune.remember(str(tmp_path / "wd" / autotune.FILE), key, "none")
  value, how = _choose(c, str(tmp_path / "wd"), cache_file=cache, measure=measure)
  assert (value, how.split(" ")[0]) == ("none", "kept") and not calls


@pytest.mark.parametrize("config, multiprocess, env, expected", [
    (dict(train__cpu_fusion="ynn"), False, {}, ("ynn", "set in the config")),
    (dict(train__cpu_fusion="none"), False, {}, ("none", "set in the config")),
    (dict(train__autotune="rules"), False, {}, ("none", "by rule")),
    (dict(), True, {}, ("none", "by rule (a run of several processes)")),
    (dict(model__name="mlp"), False, {}, ("none", "by rule (not a convolution-heavy backbone "
                                               "on a known image data set)")),
    (dict(), False, {"JAX_PLATFORMS": "cuda,cpu"},
     ("none", "by rule (an accelerator backend is expected)")),
    (dict(), False, {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"},
     (cpu_fusion.KEEP_ENV, "set in XLA_FLAGS (--xla_cpu_experimental_ynn_fusion_type=dot)")),
    (dict(), False, {"XLA_FLAGS": "--xla_cpu_use_onednn=false"},
     (cpu_fusion.KEEP_ENV, "set in XLA_FLAGS (--xla_cpu_use_onednn=false)")),
])
def test_settings_and_rules_measure_nothing(tmp_path, monkeypatch, config, multiprocess, env,
                                            expected):
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  measure, calls = _fake({})
  got = _choose(_vgg(**config), multiprocess=multiprocess, cache_file=str(tmp_path / "m.json"),
                measure=measure)
  assert got == expected and not calls
  assert not os.path.exists(tmp_path / "m.json")


def test_a_setting_whose_child_fails_is_left_out(tmp_path, caplog):
  measure, _ = _fake({("none", "xla"): 2.0, ("ynn", "xla"): 4.0},
                     # e.g. a jaxlib that does not know the flag
                     lambda s: "onednn" in s and "the child process exited with -6: Unknown flag")
  c = _vgg(model__conv_impl="xla")
  value, how = _choose(c, cache_file=str(tmp_path / "m.json"), measure=measure)
  assert value == "none"
  assert how == ("measured in child processes (none/xla 64 img/s, ynn/xla 32 img/s, "
                 "onednn failed, ynn_onednn failed)")
  assert "train.cpu_fusion=onednn could not be timed" in caplog.text


@pytest.mark.parametrize("when", ["starting", "timing"])
def test_a_failing_child_leaves_the_choice_to_the_rule(tmp_path, caplog, when):
  """The rule's child fails to start, or a child fails while the settings are timed."""
  if when == "starting":
    measure, _ = _fake({}, lambda s: "the child process exited with 1: boom")
  else:
    def measure(*args):
      raise RuntimeError("the child process exited with 1: boom")
  cache = str(tmp_path / "m.json")
  got = _choose(_vgg(), cache_file=cache, measure=measure)
  assert got == ("none", "by rule (a child process failed)")
  assert "could not be timed (the child process exited with 1: boom)" in caplog.text
  assert not os.path.exists(cache) and cpu_fusion.decision(_vgg(), CIFAR[0]) is None


def test_flags_keep_the_others_and_apply_sets_the_environment(monkeypatch):
  other = "--xla_cpu_enable_fast_math=false"
  assert cpu_fusion.flags_with("ynn", other) == f"{other} {cpu_fusion.FLAG}"
  assert cpu_fusion.flags_with("none", f"{cpu_fusion.FLAG} {other}") == other
  assert cpu_fusion.flags_with("ynn", f"{cpu_fusion.FLAG} {other}") == f"{other} {cpu_fusion.FLAG}"
  cpu_fusion.apply("ynn")
  assert os.environ["XLA_FLAGS"] == f"{other} {cpu_fusion.FLAG}"
  cpu_fusion.apply(cpu_fusion.KEEP_ENV)
  assert os.environ["XLA_FLAGS"] == f"{other} {cpu_fusion.FLAG}"
  cpu_fusion.apply("none")
  assert os.environ["XLA_FLAGS"] == other
  both = f"{other} {cpu_fusion.FLAG} {cpu_fusion.ONEDNN_FLAG}"
  assert cpu_fusion.flags_with("ynn_onednn", other) == both
  assert cpu_fusion.flags_with("onednn", both) == f"{other} {cpu_fusion.ONEDNN_FLAG}"
  assert cpu_fusion.flags_with("none", f"--xla_cpu_use_onednn=false {other}") == other


_COUNT = ("import jax; from alma_jax.tuning import cpu_fusion; "
          "print(cpu_fusion.cpu_devices_expected()); print(jax.device_count())")


@pytest.mark.parametrize("env, expected", [
    ({}, 1),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=3 "
                   "--xla_force_host_platform_device_count=2"}, 2),
    ({"JAX_NUM_CPU_DEVICES": "5", "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}, 5),
], ids=["default", "last_flag", "jax_option"])
def test_the_cpu_devices_expected_before_the_backend_starts_are_those_it_starts(env, expected):
  """The count read from the options before JAX starts its backend is the count that the
  backend then has, in a process of its own."""
  proc = subprocess.run([sys.executable, "-c", _COUNT], capture_output=True, text=True,
                        check=False, timeout=120, cwd=helpers.ROOT,
                        env={**{k: v for k, v in os.environ.items()
                                if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")},
                             "JAX_PLATFORMS": "cpu", "PYTHONPATH": helpers.ROOT, **env})
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == [str(expected), str(expected)]


def test_no_cpu_devices_are_expected_where_an_accelerator_may_start(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  assert cpu_fusion.cpu_devices_expected() is None
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert cpu_fusion.cpu_devices_expected() == 8  # this process's option (tests/conftest.py)


# A whole run that applies a remembered choice: tests/test_main_e2e.py (the CIFAR run).
def test_children_time_the_real_step_with_their_flags_in_turns(monkeypatch):
  """One child per setting runs the real train step with its flags and every pair gets a
  time; a child that cannot build its step is a failed setting (the rule's: nothing more is
  started), and every child has ended when the measurement returns."""
  monkeypatch.setattr(autotune, "ROUNDS", 2)
  monkeypatch.setattr(autotune, "MIN_GROUP_S", 0.01)
  started = []
  child = cpu_fusion._Child  # pylint: disable=protected-access

  class Recorded(child):
    def __init__(self, *args):
      super().__init__(*args)
      started.append(self)

  monkeypatch.setattr(cpu_fusion, "_Child", Recorded)
  c = _vgg(train__batch_size=8)
  # onednn: this jaxlib knows the flag
  times, failed = cpu_fusion.measure_in_children(c, *CIFAR, ("ynn", "onednn"), ["xla"])
  assert failed == {} and set(times) == {("ynn", "xla"), ("onednn", "xla")}
  assert all(0 < t < 60 for t in times.values())
  assert [p._proc.returncode for p in started] == [0, 0]  # pylint: disable=protected-access
  times, failed = cpu_fusion.measure_in_children(c, *CIFAR, ("none", "ynn"), ["unknown"])
  assert times == {} and list(failed) == ["none"]  # the rule's child failed: nothing more
  assert failed["none"].startswith("the child process exited with 1: ")
  assert "unknown" in failed["none"]


@pytest.mark.parametrize("builds", [True, False])
def test_the_children_time_the_native_weight_gradient_where_it_builds(monkeypatch, tmp_path,
                                                                      builds):
  # Decided before JAX starts its backend: the availability is asked for XLA:CPU by name.
  asked = []

  def available(backend=None):
    asked.append(backend)
    return (True, "") if builds else (False, "no C++ compiler found")

  monkeypatch.setattr(native, "available", available)
  seconds = {(s, i): 1.0 for s in cpu_fusion.SETTINGS for i in conv.IMPLS}
  seconds[("none", "native_dw")] = 0.5
  measure, calls = _fake(seconds)
  value, _ = _choose(_vgg(), cache_file=str(tmp_path / "machine.json"), measure=measure)
  impls = ("xla", "chunked_dw", "native_dw", "native") if builds else ("xla", "chunked_dw")
  assert asked == ["cpu"] and {c[1] for c in calls} == {impls}
  assert value == "none"
  assert cpu_fusion.measured_with_flags()["model.conv_impl"][0] == (
      "native_dw" if builds else "xla")
