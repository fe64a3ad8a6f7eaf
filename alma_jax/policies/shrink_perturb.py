"""The stage policy `shrink_perturb`: shrink what was learnt and add a little fresh noise.

Before each stage (after the method's growth), every parameter and BatchNorm
statistic x of what the stage trains becomes `lam * x + sigma * x_fresh`,
where x_fresh is a fresh initialisation of the same structure (`Method.fresh_init`; for
gEns, fresh draws of the members the stage trains) (Ash & Adams,
"On Warm-Starting Neural Network Training", 2020): fine-tuning keeps what was
learnt but can generalise worse than training afresh; shrinking towards zero
and perturbing restores the gradients' diversity while keeping most of it.

`stream.shrink` (lam) = 1 and `stream.perturb` (sigma) = 0 is `finetune`
exactly; lam = 0, sigma = 1 is a fresh initialisation after growth, which
is `scratch` exactly for every method but gEns (whose `scratch` growth
draws the new members afresh instead of copying one). Frozen parts (gEns's older members) are left untouched,
as by `scratch`. The optimizer state follows `train.keep_optimizer_state`,
as with `finetune`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alma_jax.configuration.plugins import policies as declared
from alma_jax.policies.base import REINIT_KEY, StagePolicy, register
from alma_jax.runtime import host_random


def mix(learnt, fresh, lam: float, sigma: float):
  """`lam * learnt + sigma * fresh` leaf by leaf (floating-point leaves; others as learnt)."""
  def one(a, b):
    if not jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
      return a
    return (lam * a + sigma * b).astype(jnp.asarray(a).dtype)
  return jax.tree.map(one, learnt, fresh)


@register
class ShrinkPerturb(declared.ShrinkPerturb, StagePolicy):
  """shrink_perturb: x <- stream.shrink * x + stream.perturb * x_fresh before each stage."""

  def start_stage(self, method, learner, key: jax.Array, ctx, opt_state):
    s = self.config.stream
    lam, sigma = float(s.shrink), float(s.perturb)
    grown = self.grow(method, learner, key, ctx)
    fresh = method.fresh_init(grown, host_random.fold_in(key, REINIT_KEY))
    mixed = grown.replace(params=mix(grown.params, fresh.params, lam, sigma),
                          model_state=mix(grown.model_state, fresh.model_state, lam, sigma))
    take = jnp.ones((method.num_units(grown.structure),), bool)
    return method.select_units(grown.structure, take, mixed, grown), opt_state
