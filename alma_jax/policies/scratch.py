"""The stage policy `scratch`: every stage trains from a fresh initialisation."""

from __future__ import annotations

import jax

from alma_jax.configuration.plugins import policies as declared
from alma_jax.policies.base import REINIT_KEY, StagePolicy, register
from alma_jax.runtime import host_random


@register
class Scratch(declared.Scratch, StagePolicy):
  """scratch: every stage trains freshly initialised parameters, with a fresh optimizer state.

  The method grows first, on the learner as the previous stage left it (so
  growth decides on what was learnt: gMoE's losing expert, Firefly's
  candidates), and the grown learner is then re-initialised with its
  structure kept (`Method.reinit`, key `REINIT_KEY`), as in the released
  code.

  gEns (and lm_gens) train, at each stage, members that no stage has trained
  yet: at the first stage the initial members, still at their
  initialisation, at every later one the members that growth adds; the older
  members are frozen. Their growth draws the new members afresh, whatever
  `method.new_member` says (it reads
  `config.stream.init_from_scratch`, which the config keeps equal to
  `warm_start == "scratch"`: `alma_jax.configuration.plugins.resolve_warm_start`), and
  their `reinit` keeps every member (re-drawing the frozen ones would discard what they
  learnt; the new ones are fresh already). So every gEns stage
  trains members that start from an initialisation, never from trained
  values, and the frozen members stay untouched.
  """

  def start_stage(self, method, learner, key: jax.Array, ctx, opt_state):
    del opt_state  # a fresh optimizer state
    grown = self.grow(method, learner, key, ctx)
    return method.reinit(grown, host_random.fold_in(key, REINIT_KEY)), None
