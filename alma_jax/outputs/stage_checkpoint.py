"""Checkpoints inside a training stage (`<workdir>/checkpoints_stage/`).

A paper-scale stage is hours of training; the checkpoints of the stream
(`alma_jax.outputs.checkpoint`, between stages) would lose all of it. While a stage
trains, `Store` saves its position between two train calls (see
`alma_jax.engine.stage_save.StageCheckpoints`): every `config.checkpoint.every_s`
seconds, after every `config.checkpoint.stage_every_epochs`-th epoch, and
when a signal (SIGTERM, SIGINT, SIGHUP) asks the run to stop. In a
multi-process run the processes save together, so only the epoch rule
applies there (the clock and a signal are each process's own). A resumed run
recomputes the stream from its last stream checkpoint up to that stage (every
step is a deterministic function of config, seed and t), and the stage then
continues from its save instead of from its first epoch, to the records of an
uninterrupted stage.

Only the newest stage save is kept. It is used only by the stage it was
written in (same t, learner structure, config and input data); it is removed
once a stream checkpoint at or after its stage is complete. A stage save that
fails its checksums is set aside and the stage starts from its beginning.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import jax
from absl import logging

from alma_jax.outputs import checkpoint as ckpt_lib
from alma_jax.outputs import interrupts
from alma_jax.runtime import multihost


def where(position: dict) -> str:
  """Where a stage save continues its stage, in words ("at epoch 3, call 1", or after the
  stage's training for a stage saved once it had trained)."""
  if position.get("trained"):
    return "after its training"
  return f"at epoch {int(position['epoch'])}, call {int(position['next_call'])}"


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Store:
  """The stage saves of one run."""

  def __init__(self, directory: str, *, every_s: float, every_epochs: int, identity: dict,
               stopping: Callable[[], bool], facts: Callable[[], dict] = dict,
               quarantine_dir: str | None = None):
    """`identity`: JSON facts a save must share with the run (config, inputs); `stopping()`:
    whether a signal asks the run to stop (a save is written at once then); `facts()`: JSON
    facts of the run to keep with a save (`restored_facts` after `load`)."""
    self.directory, self.quarantine_dir = directory, quarantine_dir
    self.every_s, self.every_epochs = float(every_s), int(every_epochs)
    self.identity, self.stopping, self.facts = identity, stopping, facts
    self.restored_facts: dict = {}
    self._ckpt: ckpt_lib.Checkpointer | None = None
    self.t, self.structure, self._last = None, None, time.monotonic()
    self.saved: tuple[int, str] | None = None  # (t, `where`) of the last save

  def _open(self) -> ckpt_lib.Checkpointer:
    if self._ckpt is None:
      self._ckpt = ckpt_lib.Checkpointer(self.directory, max_to_keep=1)
    return self._ckpt

  def begin(self, t: int, structure) -> "Store":
    """Starts the saves of the stage at time step `t` (its learner's `structure`)."""
    self.t, self.structure, self._last, self.saved = t, structure, time.monotonic(), None
    self.restored_facts = {}
    return self

  # -- the StageCheckpoints protocol of alma_jax.engine.stage_save --------------------------------------------
  def load(self, template: dict):
    if not os.path.isdir(self.directory):
      return None
    ckpt = self._open()
    steps = ckpt.steps()
    if not steps:
      return None
    step = steps[-1]
    try:
      meta = ckpt.read_meta(step)
      if (meta.get("stage_t") != self.t
          or ckpt_lib.structure_from_json(meta.get("structure")) != self.structure):
        return None  # a save of another stage
      if meta.get("identity") != self.identity:
        logging.warning("stage save %d in %s was written by another config or from other "
                        "input data; the stage t=%d starts from its beginning", step,
                        self.directory, self.t)
        return None
      arrays = ckpt.restore_tree(step, _abstract(template), meta,
                                 what=f"the stage t={self.t} being resumed")
    except Exception as e:  # pylint: disable=broad-except  (any damage: the stage starts afresh)
      logging.warning("the stage save in %s cannot be used (%s); the stage t=%d starts from its "
                      "beginning", self.directory, " ".join(str(e).split())[:300], self.t)
      self._set_aside(step)
      return None
    pos, self.restored_facts = meta["position"], dict(meta.get("facts", {}))
    logging.info("stage t=%d continues from its save %s", self.t, where(pos))
    return arrays, pos

  def due(self, epoch_end: bool, epoch: int) -> bool:
    if epoch_end and self.every_epochs > 0 and epoch % self.every_epochs == 0:
      return True
    if jax.process_count() > 1:
      return False  # the processes save together: only at epochs all of them reach
    return self.stopping() or (self.every_s > 0 and time.monotonic() - self._last >= self.every_s)

  def seconds_to_save(self) -> float | None:
    """Seconds until the next timed save is due (None: none is timed)."""
    if self.every_s <= 0 or jax.process_count() > 1:
      return None
    return max(0.0, self.every_s - (time.monotonic() - self._last))

  def save(self, arrays: dict, position: dict) -> None:
    ckpt = self._open()
    step = (ckpt.steps() or [-1])[-1] + 1
    meta = {"format": ckpt_lib.FORMAT_VERSION, "t": step, "stage_t": self.t,
            "structure": ckpt_lib.structure_to_json(self.structure), "identity": self.identity,
            "position": position, "facts": self.facts()}
    ckpt.start_save_tree(step, arrays, meta)
    ckpt.wait()
    self._last = time.monotonic()
    self.saved = (self.t, where(position))
    logging.info("saved stage t=%d %s (%s)", self.t, self.saved[1], self.directory)

  # -- clean-up ------------------------------------------------------------------------------------
  def discard_through(self, t: int) -> None:
    """Removes the saves of stages up to `t` (a stream checkpoint of `t` is complete)."""
    if self._ckpt is None and not os.path.isdir(self.directory):
      return
    ckpt = self._open()
    for step in ckpt.steps():
      try:
        stage_t = ckpt.read_meta(step).get("stage_t", -1)
      except Exception:  # pylint: disable=broad-except  (an unreadable save is of no use)
        stage_t = -1
      if stage_t <= t:
        ckpt.delete(step)

  def _set_aside(self, step: int) -> None:
    path = os.path.join(self.directory, str(step))
    if multihost.is_primary() and os.path.isdir(path):
      ckpt_lib.set_aside(path, self.quarantine_dir, f"stage-{step}", "the damaged stage save")
    self._open().reload()

  def close(self) -> None:
    if self._ckpt is not None:
      self._ckpt.close()
      self._ckpt = None
