"""The interface between the stream loop and its outputs, and the fan-out to all of them."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from alma_jax.engine import timing
from alma_jax.engine.metrics import Record
from alma_jax.outputs import interrupts
from alma_jax.outputs.checkpoint import Snapshot
from alma_jax.state import RunState


class RunContext(Protocol):
  """What an output reads of the run it writes (`alma_jax.stream.RunContext` is one)."""

  config: Any  # the validated config
  workdir: str
  seeds: list[int]
  out_dirs: list[str]  # each seed's output folder (the workdir itself for one seed)
  primary: bool  # this process writes the outputs
  task: Any  # `alma_jax.tasks.base.Task`
  inputs: str  # the fingerprint of the data the run reads
  choices: dict  # the fields decided before the run
  keys: Any  # the seeds' root PRNG keys, stacked

  @property
  def method(self) -> Any:
    """The run's `alma_jax.methods.base.Method`."""

  @property
  def num_t(self) -> int:
    """B, the last time step."""

  def restore_target(self) -> Callable:
    """(structure, has_opt_state) -> the abstract state a checkpoint is restored into."""

  def check_saved_config(self, extra: dict) -> None:
    """Raises unless a checkpoint's facts name this run's config and inputs."""


class Observer:
  """What the stream loop tells an output; every hook does nothing by default."""

  def on_start(self, state: RunState, snapshot: Snapshot | None) -> None:
    """The run starts afresh (`snapshot` None) or resumes from `snapshot`, whose records
    `state.logs` holds: make the outputs match them. Inside a critical section."""

  def on_epoch(self, t: int, epoch: int, loss: np.ndarray, val_accuracy: np.ndarray,
               ran: np.ndarray) -> None:
    """An epoch of the stage at `t` ended: each seed's mean training loss and validation
    accuracy, and which seeds trained in it. Inside a critical section."""

  def on_stage_resumed(self, t: int, epoch: int) -> None:
    """The stage at `t` continues from its save, at epoch `epoch`: its epochs before that one
    ran before the run stopped (`on_epoch` told of them then, not again)."""

  def on_record(self, state: RunState, records: list[Record]) -> None:
    """The records of time step `state.t`, one per seed (already in `state.logs`). Inside
    one critical section with the other observers' writes of the same records."""

  def on_step(self, state: RunState) -> None:
    """Time step `state.t` is over; its records are written."""

  def on_end(self, state: RunState) -> dict[str, Any] | None:
    """The stream is over; the observer that writes the summary returns it."""
    del state
    return None

  def on_summary(self, summary: dict[str, Any]) -> None:
    """The run's summary, once it is written."""

  def on_interrupt(self) -> bool:
    """A signal stops the run; returns whether the last complete checkpoint changed."""
    return False

  def close(self) -> None:
    """The run is over (or failed); called once, last."""


class Observers:
  """Tells every observer, in order.

  The writes of one record (`record`) or one epoch (`epoch`) form one
  critical section, timed as I/O: a signal acts after all of them, so the
  record's outputs are complete or, after a crash, rewritten from the
  checkpoints.
  """

  def __init__(self, observers: Sequence[Observer], signals: interrupts.Signals,
               timer: timing.Breakdown):
    self.observers, self.signals, self.timer = list(observers), signals, timer

  def start(self, state: RunState, snapshot: Snapshot | None) -> None:
    for o in self.observers:
      o.on_start(state, snapshot)

  def epoch(self, t: int, epoch: int, loss, val_accuracy, ran) -> None:
    """An epoch of the stage at `t` ended. A signal waits for the stage's next `check`, after
    the stage has saved itself (`alma_jax.engine.train.fit_stage`)."""
    with self.timer("io_s"), self.signals.critical(act=False):
      for o in self.observers:
        o.on_epoch(t, epoch, loss, val_accuracy, ran)

  def stage_resumed(self, t: int, epoch: int) -> None:
    """The stage at `t` continues from its save at epoch `epoch`."""
    with self.timer("io_s"), self.signals.critical(act=False):
      for o in self.observers:
        o.on_stage_resumed(t, epoch)

  def record(self, state: RunState, records: list[Record]) -> None:
    with self.timer("io_s"), self.signals.critical():
      for o in self.observers:
        o.on_record(state, records)

  def step(self, state: RunState) -> None:
    for o in self.observers:
      o.on_step(state)

  def end(self, state: RunState) -> dict[str, Any]:
    """The summary (what the one observer that writes it returns)."""
    results = [o.on_end(state) for o in self.observers]
    summary = next(r for r in results if r is not None)
    for o in self.observers:
      o.on_summary(summary)
    return summary

  def interrupt(self) -> bool:
    """Whether an observer changed the last complete checkpoint on the way out."""
    return any([o.on_interrupt() for o in self.observers])

  def close(self) -> None:
    """Closes every observer, in order, even when one of them raises."""
    with contextlib.ExitStack() as stack:
      for o in reversed(self.observers):
        stack.callback(o.close)
