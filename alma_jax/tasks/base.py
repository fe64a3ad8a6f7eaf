"""The task contract: what the loop, the stage and the methods know of a kind of data.

A task owns everything that depends on what an example is: its config fields
and checks, loading the data and putting it on the devices (`load`,
`device_data`), turning example indices into model inputs and targets
(`inputs`), the training loss of a backbone's outputs (`loss`, with any
auxiliary loss the backbone returns), each example's error and negative
log-likelihood (`per_example`), the fields it adds to a record
(`record_metrics`), to a summary (`summary`, `SUMMARY_STATS`) and to the
progress lines (`progress`, `summary_line`). Methods see logits and ask their
task (`Method.task`) for the loss, so one method class serves every task.

`Task` is a classification task with defaults for all of this; a new kind of
data subclasses it in one file and registers it (`alma_jax.tasks.register`).
What a config needs of a task (its fields, variants, and which configs are
its) is its declaration (`alma_jax.configuration.plugins.tasks`), the base
class of `Task` and of each built-in task's class.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import struct

from alma_jax import models
from alma_jax.configuration import fields
from alma_jax.configuration import plugins
from alma_jax.configuration.plugins import tasks as declared
from alma_jax.data import images
from alma_jax.errors import ConfigError


def subset_size(field: str, value: int, available: int, what: str) -> int:
  """The examples that `config.data.<field>=value` (> 0) takes of the `available` ones (`what`:
  e.g. "training examples of 'mnist'"): all of them when it asks for more, which a warning
  says (the run's config records the value asked for)."""
  if value > available:
    logging.warning("config.data.%s=%d asks for more than the %d %s: all %d are used", field,
                    value, available, what, available)
  return min(value, available)


# -- losses and likelihoods shared by the tasks ---------------------------------------------------
def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The cross-entropy of every example (or token), shape `labels.shape`, in float32 at least
  (half-precision logits are promoted)."""
  dtype = jnp.promote_types(logits.dtype, jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(dtype), labels)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array, *,
                         summed: bool = False) -> jax.Array:
  """The cross-entropy over the examples where `mask` is true: their mean, or their sum.

  `mask` marks examples (the leading dimensions of `labels`); with labels per
  token (b, L) and a mask per sequence (b,), the mean is over the tokens of
  the masked sequences. The sum selects the masked terms (no arithmetic on
  the others), the mean weighs them by the mask.
  """
  ce = cross_entropy(logits, labels)
  m = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (ce.ndim - mask.ndim)), ce.shape)
  if summed:
    return jnp.sum(jnp.where(m, ce, 0.0))
  m = m.astype(ce.dtype)
  return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)


def nll(logp: jax.Array, labels: jax.Array) -> jax.Array:
  """The negative log-likelihood of every label under log-probabilities `logp` (..., C)."""
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def errors(logp: jax.Array, labels: jax.Array) -> jax.Array:
  """1.0 where the most probable class is not the label, else 0.0."""
  return (jnp.argmax(logp, -1) != labels).astype(jnp.float32)


# -- data that tfds provides -------------------------------------------------------------------
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
      "prepared tfds data, or set config.data.download=yes to let tfds download it"
      f"{images.name_hint(name, data_dir)}")


# -- the contract ---------------------------------------------------------------------------------
@struct.dataclass
class ArrayData:
  """Resident data of a task whose examples are rows of one array: the training examples, then
  the test examples (`x`, with their targets `y`); `num_train` of the former."""

  x: jax.Array
  y: jax.Array
  num_train: int = struct.field(pytree_node=False)

  def size(self, split: str) -> int:
    return self.num_train if split == "train" else int(self.y.shape[0]) - self.num_train


class Task(declared.Declaration):
  """Classification of examples by their most probable class; the base of every task.

  Class attributes:
    name, FIELDS, DATASETS, BACKBONES, METHOD_ALIASES, VARIANTS, SUMMARY_STATS and the
      class methods `claims`, `defaults` and `complete`: what a config and a report need of
      the task, from its declaration (`alma_jax.configuration.plugins.tasks.Declaration`;
      SUMMARY_STATS: the summary fields of its own that the report's table shows).
    input_dtype: the dtype of the model inputs (what a backbone is initialised
      with).
  """

  input_dtype = np.float32

  @classmethod
  def from_config(cls, config) -> "Task":
    del config
    return cls()

  # -- config -------------------------------------------------------------------------------
  @classmethod
  def check(cls, config) -> None:
    """The checks of the task's fields that tie several fields together."""
    del config

  @classmethod
  def check_available(cls, config) -> None:
    """That the data can be had (raises naming the field); nothing by default."""
    del config

  @classmethod
  def known_shape(cls, config) -> tuple[tuple[int, ...], int] | None:
    """(input shape, number of classes) when known without loading the data, else None."""
    del config
    return None

  # -- data ---------------------------------------------------------------------------------
  def load(self, config, seeds: Sequence[int]):
    """(the data set, each seed's training subset or None).

    The data set has `num_classes`, `train_x` (its shape: (examples,) + input
    shape), `train_y` and `test_y` (their lengths: the examples of each split),
    and whatever `device_data` reads.
    """
    raise NotImplementedError

  def device_data(self, ds) -> Any:
    """The resident data that `inputs` reads: a pytree of host arrays with `num_train` and
    `size(split)`, the examples of a split (e.g. `ArrayData`)."""
    raise NotImplementedError

  @staticmethod
  def global_index(data, split: str, idx: np.ndarray) -> np.ndarray:
    """Indices into one split -> indices into the resident data (host side): the training
    examples first, then the test examples (`data.num_train` of the former)."""
    if split not in ("train", "test"):
      raise ValueError(f"split {split!r} is unknown; valid values: ['test', 'train']")
    return np.asarray(idx, np.int32) + (0 if split == "train" else np.int32(data.num_train))

  def inputs(self, data, idx, rng=None):
    """(model inputs, targets) of resident examples `idx`; `rng`: training randomness."""
    raise NotImplementedError

  # -- models and losses ----------------------------------------------------------------------
  def backbone(self, model_config, num_classes: int, input_shape: tuple[int, ...], **overrides):
    """The backbone of `config.model` for this task's inputs (`overrides`: its constructor
    fields that differ from the config's)."""
    del input_shape
    if overrides:
      return models.get_backbone(model_config.name).from_config(model_config, num_classes,
                                                                **overrides)
    return models.make_backbone(model_config, num_classes)

  def loss(self, logits, y, mask, aux=None) -> jax.Array:
    """The training loss of a batch: the mean cross-entropy of the examples where `mask` is
    true (`aux`: the backbone's auxiliary outputs, see `aux_loss`)."""
    ce = masked_cross_entropy(logits, y, mask)
    return ce + self.aux_loss(aux) if aux else ce

  def aux_loss(self, aux) -> jax.Array:
    """The weighted auxiliary losses in a backbone's outputs `aux` (a non-empty dict)."""
    raise ValueError(f"the {self.name!r} task has no weight for the backbone's auxiliary "
                     f"outputs {sorted(aux)}")

  def summed_loss(self, logits, y, mask) -> jax.Array:
    """The cross-entropy summed over the examples where `mask` is true (per-example scores
    and fits that weigh every example alike)."""
    return masked_cross_entropy(logits, y, mask, summed=True)

  @classmethod
  def right_or_wrong(cls) -> bool:
    """Whether each example is right or wrong (the default `per_example`), so that a
    validation score is an exact count of correct examples (`alma_jax.engine.epoch.Rule`)."""
    return cls.per_example is Task.per_example

  def per_example(self, logp, y):
    """(error 0/1, negative log-likelihood) of every example."""
    return errors(logp, y), nll(logp, y)

  # -- records, summaries and log lines -------------------------------------------------------
  def record_metrics(self, nll_mean: float, flops: dict) -> dict:
    """Fields of the task's own in a record of the test set (`nll_mean`: its mean NLL;
    `flops`: `Steps.flops` of the model); none by default."""
    del nll_mean, flops
    return {}

  def summary(self, records: Sequence[Any]) -> dict[str, float]:
    """Fields of the task's own in a run's summary, from its records; none by default."""
    del records
    return {}

  def progress(self, records: Sequence[Any]) -> str:
    """Text put before the architecture in the line logged after a stage, from every seed's
    last record; empty by default."""
    del records
    return ""

  def summary_line(self, summary: dict[str, Any]) -> str:
    """A line logged after the run's summary; empty (none) by default."""
    del summary
    return ""


def check_backbone(cls: type, config) -> None:
  """That `config.model.name` is one of the backbones of task class `cls`."""
  name = config.model.name
  if name not in plugins.backbones_of(cls):
    raise ConfigError(f"config.model.name={name!r} cannot model {cls.name}; valid values: "
                      f"{plugins.backbones_of(cls)}")
