"""The stage policy `l2_init`: fine-tune with a pull toward the initial parameters.

L2 Init (Kumar et al., "Maintaining Plasticity in Continual Learning via Regenerative
Regularization", 2023): the training loss gets c * ||theta - theta_0||^2, theta_0 the
parameters the run started from, so the weights stay near a point from which the network
is known to train well. The term is part of the train step (`train.l2_init`, read by
`alma_jax.engine.programs.Programs.step_body`; the stage gets theta_0 from the run, as
`alma_jax.engine.train.StageData.anchor`); the policy itself starts each stage as finetune
does. With c = 0 the step is finetune's exactly. For a growing method theta_0 follows the
structure (`alma_jax.engine.plasticity.initial_values`): a parameter keeps its initial value
as its anchor, one that growth adds is pulled toward the grown structure's initialisation
from the run's key (where a learner of that structure would have started), and a padding
slot is not pulled.
"""

from __future__ import annotations

from alma_jax.configuration.plugins import policies as declared
from alma_jax.policies.base import StagePolicy, register


@register
class L2Init(declared.L2Init, StagePolicy):
  """l2_init: finetune, with train.l2_init * ||theta - theta_0||^2 in the training loss."""
