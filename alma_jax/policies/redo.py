"""The stage policy `redo`: re-draw the dormant hidden units before each stage.

ReDo (Sokar et al., "The Dormant Neuron Phenomenon in Deep Reinforcement Learning", 2023):
a unit whose activity is a small fraction of its layer's mean (score <= tau,
`stream.redo_threshold`) has stopped contributing, and a network that fine-tunes for long
accumulates such units. Before each stage (after the method's growth), the units' scores
are measured on the stage's training data (`alma_jax.models.units`; the pass counts
as the stage's growth compute), and every dormant unit is drawn afresh: incoming weights
and per-unit parameters from a fresh initialisation, outgoing weights zero, so a unit that
was silent leaves the network's function unchanged. The record of each trained step holds
`units_reset`, the units re-drawn before its stage.
"""

from __future__ import annotations

import jax
import numpy as np

from alma_jax.configuration.plugins import policies as declared
from alma_jax.models import units as plasticity
from alma_jax.policies.base import (FIRST_FREE_KEY, StagePolicy, Started, check_unit_resets,
                                    register)
from alma_jax.runtime import host_random


def measured(method, learner, ctx) -> list[np.ndarray]:
  """Each hidden layer's per-unit activity on the stage's training data."""
  return plasticity.mean_activity(ctx.reduce(plasticity.activity_fn(method), learner,
                                             ctx.train_idx))


def redraw(method, learner, key: jax.Array, masks) -> tuple:
  """(`learner` with the units of `masks` drawn afresh (`plasticity.reset_units`, from the
  policy's own key), the record fields that say how many)."""
  fresh = method.init(host_random.fold_in(key, FIRST_FREE_KEY), learner.structure)
  return (plasticity.reset_units(method.unit_layout(), learner, fresh, masks,
                                 method.unit_members_of(learner)),
          {"units_reset": int(sum(np.sum(m) for m in masks))})


@register
class Redo(declared.Redo, StagePolicy):
  """redo: the units with score <= stream.redo_threshold are re-drawn before each stage."""

  @classmethod
  def check(cls, config) -> None:
    check_unit_resets(config, cls.name)

  def start(self, method, learner, key: jax.Array, ctx, opt_state, memo):
    grown = self.grow(method, learner, key, ctx)
    masks = plasticity.dormant(measured(method, grown, ctx),
                               float(self.config.stream.redo_threshold),
                               method.unit_members_of(grown), method.unit_trained(grown))
    learner, fields = redraw(method, grown, key, masks)
    return Started(learner, opt_state, memo, fields)
