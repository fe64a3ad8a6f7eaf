"""Checks of a run's inputs before any training, with one-line error messages.

`validate(config)` checks types, ranges and names of the config fields (and
builds the optimizer and, where the input shape is known without loading the
data, the method, so their own checks run too). `validate_data` checks what
depends on the loaded data, `check_workdir` the output directory and
`check_resume` that a workdir holding a run belongs to the same config.
Every message names the offending field, e.g.
`config.stream.wait=3 does not divide config.stream.num_megabatches=10; allowed values: [1, 2, 5, 10]`.
"""

from __future__ import annotations

import ast
import json
import math
import os
import tempfile
from typing import Any

from alma_jax import io_utils


class ConfigError(ValueError):
  """An invalid config field, input or output location."""


# Fields that may differ when a run is resumed: they do not change the records already written.
RESUMABLE_FIELDS = ("data.data_dir", "data.cache_dir", "data.use_cache", "data.download",
                    "train.progress_every_s", "checkpoint.enabled", "checkpoint.max_to_keep",
                    "checkpoint.every", "train.on_divergence")
ON_DIVERGENCE = ("raise", "rollback")
_MISSING = object()


# -- field helpers ----------------------------------------------------------------------
def _get(config, path: str, default=_MISSING):
  node = config
  for part in path.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      if default is not _MISSING:
        return default
      raise ConfigError(f"config.{path} is missing") from None
  return node


def _int(config, path: str, lo: int | None = None, default=_MISSING) -> int | None:
  v = _get(config, path, default)
  if v is None and default is None:
    return None
  if isinstance(v, bool) or not isinstance(v, int):
    raise ConfigError(f"config.{path}={v!r} must be an integer, got {type(v).__name__}")
  if lo is not None and v < lo:
    raise ConfigError(f"config.{path}={v} must be >= {lo}")
  return v


def _float(config, path: str, lo: float, hi: float, *, open_lo=False, open_hi=False,
           default=_MISSING) -> float:
  v = _get(config, path, default)
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ConfigError(f"config.{path}={v!r} must be a number, got {type(v).__name__}")
  ok_lo = v > lo if open_lo else v >= lo
  ok_hi = v < hi if open_hi else v <= hi
  if math.isnan(v) or not (ok_lo and ok_hi):
    interval = f"{'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"
    raise ConfigError(f"config.{path}={v} must be in {interval}")
  return float(v)


def _bool(config, path: str, default=_MISSING) -> bool:
  v = _get(config, path, default)
  if not isinstance(v, bool):
    raise ConfigError(f"config.{path}={v!r} must be true or false, got {type(v).__name__}")
  return v


def _choice(config, path: str, choices, what: str = "values", default=_MISSING):
  v = _get(config, path, default)
  choices = sorted(choices)
  if not isinstance(v, str) or v not in choices:
    raise ConfigError(f"config.{path}={v!r} is unknown; valid {what}: {choices}")
  return v


# -- the config -----------------------------------------------------------------------------
# Input shape and number of classes of common data sets, so that the method can be
# constructed (and check its fields) before the data is loaded.
KNOWN_SHAPES = {"mnist": ((28, 28, 1), 10), "fashion_mnist": ((28, 28, 1), 10),
                "kmnist": ((28, 28, 1), 10), "cifar10": ((32, 32, 3), 10),
                "cifar100": ((32, 32, 3), 100)}


def _versions(root: str, marker: str) -> list[str]:
  if not os.path.isdir(root):
    return []
  return sorted(v for v in os.listdir(root) if os.path.isfile(os.path.join(root, v, marker)))


def check_dataset_available(config) -> None:
  """Unless tfds may and can download it, the data set must be prepared or cached locally.

  tfds would otherwise try to download it, which offline means minutes of
  retries before it fails; `data.download="auto"` (the default) probes the
  download host first.
  """
  from alma_jax.data import images  # pylint: disable=g-import-not-at-top
  name = config.data.name
  download = _get(config, "data.download", "auto")
  if download == "yes":
    return
  data_dir = (config.data.data_dir or os.environ.get("TFDS_DATA_DIR")
              or os.path.join(os.path.expanduser("~"), "tensorflow_datasets"))
  cache_dir = config.data.cache_dir or images.default_cache_dir()
  if _versions(os.path.join(data_dir, name), "dataset_info.json"):
    return
  if config.data.use_cache and _versions(os.path.join(cache_dir, name), "meta.json"):
    return
  if download == "auto" and images.internet_reachable():
    return
  local = sorted(d for d in os.listdir(data_dir) if os.path.isdir(os.path.join(data_dir, d))
                 ) if os.path.isdir(data_dir) else []
  cached = " nor" if not config.data.use_cache else f" and no decoded copy in {cache_dir}/{name} nor"
  raise images.DatasetUnavailableError(
      f"config.data.name={name!r} is not available offline: no prepared tfds copy in "
      f"{os.path.join(data_dir, name)}{cached} a download possible ("
      f"{'no internet connection' if download == 'auto' else 'config.data.download=no'}); "
      "data sets prepared in "
      f"{data_dir}: {local}; set TFDS_DATA_DIR (or config.data.data_dir) to a folder holding "
      "prepared tfds data, or set config.data.download=yes to let tfds download it")


def _check_stream(config) -> None:
  b = _int(config, "stream.num_megabatches", 1)
  w = _int(config, "stream.wait", 1)
  if b % w:
    divisors = [d for d in range(1, b + 1) if b % d == 0]
    raise ConfigError(f"config.stream.wait={w} does not divide config.stream.num_megabatches={b}; "
                      f"allowed values: {divisors}")
  _float(config, "stream.replay", 0.0, 1.0)
  _float(config, "stream.val_fraction", 0.0, 1.0, open_lo=True, open_hi=True)
  _bool(config, "stream.init_from_scratch", False)


def _check_train(config) -> None:
  from alma_jax.data import augment  # pylint: disable=g-import-not-at-top
  for field in ("epochs", "patience", "batch_size", "eval_batch_size"):
    _int(config, f"train.{field}", 1)
  _int(config, "train.steps_per_call", 1, default=1)
  _bool(config, "train.keep_optimizer_state", False)
  _choice(config, "train.augment", augment.AUGMENTATIONS)
  _choice(config, "train.on_divergence", ON_DIVERGENCE, default="raise")
  _float(config, "train.progress_every_s", 0.0, math.inf, default=10.0)


def _check_optimizer(config) -> None:
  from alma_jax import optim  # pylint: disable=g-import-not-at-top
  _choice(config, "optimizer.name", optim.OPTIMIZERS, "names")
  _float(config, "optimizer.weight_decay", 0.0, math.inf, default=0.0)
  try:
    optim.make_optimizer(config.optimizer)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.optimizer: {e}") from e


def _check_runtime(config) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  n = _int(config, "mesh.num_devices", 0)
  visible = jax.device_count()
  if n > visible:
    raise ConfigError(f"config.mesh.num_devices={n} but only {visible} "
                      f"{jax.default_backend()} devices are visible; use 0 for all of them")
  _bool(config, "checkpoint.enabled", True)
  _int(config, "checkpoint.max_to_keep", 1, default=3)
  _int(config, "checkpoint.every", 1, default=1)


def validate(config) -> None:
  """Checks the config's fields; raises `ConfigError` naming the first bad one."""
  from alma_jax import methods, models  # pylint: disable=g-import-not-at-top
  _int(config, "seed")
  name = _get(config, "data.name")
  if not isinstance(name, str) or not name:
    raise ConfigError(f"config.data.name={name!r} must be the name of a tfds data set")
  _int(config, "data.train_subset", 0, default=0)
  _int(config, "data.test_subset", 0, default=0)
  _bool(config, "data.use_cache", True)
  from alma_jax.data import images as images_lib  # pylint: disable=g-import-not-at-top
  _choice(config, "data.download", images_lib.DOWNLOAD_CHOICES, default="auto")
  for path in ("data.data_dir", "data.cache_dir"):
    v = _get(config, path, None)
    if v is not None and not isinstance(v, str):
      raise ConfigError(f"config.{path}={v!r} must be a path or None")
  _check_stream(config)
  _choice(config, "model.name", models.BACKBONES, "names")
  _int(config, "model.width", 1)
  from alma_jax.models import conv  # pylint: disable=g-import-not-at-top
  _choice(config, "model.conv_impl", conv.IMPLS, default="auto")
  _choice(config, "method.name", methods.names(), "names")
  if _get(config, "method.num_members", None) is not None:
    _int(config, "method.num_members", 1)
  from alma_jax import seeds  # pylint: disable=g-import-not-at-top
  seeds.check_config(config)
  _check_train(config)
  _check_optimizer(config)
  _check_runtime(config)
  if name in KNOWN_SHAPES:
    make_method(config, *KNOWN_SHAPES[name])
  check_dataset_available(config)


def make_method(config, input_shape, num_classes):
  """Constructs the configured method (its constructor checks its own fields)."""
  from alma_jax import methods  # pylint: disable=g-import-not-at-top
  cls = methods.get(config.method.name)
  try:
    return cls(config, tuple(input_shape), int(num_classes))
  except ConfigError:
    raise
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    msg = " ".join(str(e).split())
    if "config." not in msg:
      msg = f"config.method (method {config.method.name!r}): {msg}"
    raise ConfigError(msg) from e


def validate_data(config, num_train: int, stream) -> None:
  """Checks the fields that depend on the loaded data and its stream."""
  smallest = min(len(t) for t in stream.train)
  smallest_val = min(len(v) for v in stream.val)
  where = (f"{num_train} training examples in config.stream.num_megabatches="
           f"{stream.num_megabatches} mega-batches with config.stream.val_fraction="
           f"{config.stream.val_fraction}")
  if smallest < 1 or smallest_val < 1:
    raise ConfigError(f"config.stream.num_megabatches={stream.num_megabatches} leaves a mega-batch "
                      f"with {smallest} training and {smallest_val} validation examples ({where}); "
                      "use fewer mega-batches or more data (config.data.train_subset)")
  b = config.train.batch_size
  if b > smallest * config.stream.wait:
    # Not an error: the paper's own MNIST setting (B=500, w=1) has 108 training
    # examples per mega-batch for a batch of 128. Each epoch is then one
    # partial (masked) step, and the FLOP count is that of a full batch.
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("config.train.batch_size=%d is larger than the training data of a stage "
                    "without replay (%d examples: %s, config.stream.wait=%d); each epoch of "
                    "such a stage is a single partial batch", b, smallest * config.stream.wait,
                    where, config.stream.wait)


# -- the workdir ----------------------------------------------------------------------------
def check_workdir(workdir: str) -> None:
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


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {"a.b.c": leaf}."""
  if isinstance(tree, dict) and tree:
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def config_diff(old: dict, new: dict, ignore=RESUMABLE_FIELDS) -> list[str]:
  """'config.path: old → new' for every differing field (dotted paths)."""
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


def _is_nan(v) -> bool:
  return isinstance(v, float) and math.isnan(v)


def config_dict(config) -> dict:
  return json.loads(config.to_json())


def check_resume(workdir: str, config, has_progress: bool) -> None:
  """Raises when `workdir` holds progress of a run with a different config."""
  path = os.path.join(workdir, "config.json")
  if not has_progress or not os.path.exists(path):
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


# -- errors on the command line ---------------------------------------------------------------
def one_line(exc: BaseException) -> str:
  """A readable single line for `exc` (type name added for unexpected errors)."""
  msg = " ".join(str(exc).split())
  if (isinstance(exc, ValueError) or type(exc).__name__ == "DivergenceError"
      or getattr(exc, "plain_message", False)):
    return msg or type(exc).__name__
  return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def exit_code(exc: BaseException) -> int:
  """2 for invalid inputs (config, data, workdir, checkpoints), 1 for runtime failures."""
  return 2 if isinstance(exc, ValueError) else 1


def cli_error(exc: BaseException) -> tuple[str, int]:
  """(one-line message, exit code) for an exception that ends a command-line run."""
  from alma_jax.train import DivergenceError  # pylint: disable=g-import-not-at-top
  msg = one_line(exc)
  if not isinstance(exc, (ValueError, DivergenceError)) and not getattr(exc, "plain_message", False):
    msg += " (rerun with --debug for the traceback)"
  return msg, exit_code(exc)


def flag_error(exc: BaseException) -> str:
  """The gist of a flag or config-file error: one line, no traceback."""
  text = str(exc)
  if text[:1] in "'\"":  # a quoted message (a KeyError inside an AttributeError)
    try:
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      pass
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  if any(l.startswith("Traceback") for l in lines):
    lines = lines[:1] + lines[-1:]
  return " ".join(lines)
