"""The stage policy `l2_init`: fine-tune with a pull toward the initial parameters.

L2 Init (Kumar et al., "Maintaining Plasticity in Continual Learning via Regenerative
Regularization", 2023): the training loss gets c * ||theta - theta_0||^2, theta_0 the
parameters the run started from, so the weights stay near a point from which the network
is known to train well. The term is part of the train step (`train.l2_init`, read by
`alma_jax.engine.programs.Programs.step_body`; the stage gets theta_0 from the run, as
`alma_jax.engine.train.StageData.anchor`); the policy itself starts each stage as finetune
does. With c = 0 the step is finetune's exactly. The growing methods are refused:
theta_0 of a grown structure is not defined.
"""

from __future__ import annotations

from alma_jax.configuration import plugins
from alma_jax.configuration.plugins import policies as declared
from alma_jax.errors import ConfigError
from alma_jax.policies.base import StagePolicy, register

# Methods whose learner keeps the structure it started with (theta_0 fits every stage).
FIXED_STRUCTURE = ("sm", "ens", "umix")


@register
class L2Init(declared.L2Init, StagePolicy):
  """l2_init: finetune, with train.l2_init * ||theta - theta_0||^2 in the training loss."""

  @classmethod
  def check(cls, config) -> None:
    method = plugins.method(config.method.name).name
    if method not in FIXED_STRUCTURE:
      raise ConfigError(f"config.stream.warm_start='l2_init' pulls the parameters toward the "
                        f"run's initial ones, which a growing method ({method!r}) does not "
                        f"keep; valid config.method.name: {list(FIXED_STRUCTURE)}")
