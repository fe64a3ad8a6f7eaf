"""The plasticity diagnostics of a run's records (`log.plasticity`), from the hidden units'
measures of `alma_jax.models.units`."""

from __future__ import annotations

import jax
import numpy as np

from alma_jax.engine import population
from alma_jax.models.units import (activity_fn, distance, dormant, effective_rank,
                                   mean_activity, param_norm)
from alma_jax.state import Learner


def _by_path(tree) -> dict:
  """The leaves of `tree` by path (`jax.tree_util.keystr`)."""
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _active_cuts(method, learner: Learner) -> dict[str, tuple[slice, ...]]:
  """Per parameter path, the index of its active part in `Method.active_view` (which may
  give shapes alone), the active parts of a learner in slots being the first slots of every
  axis."""
  view = method.active_view(learner).params
  if jax.tree.structure(view) != jax.tree.structure(learner.params):
    raise ValueError(f"method {method.name!r}: the active view's parameters are not a cut of "
                     "the learner's (another tree structure)")
  return {name: tuple(slice(0, n) for n in v.shape) for name, v in _by_path(view).items()}


def active_params(method, learner: Learner):
  """The values of the learner's active parameters: each leaf cut to its shape in
  `Method.active_view`."""
  cuts = _active_cuts(method, learner)
  return jax.tree_util.tree_map_with_path(lambda p, a: a[cuts[jax.tree_util.keystr(p)]],
                                          learner.params)


def initial_values(method, initial: Learner, fresh: Learner, learner: Learner) -> Learner:
  """theta_0 of `learner`'s structure, for a run that started from `initial` (one learner
  each, unstacked): what the `train.l2_init` term pulls toward and what `init_distance`
  measures from.

  While the structure is the initial one, that is `initial` itself. After growth every
  parameter active in `initial` keeps its initial value (growth keeps a parameter's index
  in the slots), a parameter that growth made active since takes its value in `fresh` (the
  initialisation of the grown structure that the run's key draws: where a learner of that
  structure would have started), and a padding slot holds `learner`'s own value (no pull on
  what the network does not use). Host arrays; model state and structure are `learner`'s."""
  if initial.structure == learner.structure:
    return initial
  start, now = _active_cuts(method, initial), _active_cuts(method, learner)
  before, drawn = _by_path(initial.params), _by_path(fresh.params)

  def value(path, leaf):
    name = jax.tree_util.keystr(path)
    out = np.array(leaf)  # a copy: the padding keeps the learner's values
    for cut, source in ((now.get(name), drawn.get(name)), (start.get(name), before.get(name))):
      if cut is None:
        continue
      if source is None:
        raise ValueError(f"method {method.name!r}: parameter {name} is active in structure "
                         f"{learner.structure!r}, but its initialisation has no such leaf")
      out[cut] = np.asarray(source)[cut]
    return out

  return learner.replace(params=jax.tree_util.tree_map_with_path(value, learner.params))


# -- the diagnostics of the records ----------------------------------------------------------------
class Diagnostics:
  """Each seed's plasticity fields of a record (`log.plasticity`): `param_norm` (of the
  active parameters), `init_distance` (from theta_0 of its structure, `initial_values`:
  the run's initial parameters, and after growth the grown ones' initialisation), and for a
  method with hidden units `dormant_fraction` (over every hidden unit),
  `dormant_fraction_<l>` (of layer l) and `feature_rank` (the effective rank of the last
  hidden layer's features), measured on the probe set: the first `probe` examples of the
  training split. An unchanged learner keeps its last
  fields; the pass is a measurement, not counted as compute."""

  def __init__(self, steps, threshold: float, probe: int, anchor):
    self.steps, self.method = steps, steps.method
    self.threshold, self.probe_idx = float(threshold), np.arange(probe, dtype=np.int32)
    self.anchor = anchor  # learner -> theta_0 of its structure, stacked (`initial_values`)
    self._last: list[dict] | None = None

  def fields(self, learner: Learner, changed: bool) -> list[dict]:
    """Each seed's fields for the stacked `learner` (`changed`: trained since the last)."""
    if changed or self._last is None:
      anchor = self.anchor(learner)
      self._last = [self._one(population.unstack(learner, i), population.unstack(anchor, i))
                    for i in range(population.size(learner))]
    return [dict(f) for f in self._last]

  def _one(self, learner: Learner, anchor: Learner) -> dict:
    params = active_params(self.method, learner)
    out = {"param_norm": param_norm(params),
           "init_distance": distance(params, active_params(self.method, anchor))}
    if self.method.unit_layout() is not None:
      summed = self.steps.reduce(activity_fn(self.method), learner, self.probe_idx, count=False)
      activity = mean_activity(summed)
      units = self.method.unit_active(learner)  # padding slots are not units
      units = [np.ones(a.shape, bool) for a in activity] if units is None else units
      masks = dormant(activity, self.threshold, self.method.unit_members_of(learner), units)
      out["dormant_fraction"] = float(sum(np.sum(m) for m in masks)
                                      / sum(np.sum(u) for u in units))
      out.update({f"dormant_fraction_{l}": float(np.sum(m) / np.sum(u))
                  for l, (m, u) in enumerate(zip(masks, units))})
      out["feature_rank"] = effective_rank(summed["gram"])
    return out
