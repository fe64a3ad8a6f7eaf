"""Image classification: uint8 images gathered on the device, augmented and normalised.

The resident data (`DeviceData`, a pytree) holds the uint8 images and int32
labels of both splits and the per-channel mean and standard deviation. A
step receives index arrays only; `ImageTask.inputs` gathers, augments (in
training, from the step's PRNG key) and normalises inside the compiled step.
Loss, error and NLL are those of every classification task (`base.Task`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct

from alma_jax.configuration.plugins import tasks as declared
from alma_jax.data import augment
from alma_jax.data import images
from alma_jax.tasks import base

# Input shape and number of classes of common data sets, so that a method can be constructed
# (and check its fields) before the data is loaded.
KNOWN_SHAPES = declared.KNOWN_SHAPES


@struct.dataclass
class DeviceData:
  """The data set resident on the devices: both splits in one array.

  `x` holds the uint8 training images followed by the test images, `y` their
  int32 labels; index i of the test split is `num_train + i`. One array for
  both splits lets one compiled evaluation program serve validation (training
  split) and test alike.
  """

  x: jax.Array
  y: jax.Array
  mean: jax.Array
  std: jax.Array
  num_train: int = struct.field(pytree_node=False)

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.x.shape[1:])

  def size(self, split: str) -> int:
    return self.num_train if split == "train" else int(self.y.shape[0]) - self.num_train


def device_data(ds) -> DeviceData:
  """An `ImageDataset`-like object (numpy arrays) as a `DeviceData` of numpy arrays."""
  return DeviceData(x=np.concatenate([np.asarray(ds.train_x), np.asarray(ds.test_x)]),
                    y=np.concatenate([np.asarray(ds.train_y), np.asarray(ds.test_y)]),
                    mean=np.asarray(ds.mean, np.float32), std=np.asarray(ds.std, np.float32),
                    num_train=len(ds.train_y))


def subset_indices(num_train: int, n: int, seed: int) -> np.ndarray:
  """The `n` training examples (sorted indices) of `num_train` that a run with `seed` uses."""
  rng = np.random.default_rng([seed, 7])
  return np.sort(rng.choice(num_train, n, replace=False))


def load_data(config, seeds: list[int]):
  """The data set of `config.data` and each seed's training subset (None: all examples).

  With one seed the subset is cut out of the loaded arrays (and None returned
  for it); several seeds keep the whole training split and index into it.
  """
  ds = images.load_image_dataset(config.data.name, data_dir=config.data.data_dir,
                                 cache_dir=config.data.cache_dir, use_cache=config.data.use_cache,
                                 download=config.data.download)
  changes, d = {}, config.data
  subsets = [None] * len(seeds)
  if d.train_subset:
    n = base.subset_size("train_subset", int(d.train_subset), len(ds.train_y),
                         f"training examples of {d.name!r}")
    subsets = [subset_indices(len(ds.train_y), n, sd) for sd in seeds]
  if len(seeds) == 1 and subsets[0] is not None:
    sel, subsets = subsets[0], [None]
    changes.update(train_x=np.asarray(ds.train_x[sel]), train_y=np.asarray(ds.train_y[sel]))
  if d.test_subset:
    n = base.subset_size("test_subset", int(d.test_subset), len(ds.test_y),
                         f"test examples of {d.name!r}")
    changes.update(test_x=np.asarray(ds.test_x[:n]), test_y=np.asarray(ds.test_y[:n]))
  return (dataclasses.replace(ds, **changes) if changes else ds), subsets


class ImageTask(declared.Images, base.Task):
  """Classification of images by argmax, trained with optional crop+flip augmentation."""

  def __init__(self, augmentation: str = "none"):
    if augmentation not in augment.AUGMENTATIONS:
      raise ValueError(f"config.train.augment={augmentation!r} is unknown; valid values: "
                       f"{list(augment.AUGMENTATIONS)}")
    self.augmentation = augmentation

  @classmethod
  def from_config(cls, config) -> "ImageTask":
    return cls(config.train.augment)

  @classmethod
  def known_shape(cls, config):
    return KNOWN_SHAPES.get(config.data.name)

  @classmethod
  def check_available(cls, config) -> None:
    base.check_dataset_available(config)

  load = staticmethod(load_data)
  device_data = staticmethod(device_data)

  def inputs(self, data: DeviceData, idx, rng=None):
    """(normalised inputs, labels) of resident examples `idx`; `rng`: training augmentation."""
    x = augment.prepare_batch(data.x[idx], data.mean, data.std,
                              augment=self.augmentation if rng is not None else "none", rng=rng)
    return x, data.y[idx]
