"""Tasks: what a batch of the stream means, by name.

A task (`alma_jax.tasks.base.Task`) owns what depends on the kind of data:
its config fields, loading the data, model inputs and targets, the training
loss, each example's error and NLL, and the fields it adds to records,
summaries and log lines. The loop, the stage, the compiled steps and the
methods see nothing else of the data, so a new kind of data is a new task
(one file, `register`ed), not a change of the loop or of a method.

The task of a config follows its data, its method alias or its backbone
(`alma_jax.configuration.plugins.task`, which reads the tasks' declarations
without importing them).
"""

from __future__ import annotations

from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError
from alma_jax.tasks import base
from alma_jax.tasks import images
from alma_jax.tasks import text
from alma_jax.tasks.base import Task
from alma_jax.tasks.images import ImageTask
from alma_jax.tasks.text import TextTask

DEFAULT = plugins.DEFAULT_TASK
TASKS: dict[str, type] = {}


def register(cls: type) -> type:
  """Makes task class `cls` available under `cls.name` (a class decorator)."""
  if cls.name in TASKS and TASKS[cls.name] is not cls:
    raise ValueError(f"task name {cls.name!r} registered twice")
  plugins.declare_task(cls)
  TASKS[cls.name] = cls
  return cls


register(ImageTask)
register(TextTask)


method_aliases = plugins.method_aliases


def task_class(config) -> type:
  """The task class of `config` (see the module docstring)."""
  return TASKS[plugins.task(config).name]


def for_config(config) -> Task:
  """The task of `config`."""
  return task_class(config).from_config(config)


def check(config) -> None:
  """That `config`'s method alias (if any) names its task, that its backbone serves the task,
  and the task's own checks."""
  cls = task_class(config)
  alias = method_aliases().get(config.method.name)
  if alias is not None and alias[1] != cls.name:
    raise ConfigError(f"config.method.name={config.method.name!r} is {alias[0]} on "
                      f"{alias[1]}, but config.data.name={config.data.name!r} is {cls.name} "
                      f"data; use config.method.name={alias[0]!r}")
  base.check_backbone(cls, config)
  cls.check(config)


def summary_stats() -> tuple[tuple[str, str, str], ...]:
  """The summary fields of every registered task that the report's table shows
  (`plugins.summary_stats`)."""
  return plugins.summary_stats()


__all__ = ["Task", "ImageTask", "TextTask", "TASKS", "DEFAULT", "register", "method_aliases",
           "task_class", "for_config", "check", "summary_stats", "base", "images", "text"]
