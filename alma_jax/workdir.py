"""The run's output directory: file names, checks, resume compatibility, clean-up.

A workdir holds `config.json`, `log.jsonl`, `summary.json`,
`architecture.jsonl` and `checkpoints/` (and `seed_<seed>/` folders with
the outputs of each seed when several seeds share a program). One run owns
it at a time (`alma_jax.workdir_lock`); `check_outputs` refuses a workdir
whose records no checkpoint can resume.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Sequence

from absl import logging

from alma_jax import config_lib
from alma_jax import io_utils
from alma_jax import tensorboard
from alma_jax.errors import ConfigError

CONFIG_FILE, LOG_FILE, SUMMARY_FILE = "config.json", "log.jsonl", "summary.json"
# One line per training stage: t and the method's description of the architecture
# after it (members, experts per mixture layer, ...), for plots of growth.
ARCH_FILE = "architecture.jsonl"
CHECKPOINT_DIR, CORRUPT_DIR = "checkpoints", "checkpoints_unreadable"
ERROR_PNG = "error.png"  # test error vs t, drawn when the run ends
SEED_DIR_PREFIX = "seed_"  # outputs of one seed when config.num_seeds > 1


def seed_dir(workdir: str, seed: int) -> str:
  return os.path.join(workdir, f"{SEED_DIR_PREFIX}{seed}")


def check_writable(workdir: str) -> None:
  """The workdir exists (created if needed) and is writable."""
  if not workdir:
    raise ConfigError("--workdir is empty; give a directory for the run's outputs")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir} exists and is not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=workdir, prefix=".write-test-")
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise ConfigError(f"--workdir={workdir} is not writable: {e.strerror or e}") from e


def has_progress(workdir: str) -> bool:
  """Whether `workdir` holds records, checkpoints or a summary of a run."""
  ckpt_dir, log = os.path.join(workdir, CHECKPOINT_DIR), os.path.join(workdir, LOG_FILE)
  return (os.path.exists(os.path.join(workdir, SUMMARY_FILE))
          or (os.path.exists(log) and os.path.getsize(log) > 0)
          or (os.path.isdir(ckpt_dir) and any(n[:1].isdigit() for n in os.listdir(ckpt_dir))))


def clear_outputs(workdir: str) -> None:
  """Removes the run outputs from `workdir` (nothing else in it)."""
  seed_dirs = [n for n in os.listdir(workdir) if n.startswith(SEED_DIR_PREFIX)]
  seed_dirs += [os.path.basename(p) for p in tensorboard.event_files(workdir)]
  for name in (CONFIG_FILE, LOG_FILE, SUMMARY_FILE, ARCH_FILE, CHECKPOINT_DIR, CORRUPT_DIR,
               ERROR_PNG, *seed_dirs):
    path = os.path.join(workdir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.unlink(path)
  logging.warning("--overwrite: removed the previous run's outputs from %s", workdir)


def sync_architecture_log(workdir: str, last_t: int) -> None:
  """Keeps the lines of `ARCH_FILE` up to `last_t` (what a resumed run has done)."""
  path = os.path.join(workdir, ARCH_FILE)
  kept = [r for r in io_utils.read_jsonl(path) if r["t"] <= last_t] if os.path.exists(path) else []
  io_utils.write_jsonl_atomic(path, kept)


# -- config compatibility ---------------------------------------------------------------------
def config_dict(config) -> dict:
  return json.loads(config.to_json())


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


def config_diff(old: dict, new: dict, ignore: Sequence[str] | None = None) -> list[str]:
  """'config.path: old → new' for every differing field (dotted paths) but the resumable ones."""
  ignore = config_lib.resumable_paths() if ignore is None else ignore
  a, b = flatten(old), flatten(new)
  absent = "<absent>"
  diffs = []
  for k in sorted(set(a) | set(b)):
    if k in ignore:
      continue
    va, vb = a.get(k, absent), b.get(k, absent)
    if va != vb and not (_is_nan(va) and _is_nan(vb)):
      diffs.append(f"config.{k}: {va!r} → {vb!r}")
  return diffs


def check_resume(workdir: str, config) -> None:
  """Raises when `workdir` holds progress of a run with a different config."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not has_progress(workdir) or not os.path.exists(path):
    return
  hint = "choose another --workdir, or pass --overwrite to discard the old run's outputs"
  try:
    old = io_utils.read_json(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} cannot be read ({e}); {hint}") from e
  diffs = config_diff(old, config_dict(config))
  if diffs:
    raise ConfigError(f"--workdir={workdir} holds a run with a different config: "
                      f"{'; '.join(diffs)}; rerun with the old values to resume it, or {hint}")


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
  """Refuses to start afresh over records of a run in `workdir` (unless `overwrite`).

  A run checkpoints t=0 before it logs t=1, so a log beyond t=0 (or a
  summary) without a complete checkpoint means the checkpoints are gone; a
  log holding only t=0 is a run killed before its first checkpoint, which
  is simply started again. Also removes stale temp files of the outputs.

  Raises:
    UnresumableWorkdirError: records that cannot be resumed, and no `overwrite`.
  """
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
  held = " and ".join(([f"the records of t=0..{last_t}"] if last_t >= 0 else [])
                     + (["summary.json"] if summary else []))
  if not enabled:
    why = "but config.checkpoint.enabled=False, so the run cannot resume"
    if steps:
      why += f" (rerun with --config.checkpoint.enabled=True to resume from its checkpoint t={steps[-1]})"
  else:
    why = f"but no checkpoint to resume from ({os.path.join(workdir, CHECKPOINT_DIR)} is missing or empty)"
  raise UnresumableWorkdirError(
      f"--workdir={workdir} holds {held} of a run {why}; a new run would overwrite them: pass "
      "--overwrite to discard them, or choose another --workdir")
