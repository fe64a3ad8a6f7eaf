"""The policies' declarations: each stage and waiting policy's name and config fields, read
without JAX.

A policy's class (`alma_jax.policies`) derives from its declaration here. Every policy's
fields are in every config (at their defaults unless the policy is chosen: the checks of
`alma_jax.policies` refuse a field set for a policy that does not read it).
"""

from __future__ import annotations

import math

from alma_jax.configuration import fields as F


class Declaration:
  """A policy's name and the config fields it reads."""

  name = ""
  FIELDS: tuple[F.Field, ...] = ()

  @classmethod
  def paths(cls) -> tuple[str, ...]:
    """The dotted paths of the fields the policy reads."""
    return tuple(f.path for f in cls.FIELDS)


class Finetune(Declaration):
  name = "finetune"


class Scratch(Declaration):
  name = "scratch"


class ShrinkPerturb(Declaration):
  name = "shrink_perturb"
  FIELDS = (
      F.Field("stream.shrink", 1.0, F.number(0.0, 1.0),
              "shrink_perturb: the factor lambda of what was learnt (1 with perturb 0: finetune)"),
      F.Field("stream.perturb", 0.0, F.number(0.0, 10.0),
              "shrink_perturb: the factor sigma of a fresh initialisation added to it"),
  )


class Redo(Declaration):
  name = "redo"
  FIELDS = (
      F.Field("stream.redo_threshold", 0.025, F.number(0.0, 1.0),
              "redo: before each stage, re-draw the hidden units whose score (activity over "
              "its layer's mean, on the stage's training data) is at most this (tau; 0: the "
              "dead units alone)"),
  )


class ContinualBackprop(Declaration):
  name = "continual_backprop"
  FIELDS = (
      F.Field("stream.cbp_fraction", 0.05, F.number(0.0, 1.0),
              "continual_backprop: the fraction of each hidden layer's units re-drawn before "
              "each stage, lowest contribution utility first (a fractional count carries over "
              "to the next stage)"),
      F.Field("stream.cbp_maturity", 2, F.integer(0),
              "continual_backprop: a unit is re-drawn only once this many stages have trained "
              "it since it was last drawn"),
  )


class L2Init(Declaration):
  name = "l2_init"
  FIELDS = (
      F.Field("train.l2_init", 0.0, F.number(0.0, math.inf, open_hi=True),
              "l2_init: the coefficient c of c * ||theta - theta_0||^2 (summed over the trained "
              "parameters; theta_0: the run's initial parameters) added to the training loss "
              "(0: finetune exactly)"),
  )


class FixedWait(Declaration):
  name = "fixed"


class Geometric(Declaration):
  name = "geometric"
  FIELDS = (
      F.Field("stream.geometric_w0", 1.0, F.number(1.0, math.inf, open_hi=True),
              "geometric: the first training time w0 (the k-th is ceil(w0 * r^k))"),
      F.Field("stream.geometric_ratio", 2.0, F.number(1.0, math.inf, open_lo=True, open_hi=True),
              "geometric: the ratio r > 1 of successive training times"),
  )


class Triggered(Declaration):
  name = "triggered"
  FIELDS = (
      F.Field("stream.trigger_margin", 0.02, F.number(0.0, 1.0),
              "triggered: train when the new mega-batch's validation error exceeds the last "
              "stage's validation error by more than this (delta)"),
      F.Field("stream.trigger_fraction", 0.5, F.number(0.0, 1.0, open_lo=True),
              "triggered: train when the unseen training examples reach this fraction (rho) of "
              "all seen"),
      F.Field("stream.trigger_min_wait", 1, F.integer(1),
              "triggered: never train fewer than this many mega-batches after the last stage"),
      F.Field("stream.trigger_max_wait", 0, F.integer(0),
              "triggered: always train this many mega-batches after the last stage (0: no "
              "maximum)"),
      # -- model
  )


STAGE = (Finetune, Scratch, ShrinkPerturb, Redo, ContinualBackprop, L2Init)
WAIT = (FixedWait, Geometric, Triggered)
