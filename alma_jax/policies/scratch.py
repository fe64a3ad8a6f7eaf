"""The stage policy `scratch`: every stage trains from a fresh initialisation."""

from __future__ import annotations

import jax

from alma_jax.policies.base import REINIT_KEY, StagePolicy, register


@register
class Scratch(StagePolicy):
  """scratch: every stage trains freshly initialised parameters, with a fresh optimizer state.

  Before the method grows, the learner is re-initialised with its structure
  kept (`Method.reinit`, key `REINIT_KEY`); the growth then edits the fresh
  learner (a gMoE split splits the fresh experts).

  gEns (and lm_gens) train, at each stage, members that no stage has trained
  yet: at the first stage the initial members, still at their
  initialisation, at every later one the members that growth adds; the older
  members are frozen. Before growth their `reinit` keeps every member (the
  members the stage trains do not exist yet, and re-drawing the frozen ones
  would discard what they learnt); their growth then draws the new members
  afresh, whatever `method.new_member` says (it reads
  `config.stream.init_from_scratch`, which the config keeps equal to
  `warm_start == "scratch"`: `resolve_warm_start`). So every gEns stage
  trains members that start from an initialisation, never from trained
  values, and the frozen members stay untouched.
  """

  name = "scratch"

  def start_stage(self, method, learner, key: jax.Array, ctx, opt_state):
    del opt_state  # a fresh optimizer state
    learner = method.reinit(learner, jax.random.fold_in(key, REINIT_KEY))
    return self.grow(method, learner, key, ctx), None
