"""Tasks: what a batch of the stream means, behind two functions.

A task turns indices of the resident data into model inputs and targets
(`inputs`) and scores log-probabilities against targets (`per_example`: the
error and negative log-likelihood of every example). The loop, the stage and
the compiled steps see nothing else of the data, so a new kind of data (text
for language models) is a new task, not a change of the loop.
"""

from alma_jax.tasks.images import ImageTask

__all__ = ["ImageTask"]
