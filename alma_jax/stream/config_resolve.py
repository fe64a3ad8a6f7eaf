"""The config that a `python -m alma_jax.main` command line runs, resolved without running it.

`resolve("configs/mnist_sm.py:quick", ["--config.seed=1", "--overwrite"])`
loads the config file (with its variant) and applies the `--config.*`
overrides exactly as the entry point does (ml_collections' config flag on a
private flag registry); other flags are ignored. `resolved_dict` gives the
JSON form that a run writes to its `config.json`, and `config_hash` a short
digest of the fields that decide a run's results (the resumable fields, such
as data paths, left out), so that two command lines get the same hash
where one can resume the other's run (`same_run`).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
from typing import Sequence

from absl import flags
import ml_collections
from ml_collections import config_flags

from alma_jax import errors
from alma_jax.configuration import config_lib
from alma_jax.outputs import workdir
from alma_jax.stream import validation
from alma_jax.tuning import autotune


class ConfigResolveError(ValueError):
  """The config file or an override cannot be loaded."""


def resolve(config_arg: str, args: Sequence[str] = (), given: str | None = None):
  """The ConfigDict of `--config=config_arg` with the `--config.*` overrides among `args`.
  `given`: the config as the user named it (e.g. `mnist_sm:smok` for the file
  `config_files.resolve` found), which the errors name in place of `config_arg`."""
  try:
    return _resolve(config_arg, args)
  except ConfigResolveError as e:
    if given is None or given == config_arg:
      raise
    raise ConfigResolveError(str(e).replace(config_arg, given)) from e


def _resolve(config_arg: str, args: Sequence[str]):
  argv = ["alma_jax.main", f"--config={config_arg}", *args]
  registry = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "Experiment config file.", flag_values=registry,
                                  lock_config=True, sys_argv=argv)
  try:
    rest = registry(argv, known_only=True)
    config = registry["config"].value
    config.get("seed")  # a config file that failed to load raises here
  except Exception as e:  # pylint: disable=broad-except
    what = errors.located(e, config_arg.partition(":")[0]) or override_error(config_arg, args, e)
    raise ConfigResolveError(f"--config={config_arg}: {what}") from e
  unparsed = [a for a in rest[1:] if re.match(r"^--?(no)?config\.", a)]
  if unparsed:
    raise ConfigResolveError(f"--config={config_arg}: cannot apply {unparsed}")
  check_overrides(args)
  return config


def _overrides(args: Sequence[str]) -> dict[str, str]:
  """{field path: value text} of the `--config.<path>=<value>` (and `--[no]config.<path>`)
  flags among `args`, the last of each path."""
  out = {}
  for i, a in enumerate(args):
    if a == "--":
      break
    m = re.match(r"^--?(no)?config\.([\w.]+)(?:=(.*))?$", a)
    if m is None:
      continue
    no, path, value = m.groups()
    if value is None:
      nxt = args[i + 1] if i + 1 < len(args) else None
      value = ("False" if no else "True") if nxt is None or nxt.startswith("-") else nxt
    out[path] = value.strip().strip("'\"")
  return out


def check_overrides(args: Sequence[str]) -> None:
  """Raises `ValueError` (one line naming the fields) for overrides among `args` that
  contradict each other where the resolved config could not tell: an explicit
  `--config.stream.warm_start` other than scratch with `--config.stream.init_from_scratch=True`
  (a warm_start at its default, finetune, is read as the older spelling's scratch)."""
  given = _overrides(args)
  scratch, policy = given.get("stream.init_from_scratch"), given.get("stream.warm_start")
  if policy is not None and scratch is not None and scratch.lower() in ("true", "1", "yes") \
      and policy != "scratch":
    raise ConfigResolveError(
        f"--config.stream.init_from_scratch={scratch} contradicts --config.stream.warm_start="
        f"{policy!r} (init_from_scratch=True is the older spelling of warm_start='scratch'); "
        "give --config.stream.warm_start alone")


def override_type_error(exc: BaseException) -> str | None:
  """A `--config.<path>=<value>` that the flag could not convert to the field's type, in the
  words of the field's own check (with its allowed values); None for other errors."""
  m = re.match(r"flag --config\.([\w.]+)=(.*?): ", str(exc))
  if m is None:
    return None
  path, text = m.groups()
  try:
    value = ast.literal_eval(text)  # 1.5 for an integer field: a float, not a string
  except Exception:  # pylint: disable=broad-except
    value = text
  return validation.value_error(path, value)


def override_error(config_arg: str, args: Sequence[str], exc: BaseException) -> str:
  """The gist of a config-loading error: an override the field's type refuses in the field's
  own words; an override of a field that the config lacks named with the fields its section
  has (methods declare fields of their own)."""
  typed = override_type_error(exc)
  if typed is not None:
    return typed
  text = errors.flag_error(exc)
  if not isinstance(exc, (KeyError, AttributeError)):
    return text
  m = re.match(r"""^['"]?(\w+)['"]?\s*(.*)$""", text)  # "'wiat' Did you mean ...?"
  if m is None:
    return text
  key, hint = m.groups()
  paths = [m.group(1) for a in args if (m := re.match(r"^--(?:no)?config\.([\w.]+)", a))]
  path = next((p for p in paths if key in p.split(".")), None)
  if path is None:
    return text
  parts = path.split(".")
  parent = parts[:parts.index(key)]
  try:
    section = resolve(config_arg)
    for p in parent:
      section = section[p]
    known = sorted(section.keys())
  except Exception:  # pylint: disable=broad-except
    return text
  where = ".".join(parent) or "the config"
  return (f"--config.{path}: {where} has no field {key!r} in {config_arg}; its fields: "
          f"{known}" + (f" ({hint})" if hint else ""))


def resolved_dict(config_arg: str, args: Sequence[str] = (), given: str | None = None) -> dict:
  """The resolved config as the `config.json` that a run of it writes (`given`: see
  `resolve`)."""
  return workdir.config_dict(validation.complete(resolve(config_arg, args, given)))


def config_hash(config: dict, length: int = 8) -> str:
  """Hex digest of `config` (a resolved dict) without the fields that may change on resume
  (nor the fields added since earlier runs, at their defaults: their hashes stay), a field at
  a default that changed taken at the old one (`workdir.hashed_value`: its hashes stay too)."""
  flat = {k: workdir.hashed_value(k, v, config) for k, v in workdir.flatten(config).items()
          if k not in config_lib.resumable_paths()
          and not workdir.added_field_at_default(k, v, config)}
  text = json.dumps(flat, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()[:length]


def same_run(old: dict, new: dict) -> list[str]:
  """The differences (`workdir.config_diff`) that keep `new` from resuming `old`'s run, where
  a field that `new` leaves to be chosen is taken at the value `old` ran with, as the resumed
  run takes it (`autotune.kept_from`: e.g. gMoE's `method.slots`, `auto` now, `pow2` then)."""
  kept = autotune.kept_from(ml_collections.ConfigDict(new), old)
  if kept:
    new = copy.deepcopy(new)
    for path, value in kept.items():
      section, name = path.split(".")
      new[section][name] = value
  return workdir.config_diff(old, new)
