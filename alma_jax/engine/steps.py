"""The compiled steps of a run, in one object: what the stage and the stream loop call.

`Steps` puts together the run's compiled programs and their cache
(`alma_jax.engine.programs`), the passes over data (`alma_jax.engine.passes`), the FLOP
counts (`alma_jax.engine.accounting`) and the timing of a train call
(`alma_jax.engine.timing`); each lives in its own module, and `Steps` only forwards
to them, so that callers hold one object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from alma_jax.engine import accounting
from alma_jax.engine import passes
from alma_jax.engine import programs as programs_lib
from alma_jax.engine import timing
from alma_jax.engine.epoch import StageOptions
from alma_jax.engine.programs import (STEPS_BOUND, Batch, TrainState, all_finite, step_counter,
                                    over_population)
from alma_jax.configuration import fields as F
from alma_jax.errors import ConfigError
from alma_jax.methods.base import Learner, Method

__all__ = ["Steps", "Batch", "TrainState", "STEPS_BOUND", "all_finite", "step_counter",
           "over_population"]
PyTree = Any


def _chosen(section, path: str):
  """A field that `alma_jax.tuning.tune` decides when it is left to be chosen (0 or "auto"):
  its value, which must be decided before the steps are built."""
  value = F.get(section, path)
  if value in (0, "auto"):
    raise ConfigError(f"config.{path}={value!r} is left to be chosen: decide it first "
                      "(alma_jax.tuning.tune.run_choices) or give a value")
  return value


class Steps:
  """The compiled steps of one run, cached per (kind, learner structure, population).

  Attributes:
    programs: the compiled programs and their one cache (`alma_jax.engine.programs.Programs`).
    passes: evaluation and the passes over data that growth runs (`alma_jax.engine.passes.Passes`).
    costs: the FLOPs of those passes (`alma_jax.engine.accounting.PassCosts`).
  """

  def __init__(self, method: Method, task, tx, data, mesh, *, batch_size: int,
               eval_batch_size: int, steps_per_call: int = 1, rules=None,
               compute_dtype: str = "float32", stage: StageOptions = StageOptions(),
               step_fusion: str = "same", eval_fusion: str = "same", l2_init: float = 0.0):
    self.programs = programs_lib.Programs(
        method, task, tx, data, mesh, batch_size=batch_size, eval_batch_size=eval_batch_size,
        steps_per_call=steps_per_call, rules=rules, compute_dtype=compute_dtype,
        step_fusion=step_fusion, eval_fusion=eval_fusion, l2_init=l2_init)
    p = self.programs
    self.method, self.task, self.tx, self.mesh, self.data = p.method, p.task, p.tx, p.mesh, p.data
    self.batch_size, self.eval_batch_size = p.batch_size, p.eval_batch_size
    self.steps_per_call = p.steps_per_call
    self.stage = stage  # what a training stage reads of the config (`alma_jax.engine.train`)
    # Seconds per training example of an epoch of the whole-stage program, as last measured
    # (`alma_jax.engine.train`: how many epochs one of its calls may run); None: not yet.
    self.stage_pace: float | None = None
    self.costs = accounting.PassCosts(method, p.data)
    self.passes = passes.Passes(p, self.costs)

  @classmethod
  def from_config(cls, config, method: Method, task, tx, data, mesh) -> "Steps":
    t = config.train
    rules = config.mesh.get("rules")
    return cls(method, task, tx, data, mesh, batch_size=t.batch_size,
               eval_batch_size=t.eval_batch_size,
               steps_per_call=_chosen(t, "train.steps_per_call"),
               rules=None if rules is None else dict(rules.items()),
               compute_dtype=F.get(t, "train.compute_dtype"),
               stage=StageOptions(*(F.get(t, f"train.{f.name}")
                                    for f in dataclasses.fields(StageOptions)
                                    if f.name != "stage_program"),
                                  stage_program=_chosen(t, "train.stage_program")),
               step_fusion=_chosen(t, "train.step_fusion"),
               eval_fusion=_chosen(t, "train.eval_fusion"),
               l2_init=F.get(t, "train.l2_init"))

  # -- the compile cache and placement (`alma_jax.engine.programs`) ------------------------------------
  @property
  def compiled(self) -> tuple[tuple, ...]:
    """The keys (kind, structure, population) of the programs compiled so far."""
    return self.programs.compiled

  @property
  def num_compilations(self) -> int:
    return self.programs.num_compilations

  def shardings(self, tree, *, stacked: bool = True, name: str = ""):
    return self.programs.shardings(tree, stacked=stacked, name=name)

  def place(self, tree, *, stacked: bool = True):
    return self.programs.place(tree, stacked=stacked)

  def replicated(self, tree):
    return self.programs.replicated(tree)

  def place_replicated(self, tree):
    """`tree` placed whole on every device of the run's mesh."""
    return self.programs.place_replicated(tree)

  def train_call(self, structure, state: TrainState, batch: Batch, keys, counter):
    return self.programs.train_call(structure, state, batch, keys, counter)

  def init_state(self, learner: Learner, opt_state=None, anchor: Learner | None = None
                 ) -> TrainState:
    return self.programs.init_state(learner, opt_state, anchor)

  # -- passes over data (`alma_jax.engine.passes`) -------------------------------------------------------
  def evaluate_units(self, learner: Learner, split: str, idx: np.ndarray):
    return self.passes.evaluate_units(learner, split, idx)

  def evaluate(self, learner: Learner, split: str, idx: np.ndarray):
    return self.passes.evaluate(learner, split, idx)

  def eval_aux(self, learner: Learner, idx: np.ndarray) -> PyTree:
    return self.passes.eval_aux(learner, idx)

  def reduce(self, fn: Callable, learner: Learner, idx: np.ndarray, *,
             count: bool = True) -> PyTree:
    return self.passes.reduce(fn, learner, idx, count=count)

  def scan(self, fn: Callable, carry: PyTree, learner: Learner, idx: np.ndarray) -> PyTree:
    return self.passes.scan(fn, carry, learner, idx)

  # -- FLOPs (`alma_jax.engine.accounting`) and time (`alma_jax.engine.timing`) ---------------------------------
  @property
  def pass_flops(self) -> float:
    """FLOPs of the passes over data (`reduce`, `scan`, `eval_aux`) so far."""
    return self.costs.total

  @property
  def pass_macs(self) -> float:
    """Multiply-adds of the same passes so far."""
    return self.costs.total_macs

  def flops(self, learner: Learner) -> dict[str, float]:
    """`alma_jax.engine.accounting.step_flops` of one (unstacked) learner's structure."""
    return accounting.step_flops(self.programs, learner)

  def seconds_per_step(self, learner: Learner, repeats: int = 3) -> float:
    """`alma_jax.engine.timing.seconds_per_step` of a stacked `learner`."""
    return timing.seconds_per_step(self.programs, learner, repeats)
