"""The checkpoints of a run: restoring the last one, saving the stream, saving stages.

Stream checkpoints (`<workdir>/checkpoints/`, `alma_jax.outputs.checkpoint`) are
written at t = 0, t = B and after every `config.checkpoint.every`-th stage,
asynchronously (orbax) while the loop goes on; the next checkpoint, the
summary, an interruption and the end of the run (before the workdir lock is
released) first wait for the one being written, so `io_s` holds only the
part that did not overlap training. A stage in progress is saved too
(`alma_jax.outputs.stage_checkpoint`); its save is removed once a stream checkpoint
at or after it is complete.
"""

from __future__ import annotations

import contextlib
import os

import jax
from absl import logging

from alma_jax.engine import population
from alma_jax.engine.metrics import Record
from alma_jax.observers.architecture import ArchitectureLog
from alma_jax.observers.base import Observer, RunContext
from alma_jax.observers.clock import Clock
from alma_jax.outputs import checkpoint as ckpt_lib
from alma_jax.outputs import interrupts
from alma_jax.outputs import stage_checkpoint
from alma_jax.outputs import workdir as wd


# The key of the checkpoint's facts that holds each seed's stage-policy memory.
POLICY_MEMO = "stage_policy_memo"


def due(config, t: int, stage: int, trained: bool, last: int) -> bool:
  """Whether time step `t` (after the `stage`-th stage) gets a stream checkpoint."""
  return t in (0, last) or (trained and stage % config.checkpoint.every == 0)


class Checkpoints(Observer):
  """The stream checkpoints and the stage saves (every process writes them together)."""

  def __init__(self, setup: RunContext, signals: interrupts.Signals, clock: Clock,
               architecture: ArchitectureLog):
    self.setup, self.signals, self.clock, self.architecture = setup, signals, clock, architecture
    self.ckpt: ckpt_lib.Checkpointer | None = None
    self.stage_store: stage_checkpoint.Store | None = None
    self._pending: int | None = None  # the step whose checkpoint is being written

  # -- restore -----------------------------------------------------------------------------------
  def restore(self) -> tuple[ckpt_lib.Snapshot | None, list[list[Record]]]:
    """The latest readable checkpoint (None: start afresh) and each seed's records in it."""
    s, c = self.setup, self.setup.config
    empty = [[] for _ in s.seeds]
    if not c.checkpoint.enabled:
      return None, empty
    self.stage_store = stage_checkpoint.Store(
        os.path.join(s.workdir, wd.STAGE_DIR), every_s=c.checkpoint.every_s,
        every_epochs=c.checkpoint.stage_every_epochs,
        identity={"config": wd.config_dict(c), "inputs": s.inputs},
        stopping=self.signals.stopping,
        facts=lambda: {"compiled": sorted(self.clock.compiled())},
        quarantine_dir=os.path.join(s.workdir, wd.CORRUPT_DIR))
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(s.workdir, wd.CHECKPOINT_DIR),
                                      c.checkpoint.max_to_keep)
    snap = self.ckpt.restore_latest(s.restore_target(),
                                    quarantine_dir=os.path.join(s.workdir, wd.CORRUPT_DIR),
                                    check_extra=s.check_saved_config)
    if snap is None:
      return None, empty
    if len(snap.records) != snap.t + 1:
      raise ckpt_lib.CheckpointError(f"checkpoint step {snap.t} holds {len(snap.records)} time "
                                     f"steps; expected {snap.t + 1}")
    return snap, [[Record.from_dict(r["seeds"][i]) for r in snap.records]
                  for i in range(len(s.seeds))]

  def on_start(self, state, snapshot) -> None:
    if snapshot is not None:
      self.signals.last_checkpoint = snapshot.t
      logging.info("resuming %s after t=%d/%d (its last complete checkpoint)", self.setup.workdir,
                   snapshot.t, self.setup.num_t)

  # -- the saves of a stage in progress ----------------------------------------------------------
  def stage(self, t: int, structure) -> stage_checkpoint.Store | None:
    """The saves of the stage at `t` (None: checkpoints are off)."""
    return None if self.stage_store is None else self.stage_store.begin(t, structure)

  def stage_done(self) -> None:
    """The stage's training is over: what the part of it before its save compiled counts."""
    if self.stage_store is not None:
      self.clock.add_compiled(self.stage_store.restored_facts.get("compiled", []))

  def stage_interrupted(self, t: int) -> None:
    """A signal stopped the stage at `t`: says where the same command continues it."""
    store = self.stage_store
    if store is not None and store.saved is not None and store.saved[0] == t:
      logging.warning("stage t=%d was saved %s: the same command continues it there",
                      *store.saved)

  # -- stream checkpoints ----------------------------------------------------------------------
  def on_step(self, state) -> None:
    s, t = self.setup, state.t
    if self.ckpt is None or not due(s.config, t, state.num_stages, state.trained, s.num_t):
      return
    with self.clock.timer("io_s"), self.signals.critical():
      self.finish(critical=False)  # the previous checkpoint (mostly written by now)
      extra = dict(self.clock.facts(), config=wd.config_dict(s.config), inputs=s.inputs,
                   architecture=self.architecture.lines)
      if state.policy_memo is not None:
        extra[POLICY_MEMO] = list(state.policy_memo)
      # The optimizer state is part of the state only when stages share it.
      kept = state.opt_state if s.config.train.keep_optimizer_state else None
      records = [{"t": j, "seeds": [log.records[j].to_dict() for log in state.logs]}
                 for j in range(t + 1)]
      self.ckpt.start_save(t, state.learner, kept,
                           jax.random.key_data(population.fold(s.keys, t)), records, extra)
      self._pending = t
      if self.signals.pending is not None:  # stopping: finish this checkpoint first
        self.finish(critical=False)

  def finish(self, critical: bool = True) -> None:
    """Waits until the checkpoint being written (asynchronously, by orbax, while the loop
    goes on) is complete; the run's last checkpoint is then that one."""
    if self._pending is None:
      return
    t, self._pending = self._pending, None
    with self.clock.timer("io_s"), (self.signals.critical() if critical
                                    else contextlib.nullcontext()):
      self.ckpt.wait()
      self.signals.last_checkpoint = t
      if self.stage_store is not None:
        self.stage_store.discard_through(t)

  def on_end(self, state) -> None:
    self.finish()  # the last checkpoint is complete before the summary exists

  def on_interrupt(self) -> bool:
    """The checkpoint being written completes first, so the message names it."""
    if self._pending is None:
      return False
    self.finish(critical=False)
    return True

  def close(self) -> None:
    """Waits for a checkpoint still being written (before the workdir lock is released),
    then closes the checkpointers."""
    if self.ckpt is not None:
      try:
        if self._pending is not None:
          self.finish(critical=False)
      finally:
        self.ckpt.close()
    if self.stage_store is not None:
      self.stage_store.close()
