"""The run's output directory: file names, checks, resume compatibility, clean-up.

A workdir holds `config.json`, `log.jsonl`, `summary.json`,
`architecture.jsonl` and `checkpoints/` (and `seed_<seed>/` folders with
the outputs of each seed when several seeds share a program). One run owns
it at a time (`alma_jax.outputs.workdir_lock`); `check_outputs` refuses a workdir
whose records no checkpoint can resume.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, Sequence

from absl import logging
import ml_collections

from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError
from alma_jax.outputs import io_utils
from alma_jax.outputs import tensorboard

CONFIG_FILE, LOG_FILE, SUMMARY_FILE = "config.json", "log.jsonl", "summary.json"
# One line per training stage: t and the method's description of the architecture
# after it (members, experts per mixture layer, ...), for plots of growth.
ARCH_FILE = "architecture.jsonl"
CHECKPOINT_DIR, CORRUPT_DIR = "checkpoints", "checkpoints_unreadable"
# The checkpoint of a training stage in progress (`alma_jax.outputs.stage_checkpoint`).
STAGE_DIR = "checkpoints_stage"
LOCK_FILE = ".lock"  # alma_jax.outputs.workdir_lock
ERROR_PNG = "error.png"  # test error vs t, drawn when the run ends
SEED_DIR_PREFIX = "seed_"  # outputs of one seed when config.num_seeds > 1


def seed_dir(workdir: str, seed: int) -> str:
  return os.path.join(workdir, f"{SEED_DIR_PREFIX}{seed}")


def check_writable(workdir: str, flag: str = "--workdir",
                   holds: str = "the run's outputs") -> None:
  """The workdir exists (created if needed) and is writable; the errors name it as `flag`
  (a sweep's `--root`, which `holds` the points' workdirs)."""
  if not workdir:
    raise ConfigError(f"{flag} is empty; give a directory for {holds}")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"{flag}={workdir} exists and is not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=workdir, prefix=".write-test-")
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise ConfigError(f"{flag}={workdir} is not writable: {e.strerror or e}") from e


def has_progress(workdir: str) -> bool:
  """Whether `workdir` holds records, checkpoints or a summary of a run."""
  ckpt_dir, log = os.path.join(workdir, CHECKPOINT_DIR), os.path.join(workdir, LOG_FILE)
  return (os.path.exists(os.path.join(workdir, SUMMARY_FILE))
          or (os.path.exists(log) and os.path.getsize(log) > 0)
          or (os.path.isdir(ckpt_dir) and any(n[:1].isdigit() for n in os.listdir(ckpt_dir))))


WANDB_FILE, WANDB_DIR = "wandb_run.json", "wandb"  # alma_jax.outputs.wandb_log (config.log.wandb)
_FILES = (CONFIG_FILE, LOG_FILE, SUMMARY_FILE, ARCH_FILE, ERROR_PNG, WANDB_FILE)
_DIRS = (CHECKPOINT_DIR, CORRUPT_DIR, STAGE_DIR, WANDB_DIR)
_SEED_FILES = (CONFIG_FILE, LOG_FILE, SUMMARY_FILE, WANDB_FILE)
_SEED_DIRS = (WANDB_DIR,)


def check_entries(workdir: str) -> None:
  """Refuses output paths that are symbolic links or of the wrong kind.

  A run writes only regular files and directories of its own in its
  workdir: a symbolic link there would make it write through the link.
  """
  def check(path: str, want_dir: bool) -> None:
    if os.path.islink(path):
      raise ConfigError(f"{path} is a symbolic link; a run writes only regular files and "
                        "directories in its workdir: remove the link (or choose another "
                        "--workdir)")
    if os.path.exists(path) and os.path.isdir(path) != want_dir:
      kind = "a directory" if want_dir else "a regular file"
      raise ConfigError(f"{path} is not {kind}, which the run writes there: move it away (or "
                        "choose another --workdir)")

  for name in _FILES + (LOCK_FILE,):
    check(os.path.join(workdir, name), False)
  for name in _DIRS:
    check(os.path.join(workdir, name), True)
  for d in output_dirs(workdir)[1:]:
    check(d, True)
    for name in _SEED_FILES:
      check(os.path.join(d, name), False)


# A checkpoint step folder of the run: `<step>` (complete), `<step>.orbax-checkpoint-tmp-<n>`
# (being written) or `<step>-<unix time>` (set aside in CORRUPT_DIR).
_STEP_NAME = re.compile(r"^\d+(\.orbax-checkpoint-tmp-\d+|-\d+)?$")
# The run's metadata in a step folder (orbax's and the `meta` item of alma_jax.outputs.checkpoint).
_STEP_MARKERS = ("_CHECKPOINT_METADATA", "meta")
# Links W&B leaves in its folder next to the run folders (to the latest run's files).
_WANDB_LINKS = ("latest-run", "debug.log", "debug-internal.log")


def _is_step_folder(path: str) -> bool:
  """Whether `path` is a checkpoint step folder written by a run (numbered, with its metadata)."""
  name = os.path.basename(path)
  if _STEP_NAME.match(name) is None or os.path.islink(path) or not os.path.isdir(path):
    return False
  return (".orbax-checkpoint-tmp-" in name  # its metadata may not be written yet
          or any(os.path.lexists(os.path.join(path, m)) for m in _STEP_MARKERS))


def _wandb_run_id(directory: str) -> str | None:
  """The id of the W&B run a run logged from `directory` (its `WANDB_FILE`), if known."""
  try:
    state = io_utils.read_json(os.path.join(directory, WANDB_FILE))
  except (OSError, ValueError):
    return None
  run_id = state.get("id") if isinstance(state, dict) else None
  return run_id if isinstance(run_id, str) and re.fullmatch(r"[0-9A-Za-z_-]+", run_id) else None


def _is_wandb_folder(path: str, run_id: str | None) -> bool:
  """Whether `path` is the folder W&B made in `wandb/` for the run `run_id`
  (`run-<date>_<time>-<id>` or `offline-run-...`; a resumption within the same second as the
  previous folder gets `-<n>` after the id)."""
  if run_id is None or os.path.islink(path) or not os.path.isdir(path):
    return False
  return re.fullmatch(r"(offline-)?run-\d{8}_\d{6}-" + re.escape(run_id) + r"(-\d+)?",
                      os.path.basename(path)) is not None


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.unlink(path)


def _clear_folder(path: str, ours, kept: list[str]) -> None:
  """Removes the entries of the folder `path` for which `ours(entry path)` holds, then the
  folder itself when nothing else is left in it; what is left goes to `kept`."""
  if os.path.islink(path) or not os.path.isdir(path):
    _remove(path)  # refused by `check_entries` before a run writes there
    return
  for name in sorted(os.listdir(path)):
    if ours(os.path.join(path, name)):
      _remove(os.path.join(path, name))
  if os.path.isdir(path):
    for name in _WANDB_LINKS:  # W&B's links to a folder just removed
      link = os.path.join(path, name)
      if os.path.islink(link) and not os.path.exists(link):
        os.unlink(link)
  left = sorted(os.listdir(path))
  if left:
    kept.extend(os.path.join(path, n) for n in left)
  else:
    os.rmdir(path)


def _clear_output_dir(directory: str, files, dirs, kept: list[str]) -> None:
  """Removes from `directory` (the workdir or a seed folder) the files and folders a run
  writes there; anything else is added to `kept`."""
  run_id = _wandb_run_id(directory)
  for name in files:
    _remove(os.path.join(directory, name))
  for path in tensorboard.event_files(directory):
    _remove(path)
  for name in dirs:
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
      continue
    if name == WANDB_DIR:
      _clear_folder(path, lambda p: _is_wandb_folder(p, run_id), kept)
    else:
      _clear_folder(path, _is_step_folder, kept)


def clear_outputs(workdir: str) -> None:
  """Removes the outputs a run wrote in `workdir` (nothing else in it).

  Checkpoint folders lose only their numbered step folders that hold a run's
  metadata, `wandb/` only the W&B run folders of the run whose id the workdir
  records (`WANDB_FILE`); a folder is removed when nothing else is left in it,
  and what is kept is named in the log.
  """
  kept: list[str] = []
  before = _tree(workdir)
  _clear_output_dir(workdir, _FILES, _DIRS, kept)
  for d in output_dirs(workdir)[1:]:
    if os.path.islink(d):
      kept.append(d)
      continue
    _clear_output_dir(d, _SEED_FILES, _SEED_DIRS, kept)
    left = [os.path.join(d, n) for n in sorted(os.listdir(d))]
    if not left:
      os.rmdir(d)
    kept.extend(p for p in left if not any(k.startswith(p + os.sep) for k in kept))
  if before - _tree(workdir):  # nothing to say where no run had written
    logging.warning("removed the previous run's outputs from %s (overwrite)", workdir)
  if kept:
    logging.warning("kept %s, which a run does not write (overwrite)", ", ".join(kept))


def _tree(directory: str) -> set[str]:
  """The paths of every file, folder and link below `directory` (links not followed)."""
  out = set()
  for root, dirs, files in os.walk(directory):
    out.update(os.path.join(root, n) for n in dirs + files)
  return out


def sync_architecture_log(workdir: str, last_t: int, lines: list[dict] | None = None) -> None:
  """Rewrites `ARCH_FILE` with the lines of t <= `last_t` (what a resumed run has done).

  `lines`: the lines a checkpoint holds (they replace the file's); otherwise
  the file's own lines are kept, and a line that cannot be read is an error
  naming the file.
  """
  path = os.path.join(workdir, ARCH_FILE)
  if last_t < 0:
    lines = []
  if lines is None:
    try:
      lines = io_utils.read_jsonl(path)
      kept = [r for r in lines if int(r["t"]) <= last_t]
    except (ValueError, KeyError, TypeError) as e:
      raise ConfigError(f"{path} cannot be read ({e}) and the checkpoint resumed from does not "
                        "hold its lines; delete it to resume (the lines before the checkpoint "
                        "are then lost), or pass --overwrite") from e
  else:
    kept = [r for r in lines if int(r["t"]) <= last_t]
  io_utils.write_jsonl_atomic(path, kept)


# -- config compatibility ---------------------------------------------------------------------
def config_dict(config) -> dict:
  """A config or the run's options as plain JSON values (what config.json holds)."""
  if hasattr(config, "to_json"):  # a ConfigDict
    return json.loads(config.to_json())
  return json.loads(json.dumps(config.to_dict()))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {"a.b.c": leaf}."""
  if isinstance(tree, dict) and tree:
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def _is_nan(v) -> bool:
  return isinstance(v, float) and math.isnan(v)


def _declared_field(path: str, config: dict) -> F.Field | None:
  """The field at `path` of the resolved config `config`: a method's field is its config's
  method's (methods may give one path different defaults); None where unknown."""
  if path.startswith("method."):
    try:
      declaration = plugins.method(config.get("method", {}).get("name", ""))
    except ConfigError:  # a method this code does not know: not one of its fields
      return None
    try:
      fields = declaration.fields(ml_collections.ConfigDict(config))
    except (AttributeError, KeyError, TypeError, ValueError):  # a config without the section
      fields = declaration.FIELDS
    return next((f for f in fields if f.path == path), None)
  try:
    return F.declared(path)
  except KeyError:
    return None


def added_field_at_default(path: str, value: Any, config: dict) -> bool:
  """Whether `path` is a field declared after runs were written (`config_lib.ADDED_FIELDS`)
  and `value` is its default in `config`: a config lacking it ran the same way."""
  if path not in config_lib.ADDED_FIELDS:
    return False
  field = _declared_field(path, config)
  dataset = config.get("data", {}).get("name", "")
  return field is not None and value == field.default_for(dataset)


def hashed_value(path: str, value: Any, config: dict) -> Any:
  """The value of field `path` that a config's hash takes: a field whose default changed
  (`Field.was_default`) hashes its new default as the old one, so a config at either names
  the folder that earlier runs of it were given (`config_resolve.config_hash`)."""
  if path not in F.CHANGED_DEFAULTS:
    return value
  field = _declared_field(path, config)
  if field is None or field.was_default is F.UNCHANGED:
    return value
  dataset = config.get("data", {}).get("name", "")
  return field.was_default if value == field.default_for(dataset) else value


def config_diff(old: dict, new: dict, ignore: Sequence[str] | None = None) -> list[str]:
  """'config.path: old → new' for every differing field (dotted paths) but the resumable ones
  (and fields added since `old` was written, at their defaults; a field that `old` lacks and
  that older runs ran with another value, `config_lib.ADDED_WITH_OLD_VALUE`, has that value)."""
  ignore = config_lib.resumable_paths() if ignore is None else ignore
  a, b = flatten(old), flatten(new)
  absent = "<absent>"
  diffs = []
  for k in sorted(set(a) | set(b)):
    if k in ignore:
      continue
    if k not in a and added_field_at_default(k, b[k], new):
      continue
    va, vb = a.get(k, config_lib.ADDED_WITH_OLD_VALUE.get(k, absent)), b.get(k, absent)
    if va != vb and not (_is_nan(va) and _is_nan(vb)):
      diffs.append(f"config.{k}: {va!r} → {vb!r}")
  return diffs


def previous_config(workdir: str) -> dict | None:
  """The config (its `config.json`) of the run that `workdir` holds progress of, the run a
  run there resumes; None where it holds none."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not has_progress(workdir) or not os.path.exists(path):
    return None
  try:
    return io_utils.read_json(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} cannot be read ({e}); delete it to resume from the checkpoints "
                      f"(they hold the config and check it), or {_NEW_RUN_HINT}") from e


_NEW_RUN_HINT = ("choose another --workdir, or pass --overwrite to discard the old run's "
                 "outputs")


def check_resume(workdir: str, config) -> None:
  """Raises when `workdir` holds progress of a run with a different config."""
  old = previous_config(workdir)
  diffs = [] if old is None else config_diff(old, config_dict(config))
  if diffs:
    raise ConfigError(f"--workdir={workdir} holds a run with a different config: "
                      f"{'; '.join(diffs)}; rerun with the old values to resume it, or "
                      f"{_NEW_RUN_HINT}")


# -- previous outputs ---------------------------------------------------------------------------
class UnresumableWorkdirError(ValueError):
  """The workdir holds records that no checkpoint can resume."""


def output_dirs(workdir: str) -> list[str]:
  """The workdir and its per-seed output folders (`seed_<k>/` of a `num_seeds` run, by k)."""
  seeds = [n for n in os.listdir(workdir) if n.startswith(SEED_DIR_PREFIX)
           and n[len(SEED_DIR_PREFIX):].isdigit() and os.path.isdir(os.path.join(workdir, n))]
  seeds.sort(key=lambda n: int(n[len(SEED_DIR_PREFIX):]))
  return [workdir] + [os.path.join(workdir, n) for n in seeds]


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints in `workdir` (orbax renames a step's folder to
  its bare number once it is complete)."""
  path = os.path.join(workdir, CHECKPOINT_DIR)
  try:
    names = os.listdir(path)
  except OSError:
    return []
  return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(path, n)))


def check_outputs(workdir: str, config, overwrite: bool) -> None:
  """Decides how a run starts over the outputs found in `workdir`.

  Every record is a deterministic function of (config, seed, t), and a run
  rewrites the records after its last complete checkpoint, so records that
  no checkpoint covers are simply computed again: the same command resumes
  from the last complete checkpoint, or starts again from t=0 when there is
  none (a run killed before its first checkpoint landed). `check_resume` has
  already refused a different config; records whose config.json is missing
  and that no checkpoint covers cannot be told apart from another config's,
  so they are refused. Also removes stale temp files of the outputs.

  Raises:
    UnresumableWorkdirError: records without config.json or a checkpoint, and
      no `overwrite`.
  """
  check_entries(workdir)
  dirs = output_dirs(workdir)
  for d in dirs:
    io_utils.remove_stale_temporaries(d)
  if overwrite:
    return
  last_t = -1
  for d in dirs:
    try:
      records = io_utils.read_jsonl(os.path.join(d, LOG_FILE))
      last_t = max([last_t] + [int(r["t"]) for r in records])
    except (ValueError, KeyError, TypeError):  # unreadable: count it as records
      last_t = max(last_t, 1)
  summary = any(os.path.exists(os.path.join(d, SUMMARY_FILE)) for d in dirs)
  if last_t < 1 and not summary:
    return
  steps = checkpoint_steps(workdir)
  enabled = bool(config.checkpoint.enabled)
  if enabled and steps:
    return
  if os.path.exists(os.path.join(workdir, CONFIG_FILE)):  # the same config (check_resume)
    why = ("config.checkpoint.enabled=False" if not enabled
           else "no complete checkpoint (the run was stopped before its first one landed)")
    if steps:
      why += f"; rerun with --config.checkpoint.enabled=True to resume from t={steps[-1]}"
    logging.warning("%s holds records up to t=%d but %s: the run starts again from t=0 and "
                    "computes the same records", workdir, last_t, why)
    return
  held = " and ".join(([f"the records of t=0..{last_t}"] if last_t >= 0 else [])
                     + (["summary.json"] if summary else []))
  raise UnresumableWorkdirError(
      f"--workdir={workdir} holds {held} of a run but neither its {CONFIG_FILE} nor a "
      f"checkpoint (in {os.path.join(workdir, CHECKPOINT_DIR)}), so it cannot be told whether "
      "they are this config's; a new run would overwrite them: pass --overwrite to discard "
      "them, or choose another --workdir")
