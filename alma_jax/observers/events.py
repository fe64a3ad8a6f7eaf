"""TensorBoard event files: scalars per time step and per epoch (`config.log.tensorboard`)."""

from __future__ import annotations

from alma_jax import run_setup
from alma_jax import tensorboard
from alma_jax.observers.base import Observer


class EventFiles(Observer):
  """One event file per seed folder, written by process 0; a resumed run rewrites it from
  its records (`alma_jax.tensorboard.Writer`)."""

  def __init__(self, setup: run_setup.Setup):
    self.setup = setup
    self.writers: list[tensorboard.Writer] = []

  def on_start(self, state, snapshot) -> None:
    s = self.setup
    if s.primary and s.config.log.tensorboard:
      self.writers = [tensorboard.Writer(out, [r.to_dict() for r in log.records])
                      for out, log in zip(s.out_dirs, state.logs)]

  def on_epoch(self, t, epoch, loss, val_accuracy, ran) -> None:
    del epoch  # the event files count epochs over the whole run
    for i, writer in enumerate(self.writers):
      if ran[i]:
        writer.epoch(t, {"train_loss": loss[i], "val_accuracy": val_accuracy[i]})

  def on_record(self, state, records) -> None:
    for writer, r in zip(self.writers, records):
      writer.step(r.to_dict())
