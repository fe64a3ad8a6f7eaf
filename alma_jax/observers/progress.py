"""A progress line after every training stage (the lines within a stage, the compile lines
and the heartbeat: `alma_jax.engine.meter`)."""

from __future__ import annotations

import json

import numpy as np
from alma_jax.engine import population
from alma_jax.engine.meter import Meter
from alma_jax.observers.base import Observer, RunContext
from alma_jax.observers.clock import Clock


# The record fields of the plasticity diagnostics that a full progress line shows.
PLASTICITY_SHOWN = ("dormant_fraction", "feature_rank", "param_norm", "init_distance",
                    "units_reset")


class Progress(Observer):
  """Logs each stage's epochs, validation accuracy, test error and architecture, with the
  position in the stream and the run's ETA (`config.log.progress` stage or full; process 0
  only)."""

  def __init__(self, setup: RunContext, clock: Clock, meter: Meter | None = None):
    self.setup, self.clock = setup, clock
    self.meter = meter or Meter("stage", primary=setup.primary)

  def on_step(self, state) -> None:
    if not state.trained or not self.meter.stages:
      return
    s, t, stats, errors, learner = self.setup, state.t, state.stats, state.errors, state.learner
    arch = json.dumps(s.method.describe(population.unstack(learner, 0)))
    task_fields = s.task.progress([log.records[-1] for log in state.logs])
    if task_fields:
      arch = f"{task_fields} {arch}"
    if self.meter.full:  # the plasticity diagnostics of the first seed (`log.plasticity`)
      first = state.logs[0].records[-1].extra
      shown = [f"{k}={first[k]:.3g}" for k in PLASTICITY_SHOWN if k in first]
      if shown:
        arch = f"{arch} {' '.join(shown)}"
    where = f"t={t}/{s.num_t} ({100.0 * t / s.num_t:.0f}%)"
    if len(s.seeds) == 1:
      line = (f"{where} epochs={stats.epochs_run[0]} best_val_acc={stats.best_val_accuracy[0]:.4f} "
              f"test_error={errors[0]:.4f}")
    else:
      line = (f"{where} seeds={len(s.seeds)} epochs={stats.epochs_run.tolist()} "
              f"test_error={float(np.mean(errors)):.4f}±{float(np.std(errors, ddof=1)):.4f}")
    self.meter.say(f"{line} {arch} elapsed={self.clock.elapsed():.1f}s {self.meter.fields()}",
                   level="stage")
