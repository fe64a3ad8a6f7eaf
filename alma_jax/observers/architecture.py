"""architecture.jsonl: the architecture after every training stage."""

from __future__ import annotations

import os

from alma_jax.engine import population
from alma_jax.observers.base import Observer, RunContext
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as wd


class ArchitectureLog(Observer):
  """A line per training stage: t and the method's description of the first seed's learner
  after it (`Method.describe`). Process 0 writes the file; every process keeps its lines,
  which the checkpoints hold too (a resumed run takes them from there)."""

  def __init__(self, setup: RunContext):
    self.setup = setup
    self.lines: list[dict] = []

  def on_start(self, state, snapshot) -> None:
    s = self.setup
    saved = None if snapshot is None else snapshot.extra.get("architecture")
    if s.primary:
      wd.sync_architecture_log(s.workdir, state.t, saved)
    if saved is not None:
      self.lines = [a for a in saved if a["t"] <= state.t]
    elif s.primary:
      self.lines = io_utils.read_jsonl(os.path.join(s.workdir, wd.ARCH_FILE))

  def on_record(self, state, records) -> None:
    if not state.trained:
      return
    self.lines.append({"t": state.t,
                       **self.setup.method.describe(population.unstack(state.learner, 0))})
    if self.setup.primary:
      io_utils.append_jsonl(os.path.join(self.setup.workdir, wd.ARCH_FILE), self.lines[-1])
