"""Per-step checkpoints of a run: a thin wrapper over orbax's CheckpointManager.

A checkpoint at time step t holds two items:
  * `state` (orbax StandardSave): the learner's `params` and `model_state`
    (BatchNorm statistics included), the optimizer state when the run keeps
    it across stages, and the raw data of the step's PRNG key;
  * `meta` (JSON): the format version, t, the learner's static `structure`
    (nested tuples, written as nested lists), the metrics records of
    t = 0 ... t, and free-form JSON facts of the run (`extra`).

Restoring needs a target tree of the right shapes, and the shapes follow the
structure (growth changes them): `restore` reads `meta` first and asks the
caller to build the abstract state for the saved structure.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Callable, Hashable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from alma_jax.methods.base import Learner

FORMAT_VERSION = 2  # 2: the state is stacked on a population axis


class _OrbaxInfoFilter:
  """Drops orbax's INFO/DEBUG lines (several per save) from the run's log; warnings stay."""

  def filter(self, record) -> bool:
    return (record.levelno >= logging.converter.STANDARD_WARNING
            or f"{os.sep}orbax{os.sep}" not in record.pathname)


logging.get_absl_logger().addFilter(_OrbaxInfoFilter())

# (structure, has_opt_state) -> abstract state dict (jax.ShapeDtypeStruct leaves)
# with keys "params", "model_state", "key" and, when asked, "opt_state".
BuildTarget = Callable[[Hashable, bool], dict]


class CheckpointError(ValueError):
  """A checkpoint cannot be read or does not fit the current run."""


class IncompatibleCheckpointError(CheckpointError):
  """A readable checkpoint written by a different run (no fallback helps)."""


# -- static structure <-> JSON ----------------------------------------------------
def structure_to_json(structure: Hashable) -> Any:
  """Nested tuples of str/int/float/bool/None -> nested lists (JSON-able)."""
  if isinstance(structure, tuple):
    return [structure_to_json(s) for s in structure]
  if structure is None or isinstance(structure, (bool, int, float, str)):
    return structure
  raise TypeError(f"a learner structure may hold only tuples, str, int, float, bool and None; "
                  f"got {type(structure).__name__}: {structure!r}")


def structure_from_json(obj: Any) -> Hashable:
  """Inverse of `structure_to_json`: lists become tuples, recursively."""
  if isinstance(obj, list):
    return tuple(structure_from_json(o) for o in obj)
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  raise CheckpointError(f"invalid learner structure element in checkpoint: {obj!r}")


# -- the restored content ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Snapshot:
  """Everything a run needs to continue after time step `t`."""

  t: int
  learner: Learner
  opt_state: Any  # None when the run does not keep the optimizer state
  key_data: np.ndarray  # raw data of the PRNG key of step t
  records: tuple[dict, ...]  # metrics records of t = 0 ... t
  extra: dict  # JSON facts of the run (e.g. compiled functions, elapsed time)


def _state_tree(learner: Learner, opt_state, key_data) -> dict:
  state = {"params": learner.params, "model_state": learner.model_state,
           "key": np.asarray(key_data, np.uint32)}
  if opt_state is not None:
    state["opt_state"] = opt_state
  return state


def _check_shapes(restored, target, step: int) -> None:
  bad = []

  def check(path, r, t):
    if tuple(r.shape) != tuple(t.shape) or r.dtype != t.dtype:
      bad.append(f"{jax.tree_util.keystr(path)}: {r.dtype}{list(r.shape)} != "
                 f"{t.dtype}{list(t.shape)}")

  jax.tree_util.tree_map_with_path(check, restored, target)
  if bad:
    raise IncompatibleCheckpointError(
        f"checkpoint step {step} does not fit the learner rebuilt from its structure: "
        + "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""))


class Checkpointer:
  """Saves and restores one run's checkpoints under `directory`."""

  def __init__(self, directory: str, max_to_keep: int):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=int(max_to_keep), create=True,
                                           cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)

  def steps(self) -> list[int]:
    """The steps of all complete checkpoints, oldest first."""
    return sorted(self._mngr.all_steps())

  # -- saving ---------------------------------------------------------------------
  def start_save(self, t: int, learner: Learner, opt_state, key_data, records, extra=None):
    """Starts writing the checkpoint of step `t`; `wait` finishes it."""
    meta = {"format": FORMAT_VERSION, "t": int(t),
            "structure": structure_to_json(learner.structure),
            "has_opt_state": opt_state is not None, "records": list(records),
            "extra": dict(extra or {})}
    args = ocp.args.Composite(state=ocp.args.StandardSave(_state_tree(learner, opt_state, key_data)),
                              meta=ocp.args.JsonSave(meta))
    self._mngr.save(int(t), args=args, force=True)

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def save(self, t: int, learner: Learner, opt_state, key_data, records, extra=None) -> None:
    """Writes the checkpoint of step `t` and waits until it is complete on disk."""
    self.start_save(t, learner, opt_state, key_data, records, extra)
    self.wait()

  # -- restoring --------------------------------------------------------------------
  def read_meta(self, step: int) -> dict:
    meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if not isinstance(meta, dict) or "format" not in meta:
      raise CheckpointError(f"checkpoint step {step} has no readable metadata")
    if meta["format"] != FORMAT_VERSION:
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} has format {meta['format']}; this version of alma_jax reads "
          f"format {FORMAT_VERSION}")
    if int(meta["t"]) != step:
      raise CheckpointError(f"checkpoint step {step} says t={meta['t']}")
    return meta

  def restore(self, step: int, build_target: BuildTarget,
              check_extra: Callable[[dict], None] | None = None) -> Snapshot:
    """Restores step `step` into the abstract state that `build_target` gives.

    `check_extra` (if given) sees the saved `extra` facts first and raises
    `IncompatibleCheckpointError` when they do not fit the current run.
    """
    meta = self.read_meta(step)
    if check_extra is not None:
      check_extra(dict(meta.get("extra", {})))
    structure = structure_from_json(meta["structure"])
    target = build_target(structure, bool(meta["has_opt_state"]))
    try:
      state = self._mngr.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    except ValueError as e:
      if "not compatible with the stored shape" in str(e):  # orbax's words for a shape mismatch
        raise IncompatibleCheckpointError(
            f"checkpoint step {step} does not fit the learner rebuilt from its structure "
            f"{structure!r}: {' '.join(str(e).split()[:12])}") from e
      raise
    _check_shapes(state, target, step)
    learner = Learner(params=state["params"], model_state=state["model_state"],
                      structure=structure)
    return Snapshot(t=step, learner=learner, opt_state=state.get("opt_state"),
                    key_data=np.asarray(state["key"]), records=tuple(meta["records"]),
                    extra=dict(meta.get("extra", {})))

  def restore_latest(self, build_target: BuildTarget, *, quarantine_dir: str | None = None,
                     check_extra: Callable[[dict], None] | None = None) -> Snapshot | None:
    """The newest checkpoint that restores; None if there is none.

    A checkpoint that fails to restore is skipped with a warning and moved to
    `quarantine_dir` (when given) once an older one restores, so that the run
    can write that step again. Raises `CheckpointError` when checkpoints
    exist but none restores, and at once for an incompatible one.
    """
    failures = []
    for step in reversed(self.steps()):
      try:
        snap = self.restore(step, build_target, check_extra)
      except IncompatibleCheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        logging.warning("checkpoint step %d in %s is unreadable (%s); trying an older one", step,
                        self.directory, reason)
        failures.append((step, f"step {step}: {type(e).__name__}: {reason}"))
        continue
      if failures:
        self._quarantine([s for s, _ in failures], quarantine_dir)
        logging.warning("resuming from the older checkpoint step %d", step)
      return snap
    if failures:
      raise CheckpointError(f"no checkpoint in {self.directory} can be restored ("
                            + "; ".join(f for _, f in failures) + ")")
    return None

  def _quarantine(self, steps: list[int], quarantine_dir: str | None) -> None:
    for step in steps:
      path = os.path.join(self.directory, str(step))
      if quarantine_dir:
        os.makedirs(quarantine_dir, exist_ok=True)
        dest = os.path.join(quarantine_dir, f"{step}-{int(time.time())}")
        shutil.move(path, dest)
        logging.warning("moved the unreadable checkpoint step %d to %s", step, dest)
      else:
        shutil.rmtree(path, ignore_errors=True)
    self._mngr.reload()

  def close(self) -> None:
    self._mngr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
