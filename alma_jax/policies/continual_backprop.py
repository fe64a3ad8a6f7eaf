"""The stage policy `continual_backprop`: replace a few of the least useful hidden units
before each stage.

Continual backpropagation (Dohare et al., "Loss of plasticity in deep continual learning",
Nature, 2024) keeps a network plastic by re-drawing, little by little, the units that
contribute least, so that some units are always fresh. Here it acts once per stage (after
the method's growth): each hidden unit's contribution utility, its mean |h| on the stage's
training data times the summed magnitude of its outgoing weights, is measured
(`alma_jax.models.units`; the pass counts as the stage's growth compute); of each
layer's mature units (trained by at least `stream.cbp_maturity` stages since they were
drawn), the `stream.cbp_fraction` with the lowest utility are drawn afresh (incoming
weights fresh, outgoing zero). A fractional count carries over to the next stage, so a
narrow layer still replaces a unit every few stages. In an ensemble (`ens`, `umix`, `gens`)
a layer's units are every member's, side by side, and the fraction is of all of them; in
gMoE a layer's units are its mixture's output channels, whose outgoing weights are those
of every active expert and gate that reads them (`Method.unit_outgoing`).

The policy remembers, per learner, each unit's age (stages trained since drawn) and each
layer's carried fraction (`Started.memo`, kept by the checkpoints). Only the units a stage
trains (`Method.unit_trained`) age and can be chosen: not the padding slots of a method in
slots (`ff`, `gens`), nor gEns's frozen members. Growth keeps every unit's index and adds
units after them (Firefly's new channels, gEns's new member slots), which start at age 0.
The record of each trained step holds `units_reset`.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from alma_jax.configuration.plugins import policies as declared
from alma_jax.policies.base import StagePolicy, Started, check_unit_resets, register
from alma_jax.policies.redo import measured, redraw


def choose(utility: np.ndarray, age: np.ndarray, carry: float, fraction: float,
           maturity: int) -> tuple[np.ndarray, float]:
  """(the units of one layer to re-draw (bool), the fraction carried to the next stage): the
  lowest-utility mature units (age >= maturity; a negative age: a unit the stage does not
  train), `carry + fraction * mature` of them rounded down (ties: the lower index first)."""
  mature = age >= maturity
  want = carry + fraction * int(np.sum(mature))
  count = int(math.floor(want + 1e-9))  # sums of fractions: 20 x 0.05 may fall short of 1
  order = [i for i in np.argsort(utility, kind="stable") if mature[i]][:count]
  take = np.zeros(utility.shape, bool)
  take[order] = True
  return take, max(want - count, 0.0)


@register
class ContinualBackprop(declared.ContinualBackprop, StagePolicy):
  """continual_backprop: the least useful mature units are re-drawn before each stage."""

  @classmethod
  def check(cls, config) -> None:
    check_unit_resets(config, cls.name)

  def start(self, method, learner, key: jax.Array, ctx, opt_state, memo):
    s = self.config.stream
    grown = self.grow(method, learner, key, ctx)
    activity = measured(method, grown, ctx)
    if memo is None:  # every unit is as old as the learner: never trained
      memo = {"age": [[0] * len(a) for a in activity], "carry": [0.0] * len(activity)}
    trained = method.unit_trained(grown)
    masks, ages, carries = [], [], []
    for l, a in enumerate(activity):
      age = np.asarray(memo["age"][l], np.int64)
      age = np.concatenate([age, np.zeros(len(a) - len(age), np.int64)])  # grown: new units
      on = np.ones(len(a), bool) if trained is None else np.asarray(trained[l], bool)
      utility = a * method.unit_outgoing(grown, l)
      take, carry = choose(utility, np.where(on, age, -1), float(memo["carry"][l]),
                           float(s.cbp_fraction), int(s.cbp_maturity))
      masks.append(take)
      ages.append((np.where(take, 0, age) + on).tolist())  # the stage trains these
      carries.append(carry)
    learner, fields = redraw(method, grown, key, masks)
    return Started(learner, opt_state, {"age": ages, "carry": carries}, fields)
