"""The waiting policy `fixed`: train every `config.stream.wait` mega-batches."""

from __future__ import annotations

from alma_jax.configuration.plugins import policies as declared
from alma_jax.policies import schedule
from alma_jax.policies.base import WaitPolicy, register


@register
class FixedWait(declared.FixedWait, WaitPolicy):
  """fixed (the paper's setting): the learner waits w = `config.stream.wait` mega-batches
  between updates, training at t = w, 2w, ..., B."""

  def trains_at(self, t: int, state) -> bool:
    del state
    return schedule.is_training_time(t, self.config.stream.wait)

  def planned_times(self, num_megabatches: int) -> list[int]:
    return schedule.training_times(num_megabatches, self.config.stream.wait)
