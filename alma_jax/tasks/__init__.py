"""Tasks: what a batch of the stream means, behind two functions.

A task turns indices of the resident data into model inputs and targets
(`inputs`) and scores log-probabilities against targets (`per_example`: the
error and negative log-likelihood of every example). The loop, the stage and
the compiled steps see nothing else of the data, so a new kind of data (text
for language models) is a new task, not a change of the loop. A task also
loads its data (`load`) and puts it in the form its `inputs` reads
(`device_data`).
"""

from alma_jax.tasks.images import ImageTask


def for_config(config):
  """The task of `config`: image classification (the only task so far)."""
  return ImageTask.from_config(config)


__all__ = ["ImageTask", "for_config"]
