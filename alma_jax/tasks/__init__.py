"""Tasks: what a batch of the stream means, behind two functions.

A task turns indices of the resident data into model inputs and targets
(`inputs`) and scores log-probabilities against targets (`per_example`: the
error and negative log-likelihood of every example). The loop, the stage and
the compiled steps see nothing else of the data, so a new kind of data (text
for language models) is a new task, not a change of the loop. A task also
loads its data (`load`) and puts it in the form its `inputs` reads
(`device_data`).
"""

from alma_jax import methods
from alma_jax.tasks import text
from alma_jax.tasks.images import ImageTask
from alma_jax.tasks.text import TextTask

TASKS = {"images": ImageTask, "text": TextTask}


def name_for(config) -> str:
  """The task of `config`'s method: "images" or "text" (`Method.task`)."""
  return methods.get(config.method.name).task


def for_config(config):
  """The task of `config`: image classification, or language modelling for the lm_ methods."""
  return TASKS[name_for(config)].from_config(config)


def fields_for(method: str) -> tuple:
  """The config fields a task adds to the base fields (the text setting's; none for images)."""
  return text.FIELDS if methods.get(method).task == "text" else ()


__all__ = ["ImageTask", "TextTask", "TASKS", "for_config", "fields_for", "name_for"]
