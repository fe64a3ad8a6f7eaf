"""Event streams of a run: TensorBoard event files (`config.log.tensorboard`) and, optionally,
Weights & Biases runs (`config.log.wandb`): scalars per time step and per epoch, the config
and the summary."""

from __future__ import annotations

import os

from alma_jax.configuration import config_lib
from alma_jax.observers.base import Observer, RunContext
from alma_jax.outputs import tensorboard
from alma_jax.outputs import wandb_log  # imports the wandb package only when a writer starts
from alma_jax.outputs import workdir as wd


class EventFiles(Observer):
  """One event file per seed folder, written by process 0; a resumed run rewrites it from
  its records (`alma_jax.outputs.tensorboard.Writer`)."""

  def __init__(self, setup: RunContext):
    self.setup = setup
    self.writers: list = []

  def make_writers(self, state) -> list:
    """One writer per seed folder, given the records resumed with (none when turned off)."""
    s = self.setup
    if not s.config.log.tensorboard:
      return []
    return [tensorboard.Writer(out, [r.to_dict() for r in log.records])
            for out, log in zip(s.out_dirs, state.logs)]

  def on_start(self, state, snapshot) -> None:
    s = self.setup
    if not s.primary:
      return
    self.writers = self.make_writers(state)
    for writer, seed in zip(self.writers, s.seeds):
      writer.config(wd.config_dict(config_lib.seed_config(s.config, seed)))

  def on_epoch(self, t, epoch, loss, val_accuracy, ran) -> None:
    del epoch  # the event files count epochs over the whole run
    for i, writer in enumerate(self.writers):
      if ran[i]:
        writer.epoch(t, {"train_loss": loss[i], "val_accuracy": val_accuracy[i]})

  def on_stage_resumed(self, t, epoch) -> None:
    for writer in self.writers:
      writer.stage_resumed(t, epoch)

  def on_record(self, state, records) -> None:
    for writer, r in zip(self.writers, records):
      writer.step(r.to_dict())

  def on_summary(self, summary) -> None:
    for writer, seed_summary in zip(self.writers, summary.get("per_seed") or [summary]):
      writer.summary(seed_summary)

  def close(self) -> None:
    for writer in self.writers:
      if hasattr(writer, "close"):
        writer.close()
    self.writers = []


class WandbRuns(EventFiles):
  """The same events as W&B runs, one per seed, in the project `config.log.wandb` (grouped
  by workdir); a resumed run continues its W&B runs (`alma_jax.outputs.wandb_log`)."""

  def make_writers(self, state) -> list:
    s = self.setup
    if not s.config.log.wandb:
      return []
    group = os.path.basename(os.path.normpath(s.workdir))
    return [wandb_log.Writer(out, [r.to_dict() for r in log.records], project=s.config.log.wandb,
                             group=group, primary=True)
            for out, log in zip(s.out_dirs, state.logs)]
