"""Checks of a run's inputs before any training, with one-line error messages.

`validate(config)` checks every declared field (`alma_jax.config_lib.
BASE_FIELDS` and the method's `FIELDS`), the rules that tie fields together,
and builds the optimizer and (where the input shape is known without loading
the data) the method, so their own checks run too; it also makes sure the
data set can be had. `validate_data` checks what depends on the loaded data.
Every message names the offending field and its allowed values, e.g.
`config.stream.wait=3 does not divide config.stream.num_megabatches=10; allowed values: [1, 2, 5, 10]`.
"""

from __future__ import annotations

import os

import jax
from absl import logging

from alma_jax import config_lib
from alma_jax import fields
from alma_jax import methods
from alma_jax import optim
from alma_jax import policies
from alma_jax import sharding
from alma_jax import tasks
from alma_jax.data import images
from alma_jax.errors import ConfigError

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
  name = config.data.name
  download = fields.lookup(config, "data.download", "auto")
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


def _check_rules(config) -> None:
  """The checks that tie several fields together."""
  b, w = config.stream.num_megabatches, config.stream.wait
  if b % w:
    divisors = [d for d in range(1, b + 1) if b % d == 0]
    raise ConfigError(f"config.stream.wait={w} does not divide config.stream.num_megabatches={b}; "
                      f"allowed values: {divisors}")
  n = fields.lookup(config, "num_seeds", 1)
  if n > 1 and not methods.get(config.method.name).same_growth_for_every_seed:
    valid = [m for m in methods.names() if methods.get(m).same_growth_for_every_seed]
    raise ConfigError(
        f"config.num_seeds={n} needs a method whose growth is the same for every seed; "
        f"config.method.name={config.method.name!r} is not one; valid names: {valid} "
        "(or config.num_seeds=1)")
  try:
    optim.from_config(config)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.optimizer: {e}") from e
  visible = jax.device_count()
  if config.mesh.num_devices > visible:
    raise ConfigError(f"config.mesh.num_devices={config.mesh.num_devices} but only {visible} "
                      f"{jax.default_backend()} devices are visible; use 0 for all of them")
  sharding.mesh_shape(config.mesh.num_devices, config.mesh.data, config.mesh.model, visible)
  sharding.check_rules(dict(config.mesh.rules.items()))


def validate(config):
  """Checks the config's fields; raises `ConfigError` naming the first bad one.

  Returns the config completed with the defaults of the fields it lacks.
  """
  fields.check_all(config, config_lib.BASE_FIELDS)
  config = complete(config)
  fields.check_all(config, methods.get(config.method.name).FIELDS)
  fields.check_all(config, tasks.fields_for(config.method.name))
  _check_rules(config)
  if tasks.name_for(config) == "text":
    tasks.text.check(config)
    tasks.text.check_available(config)
    methods.make(config, (config.data.seq_len,), 1)
    if not config.data.text_file:
      check_dataset_available(config)
    return config
  if config.model.name == "switch":
    raise ConfigError(f"config.model.name='switch' models text; config.method.name="
                      f"{config.method.name!r} learns from images; valid names: "
                      "['mlp', 'vgg'] (or a method whose name starts with lm_)")
  if config.data.name in KNOWN_SHAPES:
    methods.make(config, *KNOWN_SHAPES[config.data.name])
  check_dataset_available(config)
  return config


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
    logging.warning("config.train.batch_size=%d is larger than the training data of a stage "
                    "without replay (%d examples: %s, config.stream.wait=%d); each epoch of "
                    "such a stage is a single partial batch", b, smallest * config.stream.wait,
                    where, config.stream.wait)


def complete(config):
  """A copy of `config` with every declared field that it lacks set to its default (and
  `stream.init_from_scratch` made to agree with `stream.warm_start`)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    dataset = fields.lookup(c, "data.name", "")
    fields.fill(c, config_lib.BASE_FIELDS, dataset, overwrite=False)
    name = fields.value(c, config_lib.BASE_FIELDS_BY_PATH["method.name"])
    fields.fill(c, methods.get(name).FIELDS, dataset, overwrite=False)
    fields.fill(c, tasks.fields_for(name), dataset, overwrite=False)
    if tasks.name_for(c) == "text":
      tasks.text.expand_iid(c)
    policies.resolve_warm_start(c)
  return c
