"""Helpers for the experiment files in `configs/`.

A config file calls `base_config(dataset)` for the paper's defaults, sets the
method fields, and passes its argument string to `apply_variant`, which knows
the `smoke` (seconds, for tests) and `quick` (minutes on a laptop CPU)
variants.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

VARIANTS = ("", "paper", "smoke", "quick")


def base_config(dataset: str) -> ml_collections.ConfigDict:
  """The paper's settings (Appendix B) for `mnist` (MLP) or `cifar10` (VGG)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # > 1: train the seeds seed, seed+1, ... together as one vmapped program
  # (alma_jax/seeds.py); each seed's outputs go to <workdir>/seed_<seed>/.
  c.num_seeds = 1

  c.data = ml_collections.ConfigDict()
  c.data.name = dataset
  c.data.data_dir = config_dict.placeholder(str)  # None: $TFDS_DATA_DIR or tfds's default
  c.data.cache_dir = config_dict.placeholder(str)  # None: ~/.cache/alma_jax
  c.data.use_cache = True
  # May tfds download a data set that is not prepared locally? "yes", "no", or
  # "auto": when its download host answers (offline runs then fail at once).
  c.data.download = "auto"
  c.data.train_subset = 0  # > 0: use only this many training examples (seeded draw)
  c.data.test_subset = 0  # > 0: evaluate on only this many test examples

  c.stream = ml_collections.ConfigDict()
  c.stream.num_megabatches = 500 if dataset == "mnist" else 100
  c.stream.val_fraction = 0.1
  c.stream.wait = 1
  c.stream.replay = 0.0
  c.stream.init_from_scratch = False

  c.model = ml_collections.ConfigDict()
  c.model.name = "mlp" if dataset == "mnist" else "vgg"
  c.model.width = 64  # hidden units (MLP) or channels (VGG); the paper uses 4 ... 64
  # VGG convolution gradients: "xla", "chunked_dw" (faster weight gradient on
  # CPU) or "auto" (chosen per backend and width; see alma_jax/models/conv.py).
  c.model.conv_impl = "auto"

  c.method = ml_collections.ConfigDict()
  c.method.name = "sm"

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 128
  c.train.eval_batch_size = 1000
  c.train.epochs = 100
  c.train.patience = 25
  c.train.keep_optimizer_state = False
  c.train.augment = "none" if dataset == "mnist" else "crop_flip"
  c.train.steps_per_call = 1
  c.train.on_divergence = "raise"  # or "rollback"
  c.train.progress_every_s = 10.0

  c.optimizer = ml_collections.ConfigDict()
  if dataset == "mnist":
    c.optimizer.name = "adadelta"
    c.optimizer.kwargs = ml_collections.ConfigDict({"learning_rate": 1.0})
    c.optimizer.weight_decay = 0.0
  else:
    c.optimizer.name = "sgd"
    c.optimizer.kwargs = ml_collections.ConfigDict({"learning_rate": 0.01, "momentum": 0.9})
    c.optimizer.weight_decay = 1e-4

  c.mesh = ml_collections.ConfigDict()
  c.mesh.num_devices = 0  # 0: all visible devices

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.enabled = True
  c.checkpoint.max_to_keep = 3
  c.checkpoint.every = 1  # checkpoint every this many training stages (and at t=0 and t=B)
  return c


def apply_variant(c: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Shrinks `c` for the `smoke` or `quick` variant (paper settings otherwise)."""
  arg = (arg or "").strip()
  if arg not in VARIANTS:
    raise ValueError(f"config variant {arg!r} is unknown; valid variants: {[v for v in VARIANTS if v]}")
  mnist = c.data.name != "cifar10"
  if arg == "smoke":
    # Seconds: a small slice of the data, a tiny model, a short stream.
    c.data.train_subset = 2000
    c.data.test_subset = 1000
    c.stream.num_megabatches = 4
    c.model.width = 8
    c.train.epochs = 2
    c.train.patience = 2
    if not mnist:
      c.data.train_subset = 800
      c.data.test_subset = 500
      c.model.width = 4
      c.train.eval_batch_size = 500
  elif arg == "quick":
    if mnist:
      # The whole MNIST stream (B=500), training every 10 mega-batches.
      c.stream.wait = 10
      c.train.epochs = 20
      c.train.patience = 5
    else:
      # The whole training set in 10 mega-batches, C=16, 3 epochs per stage.
      c.stream.num_megabatches = 10
      c.model.width = 16
      c.train.epochs = 3
      c.train.patience = 3
  return c


def protocol(c: ml_collections.ConfigDict, arg: str | None, *, num_megabatches: int, width: int,
             epochs: int) -> ml_collections.ConfigDict:
  """A fixed timing protocol: B mega-batches, w=1, no replay, exactly `epochs` per stage.

  `arg` may be `smoke` (a tiny slice of the data, for tests of the protocol files).
  """
  c.stream.num_megabatches = num_megabatches
  c.stream.wait = 1
  c.stream.replay = 0.0
  c.model.width = width
  c.train.epochs = epochs
  c.train.patience = epochs  # no early stopping within the fixed epochs
  if arg == "smoke":
    c.data.train_subset = 1000
    c.data.test_subset = 500
    c.train.epochs = c.train.patience = 1
  elif arg:
    raise ValueError(f"config variant {arg!r} is unknown for a timing protocol; valid: ['smoke']")
  return c
