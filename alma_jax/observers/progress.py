"""A progress line after every training stage."""

from __future__ import annotations

import json

import numpy as np
from absl import logging

from alma_jax.core import population
from alma_jax.core import run_setup
from alma_jax.observers.base import Observer
from alma_jax.observers.clock import Clock


class Progress(Observer):
  """Logs each stage's epochs, validation accuracy, test error and architecture."""

  def __init__(self, setup: run_setup.Setup, clock: Clock):
    self.setup, self.clock = setup, clock

  def on_step(self, state) -> None:
    if not state.trained:
      return
    s, t, stats, errors, learner = self.setup, state.t, state.stats, state.errors, state.learner
    arch = json.dumps(s.method.describe(population.unstack(learner, 0)))
    task_fields = s.task.progress([log.records[-1] for log in state.logs])
    if task_fields:
      arch = f"{task_fields} {arch}"
    if len(s.seeds) == 1:
      logging.info("t=%d/%d epochs=%d best_val_acc=%.4f test_error=%.4f %s elapsed=%.1fs", t,
                   s.num_t, stats.epochs_run[0], stats.best_val_accuracy[0], errors[0], arch,
                   self.clock.elapsed())
    else:
      logging.info("t=%d/%d seeds=%d epochs=%s test_error=%.4f±%.4f %s elapsed=%.1fs", t,
                   s.num_t, len(s.seeds), stats.epochs_run.tolist(), float(np.mean(errors)),
                   float(np.std(errors)), arch, self.clock.elapsed())
