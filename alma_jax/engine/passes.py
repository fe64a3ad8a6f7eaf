"""Passes over data with the compiled programs: evaluation and the passes that growth runs.

`Passes.evaluate` runs the evaluation program over padded batches of a
split; `reduce` and `scan` run a method's function over batches of training
examples (scoring experts, fitting growth candidates); `eval_aux` sums the
method's `eval_aux` through the evaluation program itself. The FLOPs of the
passes that growth runs are counted as they run (`alma_jax.engine.accounting.
PassCosts`), apart from training.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from alma_jax.engine import accounting
from alma_jax.engine import population
from alma_jax.engine.programs import Batch, Programs
from alma_jax.models import slots
from alma_jax.state import Learner

PyTree = Any


class Passes:
  """The passes over data of one run, through its programs."""

  def __init__(self, programs: Programs, costs: accounting.PassCosts):
    self.programs, self.costs = programs, costs
    self.method, self.task, self.data = programs.method, programs.task, programs.data

  def eval_batches(self, idx: np.ndarray):
    """`Batch`es (host arrays) of `eval_batch_size` along the last axis of `idx` (the last one
    padded); a compiled program places them."""
    b, n = self.programs.eval_batch_size, idx.shape[-1]
    for s in range(0, n, b):
      pad = np.zeros(idx.shape[:-1] + (b,), np.int32)
      pad[..., :min(b, n - s)] = idx[..., s:s + b]
      mask = np.ascontiguousarray(np.broadcast_to(np.arange(b) < n - s, pad.shape))
      yield Batch(pad, mask)

  # -- evaluation ------------------------------------------------------------------------------
  def evaluate_units(self, learner: Learner, split: str, idx: np.ndarray):
    """Per-member (accuracy, mean NLL, accuracy of each selection unit (S, U)) of a stacked
    `learner` on examples `idx` of `split`.

    `idx` is (S, n), each member's own examples, or (n,), the same examples
    for every member (gathered once per batch when S > 1).
    """
    num = slots.leading_size(learner.params)
    if idx.shape[-1] == 0:
      raise ValueError(f"cannot evaluate on an empty {split} set")
    idx = self.task.global_index(self.data, split, idx)
    shared = idx.ndim == 1 and num > 1
    if idx.ndim == 1 and not shared:
      idx = np.broadcast_to(idx, (num, idx.shape[0]))
    learner = self.programs.place(learner)  # once, not at every batch
    results, fn = [], None
    for b in self.eval_batches(idx):
      fn = fn or self.programs.eval_fn(learner, shared, b)
      results.append(fn(learner.params, learner.model_state, self.data, b))
    n = idx.shape[-1]
    correct, nll, units = (np.sum([np.asarray(r[i], np.float64) for r in results], axis=0)
                           for i in range(3))
    return correct / n, nll / n, units / n

  def evaluate(self, learner: Learner, split: str,
               idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-member (accuracy, mean NLL) of a stacked `learner`; see `evaluate_units`."""
    acc, nll, _ = self.evaluate_units(learner, split, idx)
    return acc, nll

  def eval_aux(self, learner: Learner, idx: np.ndarray) -> PyTree:
    """The method's `eval_aux` summed over examples `idx` of the training split (unaugmented)
    for one (unstacked) learner, in float64 on the host: computed by the evaluation program
    of a population of one (the run's own when it has one seed), so it compiles nothing of
    its own. Its FLOPs count as a pass over data."""
    fn = self.method.eval_aux
    build = self._pass_body(fn)  # what the FLOPs are counted of
    idx = self.task.global_index(self.data, "train", np.asarray(idx, np.int32))
    stacked = population.stack([learner], self.programs.place)
    total, compiled = None, None
    for b in self.eval_batches(idx[None]):
      compiled = compiled or self.programs.eval_fn(stacked, False, b)
      out = compiled(stacked.params, stacked.model_state, self.data, b)[3]
      self.costs.add("reduce", fn, learner, build, Batch(b.idx[0], b.mask[0]))
      out = jax.tree.map(lambda a: np.asarray(a, np.float64)[0], out)  # indexed on the host
      total = out if total is None else jax.tree.map(np.add, total, out)
    return total

  # -- passes for growth -------------------------------------------------------------------------
  def _train_batches(self, idx: np.ndarray):
    idx = self.task.global_index(self.data, "train", np.asarray(idx, np.int32))
    return self.eval_batches(idx)

  def _pass_body(self, fn: Callable) -> Callable:
    """structure -> (params, model_state, data, Batch) -> `fn(structure, params, model_state,
    x, y, mask, task)` of the batch's examples."""
    task = self.task

    def build(structure):
      def body(params, model_state, data, batch: Batch):
        x, y = task.inputs(data, batch.idx)
        return fn(structure, params, model_state, x, y, batch.mask, task)
      return body

    return build

  def reduce(self, fn: Callable, learner: Learner, idx: np.ndarray, *,
             count: bool = True) -> PyTree:
    """Sums `fn(structure, params, model_state, x, y, mask, task)` over batches of training
    examples `idx` (unaugmented) for one (unstacked) learner, in float64 on the host; its
    FLOPs count as a pass over data unless `count` is false (a measurement of the run, not
    work of the learner)."""
    build = self._pass_body(fn)
    learner, total = self.programs.place(learner, stacked=False), None
    program = self.method.program_structure(learner.structure)
    for b in self._train_batches(idx):
      compiled = self.programs.pass_fn("reduce", fn, learner, lambda: build(program), b)
      args = (learner.params, learner.model_state, self.data, b)
      if count:
        self.costs.add("reduce", fn, learner, build, b)
      out = jax.tree.map(lambda a: np.asarray(a, np.float64), compiled(*args))
      total = out if total is None else jax.tree.map(np.add, total, out)
    return total

  def scan(self, fn: Callable, carry: PyTree, learner: Learner, idx: np.ndarray) -> PyTree:
    """Threads `carry = fn(structure, params, model_state, x, y, mask, carry, task)` through
    batches of training examples `idx` (unaugmented, in order) for one (unstacked) learner,
    one compiled call per batch; e.g. a few optimisation steps of growth candidates."""
    task = self.task

    def build(structure):
      def body(params, model_state, data, batch: Batch, carry):
        x, y = task.inputs(data, batch.idx)
        return fn(structure, params, model_state, x, y, batch.mask, carry, task)
      return body

    learner = self.programs.place(learner, stacked=False)
    program = self.method.program_structure(learner.structure)
    for b in self._train_batches(idx):
      compiled = self.programs.pass_fn("scan", fn, learner, lambda: build(program), b, carry)
      args = (learner.params, learner.model_state, self.data, b, carry)
      self.costs.add("scan", fn, learner, build, b, carry)
      carry = compiled(*args)
    return carry
