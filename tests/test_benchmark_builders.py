"""The benchmarks that build a run's train step themselves (benchmarks/train_speed.py, which
benchmarks/torch_reference.py uses, and benchmarks/ensemble_strategy.py) build it from a
config whose open fields the rules decide."""

import importlib.util
import os
import sys

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # they import their neighbours
  try:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  finally:
    sys.path.remove(os.path.join(ROOT, "benchmarks"))


def test_train_speed_builds_and_times_a_row_s_train_call():
  trainer = _load("train_speed").make_trainer("mlp4_sm", 16, jax, np)
  compile_s, first_s = trainer.warm_up()
  assert compile_s > 0 and first_s > 0 and trainer.run(2) > 0
  assert trainer.steps_per_call == trainer.steps.steps_per_call >= 1


def test_ensemble_strategy_builds_the_steps_of_a_setting():
  method, steps = _load("ensemble_strategy").make_steps("mlp", 4, "ens", 2, "vmap")
  assert method.name == "ens" and steps.steps_per_call >= 1
