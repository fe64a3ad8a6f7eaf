"""The plasticity diagnostics of a run's records (`log.plasticity`), from the hidden units'
measures of `alma_jax.models.units`."""

from __future__ import annotations

import numpy as np

from alma_jax.engine import population
from alma_jax.models.units import (activity_fn, distance, dormant, effective_rank,
                                   mean_activity, param_norm)
from alma_jax.state import Learner


# -- the diagnostics of the records ----------------------------------------------------------------
class Diagnostics:
  """Each seed's plasticity fields of a record (`log.plasticity`): `param_norm` (of the
  active parameters), `init_distance` (from the run's initial parameters; left out when
  the structure has changed since), and for a method with hidden units `dormant_fraction`
  (over every hidden unit), `dormant_fraction_<l>` (of layer l) and `feature_rank` (the
  effective rank of the last hidden layer's features), measured on the probe set: the
  first `probe` examples of the training split. An unchanged learner keeps its last
  fields; the pass is a measurement, not counted as compute."""

  def __init__(self, steps, threshold: float, probe: int, initial):
    self.steps, self.method = steps, steps.method
    self.threshold, self.probe_idx = float(threshold), np.arange(probe, dtype=np.int32)
    self.initial = initial  # () -> the run's initial learners, stacked
    self._last: list[dict] | None = None

  def fields(self, learner: Learner, changed: bool) -> list[dict]:
    """Each seed's fields for the stacked `learner` (`changed`: trained since the last)."""
    if changed or self._last is None:
      initial = self.initial()
      self._last = [self._one(population.unstack(learner, i), population.unstack(initial, i))
                    for i in range(population.size(learner))]
    return [dict(f) for f in self._last]

  def _one(self, learner: Learner, initial: Learner) -> dict:
    active = self.method.active_view(learner)
    out = {"param_norm": param_norm(active.params)}
    if initial.structure == learner.structure:
      out["init_distance"] = distance(active.params, self.method.active_view(initial).params)
    if self.method.unit_layout() is not None:
      summed = self.steps.reduce(activity_fn(self.method), learner, self.probe_idx, count=False)
      masks = dormant(mean_activity(summed), self.threshold, self.method.unit_members)
      out["dormant_fraction"] = float(sum(np.sum(m) for m in masks) / sum(m.size for m in masks))
      out.update({f"dormant_fraction_{l}": float(np.mean(m)) for l, m in enumerate(masks)})
      out["feature_rank"] = effective_rank(summed["gram"])
    return out
