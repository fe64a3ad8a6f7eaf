"""Per-step checkpoints of a run: a thin wrapper over orbax's CheckpointManager.

A checkpoint at time step t holds two items:
  * `state` (orbax StandardSave): the learner's `params` and `model_state`
    (BatchNorm statistics included), the optimizer state when the run keeps
    it across stages, and the raw data of the step's PRNG key;
  * `meta` (JSON): the format version, t, the learner's static `structure`
    (nested tuples, written as nested lists), the metrics records of
    t = 0 ... t, and free-form JSON facts of the run (`extra`).

Every checkpoint is verified when it is restored: `meta` holds the SHA-256
of every saved array (its dtype, shape and bytes) and of its own content,
so a checkpoint whose files were damaged (a flipped bit, a truncated file)
is found, set aside and the previous one used instead. Arrays that this
process cannot read whole (sharded across the hosts of a multi-host run
and not replicated) are not covered.

Restoring needs a target tree of the right shapes, and the shapes follow the
structure (growth changes them): `restore` reads `meta` first and asks the
caller to build the abstract state for the saved structure.

A full or read-only file system raises `io_utils.WorkdirWriteError` naming
the checkpoint: before a save the directory is probed for writability and
free space (orbax's background threads otherwise log several tracebacks,
and on a read-only file system keep the process alive for minutes after the
error), and an error of the file system during the save is turned into it,
with orbax's tracebacks of that save left out of the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hashlib
import json
import logging as py_logging
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Hashable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from alma_jax.outputs import io_utils
from alma_jax.runtime import multihost
from alma_jax.state import Learner

FORMAT_VERSION = 2  # 2: the state is stacked on a population axis


class _OrbaxInfoFilter:
  """Drops orbax's INFO/DEBUG lines (several per save) from the run's log; warnings stay."""

  def filter(self, record) -> bool:
    return (record.levelno >= logging.converter.STANDARD_WARNING
            or f"{os.sep}orbax{os.sep}" not in record.pathname)


logging.get_absl_logger().addFilter(_OrbaxInfoFilter())


class _HoldOrbaxErrors:
  """Holds back orbax's ERROR lines (tracebacks of its background threads) during a save."""

  def __init__(self):
    self.held = []

  def filter(self, record) -> bool:
    if record.levelno >= py_logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
      self.held.append(record)
      return False
    return True


class _QuietClosedLoops:
  """sys.unraisablehook that drops the harmless reports of a failed save or restore.

  When one part of an orbax save fails, the event loop of its thread closes
  while tensorstore still calls back into it, and Python reports
  "RuntimeError: Event loop is closed" with a traceback on stderr. When a
  restore fails on one array, the reads of the other arrays are abandoned:
  closing their coroutines, whenever the garbage collector gets to them,
  reports "Encountered error while reading array index". Everything else
  goes to the previous hook.
  """

  def __init__(self):
    self.previous = sys.unraisablehook

  def __call__(self, unraisable):
    if not (_closed_loop(unraisable) or _abandoned_read(unraisable)):
      self.previous(unraisable)

  def install(self) -> None:
    sys.unraisablehook = self

  def uninstall(self) -> None:
    if sys.unraisablehook is self:
      sys.unraisablehook = self.previous


def _closed_loop(unraisable) -> bool:
  return (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed")


def _abandoned_read(unraisable) -> bool:
  code = getattr(unraisable.object, "cr_code", None)  # a coroutine of orbax's reads
  return (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
          and isinstance(unraisable.exc_value, Exception)
          and isinstance(unraisable.exc_value.__cause__, GeneratorExit))


def _finalise_abandoned_reads() -> None:
  """Closes, now and quietly, the reads that a failed restore left to the garbage collector."""
  quiet = _QuietClosedLoops()
  quiet.install()
  try:
    gc.collect()
  finally:
    quiet.uninstall()


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")  # how tensorstore reports errno


def _write_errno(exc: BaseException) -> int | None:
  """The errno of a full or read-only file system behind an error of orbax, if it is one."""
  seen = 0
  while exc is not None and seen < 8:
    if io_utils.is_write_error(exc):
      return exc.errno
    m = _OS_ERROR_CODE.search(str(exc))
    if m and io_utils.is_write_error(OSError(int(m.group(1)), "")):
      return int(m.group(1))
    exc, seen = exc.__cause__ or exc.__context__, seen + 1
  return None

# (structure, has_opt_state) -> abstract state dict (jax.ShapeDtypeStruct leaves)
# with keys "params", "model_state", "key" and, when asked, "opt_state".
BuildTarget = Callable[[Hashable, bool], dict]


class CheckpointError(ValueError):
  """A checkpoint cannot be read or does not fit the current run."""


class IncompatibleCheckpointError(CheckpointError):
  """A readable checkpoint written by a different run (no fallback helps)."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint whose content differs from what was saved (its checksums do not match)."""


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


# -- checksums ---------------------------------------------------------------------
def array_digest(x) -> str | None:
  """SHA-256 of an array's dtype, shape and bytes; None when this process cannot read it whole."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.is_fully_replicated:
      return None
    x = x.addressable_data(0)
  a = np.ascontiguousarray(np.asarray(x))
  h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
  h.update(a.tobytes())
  return h.hexdigest()


def tree_digests(tree) -> dict[str, str]:
  """{path: SHA-256} of every array of `tree` that this process can read whole."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    digest = array_digest(leaf)
    if digest is not None:
      out[jax.tree_util.keystr(path)] = digest
  return out


def _shape_text(leaf) -> str:
  return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"


def tree_shapes(tree) -> dict[str, str]:
  """{path: "dtype[shape]"} of every array of `tree` (global shapes)."""
  return {jax.tree_util.keystr(path): _shape_text(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _meta_digest(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k != "checksum"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _verify_arrays(restored, saved: dict | None, step: int) -> None:
  """Raises `CorruptCheckpointError` for an array whose bytes differ from what was saved."""
  if saved is None:  # written before checksums were kept
    return
  bad = [p for p, d in tree_digests(restored).items() if p in saved and saved[p] != d]
  if bad:
    raise CorruptCheckpointError(
        f"checkpoint step {step} is damaged: {len(bad)} array(s) differ from what was saved "
        f"(checksum mismatch: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")


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


def _check_shapes(saved: dict[str, str], target, step: int, what: str) -> None:
  """Raises `IncompatibleCheckpointError` when an array of `saved` ({path: "dtype[shape]"},
  `tree_shapes`) differs from the same path's array of `target`."""
  expected = tree_shapes(target)
  bad = [f"{p}: {saved[p]} != {t}" for p, t in expected.items() if p in saved and saved[p] != t]
  if bad:
    raise IncompatibleCheckpointError(
        f"checkpoint step {step} does not fit {what}: "
        + "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""))


def abstract_state(method, tx, keys, structure, has_opt_state: bool,
                   shardings: Callable[[str, Any], Any]) -> dict:
  """What a checkpoint of a stacked population (one PRNG key per member in `keys`) restores
  into, for a learner of `structure`: abstract arrays (`jax.ShapeDtypeStruct`) of its params,
  model state, keys and (`has_opt_state`) the optimizer state of `tx`, each part placed as
  `shardings(part name, abstract part)` says."""
  learner = jax.eval_shape(jax.vmap(lambda k: method.init(k, structure)), keys)
  if learner.structure != structure:
    raise IncompatibleCheckpointError(
        f"method {method.name!r} rebuilds structure {learner.structure!r} from the "
        f"checkpoint's structure {structure!r}")
  tree = {"params": learner.params, "model_state": learner.model_state,
          "key": jax.eval_shape(jax.vmap(jax.random.key_data), keys)}
  if has_opt_state:
    tree["opt_state"] = jax.eval_shape(
        jax.vmap(lambda k: tx.init(method.partition(method.init(k, structure))[0])), keys)
  return {k: jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          v, shardings(k, v)) for k, v in tree.items()}


def set_aside(path: str, quarantine_dir: str | None, name: str, what: str) -> None:
  """Moves a damaged save `path` into `quarantine_dir` (as `name`-<time>), or deletes it when
  there is none; the caller is the one process that writes."""
  if quarantine_dir:
    os.makedirs(quarantine_dir, exist_ok=True)
    dest = os.path.join(quarantine_dir, f"{name}-{int(time.time())}")
    shutil.move(path, dest)
    logging.warning("moved %s %s to %s", what, path, dest)
  else:
    shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
  """Saves and restores one run's checkpoints under `directory`."""

  def __init__(self, directory: str, max_to_keep: int):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=int(max_to_keep), create=True,
                                           cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)
    self._saving: int | None = None  # the step being written
    self._held: _HoldOrbaxErrors | None = None
    self._save_failed = False  # a save failed for a full or read-only file system
    self._quiet: _QuietClosedLoops | None = None

  def steps(self) -> list[int]:
    """The steps of all complete checkpoints, oldest first."""
    return sorted(self._mngr.all_steps())

  # -- saving ---------------------------------------------------------------------
  def start_save(self, t: int, learner: Learner, opt_state, key_data, records, extra=None):
    """Starts writing the checkpoint of step `t`; `wait` finishes it.

    Raises `io_utils.WorkdirWriteError` when the directory is not writable
    or lacks the space for it (nothing is written then).
    """
    meta = {"format": FORMAT_VERSION, "t": int(t),
            "structure": structure_to_json(learner.structure),
            "has_opt_state": opt_state is not None, "records": list(records),
            "extra": dict(extra or {})}
    self.start_save_tree(int(t), _state_tree(learner, opt_state, key_data), meta)

  def start_save_tree(self, step: int, state: dict, meta: dict) -> None:
    """Starts writing `state` (a tree of arrays) and `meta` (JSON) as checkpoint `step`, with
    the checksums that `restore_tree` and `read_meta` verify; `wait` finishes it."""
    meta = dict(meta, checksums=tree_digests(state), shapes=tree_shapes(state))
    meta["checksum"] = _meta_digest(meta)
    self._check_writable(int(step), state, meta)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    self._saving = int(step)
    self._held = _HoldOrbaxErrors()
    logging.get_absl_logger().addFilter(self._held)
    with self._write_errors(finished=False):
      self._mngr.save(int(step), args=args, force=True)

  def wait(self) -> None:
    """Waits until the checkpoint being written is complete; raises its errors."""
    with self._write_errors(finished=True):
      self._mngr.wait_until_finished()

  def _check_writable(self, step: int, state, meta) -> None:
    """Raises `WorkdirWriteError` unless the directory takes a file and has room for `state`."""
    path = os.path.join(self.directory, str(step))
    with io_utils.output_errors(path):
      os.makedirs(self.directory, exist_ok=True)
      fd, probe = tempfile.mkstemp(dir=self.directory, prefix=".write-test-")
      try:
        os.write(fd, b"x")
        os.fsync(fd)
      finally:
        os.close(fd)
        os.unlink(probe)
    # The arrays' bytes (uncompressed; OCDBT may need less) and 256 KiB for its metadata.
    need = sum(int(getattr(x, "nbytes", 8)) for x in jax.tree.leaves(state))
    need += len(json.dumps(meta)) + 2**18
    try:
      free = shutil.disk_usage(self.directory).free
    except OSError:
      return
    if free < need:
      raise io_utils.WorkdirWriteError(
          path, errno.ENOSPC, f"No space left on device (it needs about {need / 2**20:.1f} MiB, "
          f"{free / 2**20:.1f} MiB are free)")

  @contextlib.contextmanager
  def _write_errors(self, finished: bool):
    """Turns a file system error of the save in progress into `WorkdirWriteError`.

    `finished`: the block ends the save (orbax's held error lines are then logged).
    """
    try:
      yield
    except BaseException as e:
      err = _write_errno(e)
      if err is None:
        self._end_save(report=True)
        raise
      # Other threads of the failed save may still log the same error: their lines
      # stay held until `close`. Its partial folder is removed when a run opens the
      # directory again (cleanup_tmp_directories).
      self._save_failed = True
      if self._quiet is None:
        self._quiet = _QuietClosedLoops()
        self._quiet.install()
      path = os.path.join(self.directory, str(self._saving))
      logging.info("orbax could not write %s: %s", path, " ".join(str(e).split())[:500])
      raise io_utils.WorkdirWriteError(path, err) from e
    if finished:
      self._end_save(report=True)

  def _end_save(self, report: bool) -> None:
    """Removes the hold on orbax's error lines; `report` logs the held ones."""
    held, self._held = self._held, None
    if held is None:
      return
    logging.get_absl_logger().removeFilter(held)
    if report:
      for record in held.held:
        logging.get_absl_logger().handle(record)

  def save(self, t: int, learner: Learner, opt_state, key_data, records, extra=None) -> None:
    """Writes the checkpoint of step `t` and waits until it is complete on disk."""
    self.start_save(t, learner, opt_state, key_data, records, extra)
    self.wait()

  # -- restoring --------------------------------------------------------------------
  def read_meta(self, step: int) -> dict:
    meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if not isinstance(meta, dict) or "format" not in meta:
      raise CheckpointError(f"checkpoint step {step} has no readable metadata")
    if "checksum" in meta and meta["checksum"] != _meta_digest(meta):
      raise CorruptCheckpointError(f"checkpoint step {step} is damaged: its metadata differ from "
                                   "what was saved (checksum mismatch)")
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
    state = self.restore_tree(step, target, meta, what=f"the learner rebuilt from its structure "
                                                      f"{structure!r}")
    learner = Learner(params=state["params"], model_state=state["model_state"],
                      structure=structure)
    return Snapshot(t=step, learner=learner, opt_state=state.get("opt_state"),
                    key_data=np.asarray(state["key"]), records=tuple(meta["records"]),
                    extra=dict(meta.get("extra", {})))

  def restore_tree(self, step: int, target, meta: dict, what: str = "the target"):
    """The arrays of checkpoint `step` restored into `target` (abstract arrays with their
    shardings), checked against the shapes of `target` and the checksums in `meta`."""
    if "shapes" in meta:  # before any read starts (saves of older versions have no shapes)
      _check_shapes(meta["shapes"], target, step, what)
    failure = None
    try:
      state = self._mngr.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    except Exception as e:  # pylint: disable=broad-except  (raised again below, as text)
      failure = (type(e).__name__, " ".join(str(e).split()))
    if failure is not None:
      # Outside the handler, orbax's traceback, which holds the reads of the other arrays,
      # is gone: they are closed here rather than whenever the garbage collector runs.
      _finalise_abandoned_reads()
      kind, text = failure
      if "not compatible with the stored shape" in text:  # orbax's words for a mismatch
        raise IncompatibleCheckpointError(
            f"checkpoint step {step} does not fit {what}: {' '.join(text.split()[:12])}")
      raise CheckpointError(f"checkpoint step {step} cannot be read: {kind}: {text[:2000]}")
    _check_shapes(tree_shapes(state), target, step, what)
    _verify_arrays(state, meta.get("checksums"), step)
    return state

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
    for step in steps if multihost.is_primary() else ():
      set_aside(os.path.join(self.directory, str(step)), quarantine_dir, f"{step}",
                "the unreadable checkpoint step")
    multihost.sync("alma_jax: unreadable checkpoints moved")
    self._mngr.reload()

  def delete(self, step: int) -> None:
    """Removes the checkpoint of `step`."""
    self._mngr.delete(step)

  def reload(self) -> None:
    """Reads the directory again (after checkpoints were moved away)."""
    self._mngr.reload()

  def close(self) -> None:
    try:
      self._mngr.close()
    finally:
      self._end_save(report=not self._save_failed)
      if self._quiet is not None:
        self._quiet.uninstall()
        self._quiet = None

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
