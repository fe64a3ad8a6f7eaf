"""The stage policy `finetune`: every stage trains on from where the previous one ended."""

from __future__ import annotations

from alma_jax.configuration.plugins import policies as declared
from alma_jax.policies.base import StagePolicy, register


@register
class Finetune(declared.Finetune, StagePolicy):
  """finetune (the default, the paper's setting): the learner starts each stage as the
  previous stage left it, grown by its method; the optimizer state is kept across stages
  when `train.keep_optimizer_state` asks for it, else each stage starts a fresh one."""
