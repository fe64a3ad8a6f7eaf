"""The flags of `alma_jax.main` that a launcher passes on to a run on other machines,
checked before anything is written or started there.

A run that a batch system or a TPU pod starts later would report a missing
flag or a mistyped config only when it starts, after its wait in the queue;
`problem` finds those here. The run starts in the repository's folder (the
batch script enters it; a TPU worker enters its copy), so a relative config
path is read from there.
"""

from __future__ import annotations

import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def value(flags: list[str], name: str) -> str | None:
  """The last value of the flag `name` among `flags` (`--name=v` or `--name v`, with one or
  two dashes); None when it is not given."""
  found = None
  for i, flag in enumerate(flags):
    if flag == "--":
      break
    for dashes in ("--", "-"):
      if flag.startswith(f"{dashes}{name}="):
        found = flag.split("=", 1)[1]
      elif flag == f"{dashes}{name}" and i + 1 < len(flags):
        found = flags[i + 1]
  return found


def _without_config(flags: list[str]) -> list[str]:
  """`flags` without the `--config` flag and its value (its `--config.*` overrides kept)."""
  out, skip = [], False
  for i, flag in enumerate(flags):
    if skip:
      skip = False
      continue
    name = flag.lstrip("-").split("=", 1)[0]
    if flag.startswith("-") and name == "config":
      skip = "=" not in flag and i + 1 < len(flags)
      continue
    out.append(flag)
  return out


def _config_problem(config: str, flags: list[str]) -> str | None:
  """Why `--config=config` with the overrides among `flags` is not a valid config to run from
  the repository's folder, or None: its file or name, variant, overrides and rules (not the
  data, which the run's machine may hold and this one not)."""
  if os.path.isdir(os.path.join(ROOT, "alma_jax")) and ROOT not in sys.path:  # a checkout
    sys.path.insert(0, ROOT)
  from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
  with contextlib.chdir(ROOT):  # where the run starts
    try:
      path = config_files.resolve(config, folder=os.path.join(ROOT, "configs"))
    except config_files.UnknownConfigError as e:
      return str(e)
    found = _rules_problem(path, flags)
  if found is None:
    return None
  # The config as the user wrote it (a name, or a path from the repository's folder).
  return found.replace(path, config).replace(path.partition(":")[0], config.partition(":")[0])


def _rules_problem(config: str, flags: list[str]) -> str | None:
  """`_config_problem` for the config file `config`, past its name."""
  try:  # needs JAX, Flax and the rest installed (not their backends)
    from alma_jax import errors  # pylint: disable=g-import-not-at-top
    from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top
    from alma_jax.stream import validation  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(f"note: the config's variant, overrides and rules are checked when the run starts, "
          f"not here: alma_jax's requirements are not installed here ({e})", file=sys.stderr)
    return None
  try:
    validation.validate(config_resolve.resolve(config, _without_config(flags)), backend=False,
                        data=False)
  except Exception as e:  # pylint: disable=broad-except  (reported as the run would)
    return errors.one_line(e)
  return None


def problem(flags: list[str], *, shared_workdir_absolute: bool = False) -> str | None:
  """Why `flags` cannot start a run (one line), or None. `shared_workdir_absolute`: the
  workdir must be an absolute path (each machine runs in a copy of the repository, so a
  relative workdir would be a folder of each machine's own)."""
  config = value(flags, "config")
  if not config:
    return ("the flags after -- must give --config=<config file or name>, e.g. "
            "--config=configs/cifar_gens.py")
  workdir = value(flags, "workdir")
  if not workdir:
    return ("the flags after -- must give --workdir=<folder>: where the run writes its "
            "outputs and resumes from")
  if shared_workdir_absolute and not os.path.isabs(workdir):
    return (f"--workdir={workdir} must be an absolute path to a folder that every worker "
            "sees (a relative one is a folder of each worker's own copy of the repository)")
  return _config_problem(config, flags)
