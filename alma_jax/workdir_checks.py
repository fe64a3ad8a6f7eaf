"""Checks of a workdir's previous outputs before a run starts in it (under its lock).

`check_outputs` refuses a workdir that holds records of a run but no
checkpoint to resume them from (the checkpoints were deleted, possibly with
config.json, or checkpointing is off): starting afresh there would overwrite
those records, or results of a different config. It also removes temp files
left by writers that were killed.
"""

from __future__ import annotations

import os

from alma_jax import io_utils

LOG_FILE, SUMMARY_FILE, CHECKPOINT_DIR = "log.jsonl", "summary.json", "checkpoints"
SEED_DIR_PREFIX = "seed_"


class UnresumableWorkdirError(ValueError):
  """The workdir holds records that no checkpoint can resume."""


def _output_dirs(workdir: str) -> list[str]:
  """The workdir and its per-seed output folders."""
  seeds = sorted(n for n in os.listdir(workdir) if n.startswith(SEED_DIR_PREFIX)
                 and os.path.isdir(os.path.join(workdir, n)))
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
  dirs = _output_dirs(workdir)
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
  enabled = bool(config.checkpoint.get("enabled", True))
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
