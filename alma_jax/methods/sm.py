"""SM: a single model fine-tuned (or retrained) on each stage's data."""

from alma_jax.methods import base
from alma_jax.methods import register


@register
class SingleModel(base.Method):
  """The standard network of the paper's section 4.1; all behaviour is the base's."""

  name = "sm"
