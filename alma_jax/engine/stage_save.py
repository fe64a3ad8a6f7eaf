"""A training stage in progress, saved between two train calls and continued from there.

A stage's position is the epoch, the next call, each member's data-order
generator as it was before the epoch's orders were drawn, the epoch's losses
so far and the early-stopping state (`epoch.StopState`, with the best
accuracies as the host reports them); with the train state and the best
parameters that is all it needs to continue to exactly the result of an
uninterrupted stage. Where the saves go is `StageCheckpoints`
(`alma_jax.outputs.stage_checkpoint`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from alma_jax.engine import timing
from alma_jax.state import Learner, StopState, TrainState


@dataclasses.dataclass(frozen=True)
class Progress:
  """Where a stage's early stopping stands: the rule's state, each member's best learner and
  each selection unit's best validation accuracy (float64, as reported)."""

  stop: StopState
  best: Learner
  best_acc: np.ndarray  # (S, U); -1: no best yet


class StageCheckpoints(Protocol):
  """Saves a stage in progress and hands back the last save (`alma_jax.outputs.stage_checkpoint`)."""

  def load(self, template: dict) -> tuple[dict, dict] | None:
    """(arrays shaped like `template`, position) of the stage's last save, or None."""

  def due(self, epoch_end: bool, epoch: int) -> bool:
    """Whether to save now (after a train call; `epoch_end`: it ended epoch `epoch`)."""

  def save(self, arrays: dict, position: dict) -> None:
    """Writes the stage's arrays and position (complete on return)."""


@dataclasses.dataclass(frozen=True)
class Resume:
  """Where a saved stage continues: the epoch, its next call, its losses so far."""

  epoch: int
  next_call: int
  losses: list
  finite: np.ndarray | None


def _arrays(state: TrainState, best: Learner) -> dict:
  return {"state": {"trainable": state.trainable, "frozen": state.frozen,
                    "model_state": state.model_state, "opt_state": state.opt_state},
          "best": {"params": best.params, "model_state": best.model_state}}


def restore(checkpoints: StageCheckpoints, state: TrainState, p: Progress, rngs,
            timer: timing.Breakdown) -> tuple[TrainState, Progress, Resume | None]:
  """(train state, progress, `Resume`) of the stage's last save, its generators' states set
  in `rngs` and its timings added to `timer`; (`state`, `p`, None) when there is none."""
  saved = checkpoints.load(_arrays(state, p.best))
  if saved is None:
    return state, p, None
  arrays, pos = saved
  saved_p = pos["progress"]
  p = Progress(StopState.from_lists(saved_p, p.stop),
               Learner(params=arrays["best"]["params"], model_state=arrays["best"]["model_state"],
                       structure=p.best.structure),
               np.asarray(saved_p["best_acc"], np.float64).reshape(p.best_acc.shape))
  for rng, st in zip(rngs, pos["rng_states"]):
    rng.bit_generator.state = st
  timer.add(pos["timings"])
  a = arrays["state"]
  state = TrainState(a["trainable"], a["frozen"], a["model_state"], a["opt_state"],
                     state.anchor)  # not saved: the stage's own
  losses = [np.asarray(l, np.float32) for l in pos["losses"]]
  finite = None if pos["finite"] is None else np.asarray(pos["finite"], bool)
  return state, p, Resume(int(pos["epoch"]), int(pos["next_call"]), losses, finite)


class Saver:
  """Writes the stage's position when `checkpoints` says it is due."""

  def __init__(self, checkpoints: StageCheckpoints, rngs, timer: timing.Breakdown):
    self.checkpoints, self.rngs, self.timer = checkpoints, rngs, timer
    self.epoch, self.rng_states = 0, []
    self.every_epochs = int(getattr(checkpoints, "every_epochs", 0) or 0)

  def epoch_start(self, epoch: int) -> None:
    """Notes each member's data-order generator before the epoch draws its orders."""
    self.epoch = epoch
    self.rng_states = [rng.bit_generator.state for rng in self.rngs]

  def after_call(self, p: Progress, state: TrainState, next_call: int, losses: list, finite,
                 epoch_end: bool) -> None:
    """After a train call of the current epoch (`epoch_end`: its last)."""
    if self.checkpoints.due(epoch_end, self.epoch):
      self._save(p, state, self.epoch, next_call, self.rng_states, losses, finite)

  def seconds_to_save(self) -> float | None:
    """Seconds to the next timed save (None: no timed saves)."""
    left = getattr(self.checkpoints, "seconds_to_save", None)
    return None if left is None else left()

  def stage_end(self, p: Progress, state: TrainState, epochs: int) -> None:
    """After the stage's last epoch, when a signal asks the run to stop: saves the finished
    stage (continuing after epoch `epochs`, i.e. with nothing left to train), so that the stop
    keeps its training."""
    if getattr(self.checkpoints, "stopping", lambda: False)():
      self._at_epoch(p, state, epochs + 1, trained=True)

  def between_epochs(self, p: Progress, state: TrainState, epoch: int, *,
                     segment: bool = False) -> bool:
    """After epoch `epoch` (its rule applied; the data-order generators have drawn exactly
    the epochs up to it): saves the stage to continue at the next epoch when due, and
    returns whether it saved. Driven per epoch, a save is due here only when asked for
    (a signal during the evaluation); after a segment of the whole-stage program, as after
    an epoch's last train call."""
    if not self.checkpoints.due(segment, epoch):
      return False
    self._at_epoch(p, state, epoch + 1)
    return True

  def _at_epoch(self, p: Progress, state: TrainState, epoch: int, trained: bool = False) -> None:
    self._save(p, state, epoch, 0, [rng.bit_generator.state for rng in self.rngs], [], None,
               trained)

  def _save(self, p: Progress, state, epoch, next_call, rng_states, losses, finite,
            trained: bool = False) -> None:
    position = {
        **({"trained": True} if trained else {}),  # its training over: nothing left to run
        "epoch": epoch, "next_call": next_call, "rng_states": rng_states,
        "losses": [np.asarray(l, np.float32).tolist() for l in losses],
        "finite": None if finite is None else np.asarray(finite).tolist(),
        "progress": dict(p.stop.as_lists(), best_acc=np.asarray(p.best_acc).tolist()),
        "timings": self.timer.as_dict()}
    self.checkpoints.save(_arrays(state, p.best), position)
