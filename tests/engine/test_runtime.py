"""Tests of the process-level tuning and the timing breakdown."""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax.engine import timing
from tests import helpers

ROOT = helpers.ROOT


def _apply_in_subprocess(env_value):
  env = dict(os.environ)
  env.pop("ALMA_JAX_MALLOC_TUNING", None)
  if env_value is not None:
    env["ALMA_JAX_MALLOC_TUNING"] = env_value
  code = "from alma_jax.tuning import cpu_tuning; print(cpu_tuning.apply(), cpu_tuning.is_applied())"
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, check=True)
  return proc.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tuning is Linux-only")
def test_allocator_tuning_applies_and_can_be_turned_off():
  assert _apply_in_subprocess(None) == ["True", "True"]
  assert _apply_in_subprocess("0") == ["False", "False"]


@pytest.mark.parametrize("value, refused", [("0", False), ("1", False), ("", False),
                                             ("off", True)])
def test_the_allocator_s_environment_variable_is_0_1_or_unset(value, refused, monkeypatch):
  from alma_jax.tuning import cpu_tuning  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("ALMA_JAX_MALLOC_TUNING", value)
  if not refused:
    cpu_tuning.check_env()
    return
  with pytest.raises(ValueError, match=r"^ALMA_JAX_MALLOC_TUNING='off' in the environment: "
                                       r"allowed values '0' \(glibc's defaults, whatever "
                                       r"train\.cpu_allocator says\) and '1' or unset"):
    cpu_tuning.check_env()


def test_breakdown_moves_compilation_out_of_the_timed_part():
  bd = timing.Breakdown()

  @jax.jit
  def f(x):
    for _ in range(20):
      x = jnp.sin(x) @ x
    return x

  with bd("train_s"):
    f(jnp.ones((8, 8))).block_until_ready()  # compiles
  first = bd.as_dict()
  assert first["compile_s"] > 0
  with bd("train_s"):
    time.sleep(0.05)
    f(jnp.ones((8, 8))).block_until_ready()  # cached: no compilation
  second = bd.as_dict()
  assert second["compile_s"] == pytest.approx(first["compile_s"])
  assert second["train_s"] - first["train_s"] >= 0.05
  assert second["eval_s"] == 0 and second["io_s"] == 0


def test_breakdown_rejects_unknown_parts_and_adds_stage_times():
  bd = timing.Breakdown()
  with pytest.raises(ValueError, match="unknown timing part 'gpu_s'"):
    with bd("gpu_s"):
      pass
  bd.add({"train_s": 1.5, "eval_s": 0.5, "not_a_part": 9.0})
  d = bd.as_dict()
  assert d["train_s"] == 1.5 and d["eval_s"] == 0.5 and "not_a_part" not in d


def test_process_age_is_positive_and_grows():
  a = timing.process_age_s()
  if a is None:
    pytest.skip("no /proc on this system")
  time.sleep(0.02)
  assert 0 < a <= timing.process_age_s()


@pytest.mark.parametrize("call_s, calls_per_group", [(2.0**-10, 52), (0.25, 1)])
def test_a_timing_groups_short_calls_to_last_long_enough(monkeypatch, call_s, calls_per_group):
  """On a clock that each call moves by `call_s` (powers of two: the clock's sums are exact):
  the compiling call is not timed, the next call sets a group's size to last MIN_TIMED_S
  (0.05 s: 52 calls of 2^-10 s; one call of 0.25 s), and the result is per call."""
  assert timing.MIN_TIMED_S == 0.05
  clock = {"now": 0.0, "calls": 0}
  monkeypatch.setattr(timing.time, "monotonic", lambda: clock["now"])

  def call():
    clock["now"] += call_s * (10 if clock["calls"] == 0 else 1)  # the first call compiles
    clock["calls"] += 1
    return np.zeros(())

  assert timing.alternate({"c": call}, rounds=3) == {"c": pytest.approx(call_s, rel=1e-9)}
  assert clock["calls"] == 1 + 1 + 3 * calls_per_group


def test_candidates_are_timed_in_turns_each_round_reversing_the_order(monkeypatch):
  """Each candidate compiles and sizes its group first (a: one call of 0.25 s lasts
  min_group_s = 0.2 s; b: two of 0.125 s); then every round times one group of each, in
  reverse order every other round, and each figure is the median of its rounds per call
  (durations are powers of two: the clock's sums are exact)."""
  clock, log = {"now": 0.0}, []
  monkeypatch.setattr(timing.time, "monotonic", lambda: clock["now"])
  durations = {"a": [0.25, 0.25, 0.5, 0.25, 1.0],
               "b": [0.125, 0.125, 0.125, 0.125, 0.25, 0.25, 0.125, 0.375]}

  def candidate(name):
    def call():
      clock["now"] += durations[name][sum(1 for n in log if n == name)]
      log.append(name)
    return call

  got = timing.alternate({"a": candidate("a"), "b": candidate("b")}, rounds=3, min_group_s=0.2)
  assert log == ["a", "a", "b", "b"] + ["a", "b", "b"] + ["b", "b", "a"] + ["a", "b", "b"]
  assert got == {"a": 0.5, "b": 0.25}  # medians of (0.5, 0.25, 1.0) and (0.125, 0.25, 0.25)


def test_timing_a_step_builds_the_step_s_programs_alone():
  # The timed call's keys are made on the host: the call builds the train step and its
  # start state, no eager operation of its own.
  names = helpers.compiled_in_a_new_process("""
      from alma_jax.engine import population
      ds = helpers.synthetic_dataset(n_train=64, n_test=16)
      _, steps = helpers.make_steps(helpers.small_config(width=9, batch_size=16), ds)
      learner = population.initial(steps.method, population.keys([0]), steps.programs.place)
  """, """
      assert steps.seconds_per_step(learner, repeats=1) > 0
  """)
  assert "jit(alma_step_train)" in names and all(n.startswith("jit(alma_") for n in names), names
