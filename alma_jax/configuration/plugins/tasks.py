"""The tasks' declarations: what a config needs of each task, read without JAX.

A task's declaration names it, says which configs are its (`claims`: the data
sets, `DATASETS`; `METHOD_ALIASES`, method names that stand for a method on it;
`BACKBONES`, backbones it serves besides those whose declaration names it),
declares its config fields (`FIELDS`), sets the base fields it changes
(`defaults`), derives fields (`complete`), owns its variants (`VARIANTS`:
named sets of field values, see `config_lib.apply_variant`) and names the
summary fields of its own that a report's table shows (`SUMMARY_STATS`). The
task's class (`alma_jax.tasks`) derives from its declaration, so each of
these is written once.
"""

from __future__ import annotations

import math
import re

from alma_jax.configuration import fields as F
from alma_jax.errors import ConfigError

_MNIST_OR = lambda mnist, other: F.ByDataset({"mnist": mnist}, other)  # pylint: disable=invalid-name
_CIFAR_OR = lambda cifar, other: F.ByDataset({"cifar10": cifar}, other)  # pylint: disable=invalid-name
KEEP = F.KEEP

# Image data sets the image task knows without loading them: (input shape, classes).
KNOWN_SHAPES = {"mnist": ((28, 28, 1), 10), "fashion_mnist": ((28, 28, 1), 10),
                "kmnist": ((28, 28, 1), 10), "cifar10": ((32, 32, 3), 10),
                "cifar100": ((32, 32, 3), 100)}


class Declaration:
  """A task's declaration (see the module docstring); the defaults of every attribute."""

  name = ""
  FIELDS: tuple[F.Field, ...] = ()
  DATASETS: tuple[str, ...] = ()
  BACKBONES: tuple[str, ...] = ()
  METHOD_ALIASES: dict[str, str] = {}
  VARIANTS: dict[str, dict] | None = None  # None: the image variants
  SCALED_STEPS: re.Pattern | None = None  # a variant name that multiplies the steps per epoch
  # The summary fields of its own that the report's table shows: (summary field, column
  # title, format).
  SUMMARY_STATS: tuple[tuple[str, str, str], ...] = ()

  @classmethod
  def claims(cls, config) -> bool:
    """Whether the data of `config` is this task's."""
    return F.lookup(config, "data.name", "") in cls.DATASETS

  @classmethod
  def defaults(cls, c) -> None:
    """Sets the base fields of a new config to this task's settings (in place)."""
    del c

  @classmethod
  def complete(cls, c) -> None:
    """Derives fields of a completed config from others (in place; idempotent)."""
    del c


# Image data (MNIST-like and CIFAR-10). paper: the fields whose defaults are neither the paper's
# nor the released code's, set to those (values and sources: alma_jax/configuration/paper.py;
# a method-dependent value follows the config file's method.name); smoke: seconds (a small
# slice of the data, a tiny model, a short stream); quick: minutes on a laptop CPU (MNIST: the
# whole stream B=500 with w=10; CIFAR-10: the whole training set in 10 mega-batches, C=16, 3
# epochs per stage). smoke decides the speed choices by rule (`train.autotune`), so that a first
# run on a new machine takes seconds, not minutes of measuring first; quick measures them (a
# small part of its minutes).
IMAGE_VARIANTS = {
    "paper": {
        "model.init": "torch",
        "train.patience": F.ByMethod({"ens": 100, "umix": 100}, 25),
        "train.patience_delta": F.ByMethod({"ens": 0.0, "umix": 0.0}, 0.001),
        "optimizer.kwargs.nesterov": _MNIST_OR(KEEP, F.ByMethod({"gmoe": True, "ff": True},
                                                                False)),
        "method.grow_every": F.ByMethod({"gmoe": 1, "ff": 1}, KEEP),
        "method.epsilon": F.ByMethod({"ff": 1.0}, KEEP),
    },
    "smoke": {"data.train_subset": _CIFAR_OR(800, 2000), "data.test_subset": _CIFAR_OR(500, 1000),
              "stream.num_megabatches": 4, "model.width": _CIFAR_OR(4, 8), "train.epochs": 2,
              "train.patience": 2, "train.eval_batch_size": _CIFAR_OR(500, KEEP),
              "train.autotune": "rules"},
    "quick": {"stream.wait": _CIFAR_OR(KEEP, 10), "stream.num_megabatches": _CIFAR_OR(10, KEEP),
              "model.width": _CIFAR_OR(16, KEEP), "train.epochs": _CIFAR_OR(3, 20),
              "train.patience": _CIFAR_OR(3, 5),
              # Firefly's MLP in 256 channel slots from the start: a quick run is often a
              # machine's first, on a cold compilation cache, and skips compiling the 64- and
              # 128-slot structures that only its first few stages would use
              # (benchmarks/README.md, "Firefly's slots and a cold cache").
              "method.min_slots": _CIFAR_OR(KEEP, F.ByMethod({"ff": 256}, KEEP))},
}


class Images(Declaration):
  """Classification of images (MNIST-like data sets and CIFAR-10)."""

  name = "images"
  DATASETS = tuple(KNOWN_SHAPES)
  VARIANTS = IMAGE_VARIANTS


SCHEDULES = ("constant", "warmup_linear")

GPT2_VOCAB_SIZE = 50257  # GPT-2's BPE tokens (`alma_jax.data.text.VOCAB_SIZE` is this)


def _vocab_size(path: str, v):
  """0 (the whole vocabulary) or a vocabulary of 2 to 50,257 tokens."""
  if isinstance(v, bool) or not isinstance(v, int) or not (
      v == 0 or 2 <= v <= GPT2_VOCAB_SIZE):
    raise ConfigError(f"config.{path}={v!r} must be 0 (GPT-2's whole vocabulary) or an integer "
                      f"in [2, {GPT2_VOCAB_SIZE}]")
  return v


TEXT_FIELDS = (
    F.Field("data.text_file", None, F.optional_path(),
            "a UTF-8 text file to model instead of the tfds data set data.name (its last "
            "data.test_fraction is the test text)"),
    F.Field("data.bpe_dir", None, F.optional_path(),
            "folder of GPT-2's encoder.json and vocab.bpe (None: $ALMA_JAX_BPE_DIR)"),
    F.Field("data.text_feature", "text", F.text("a feature name"),
            "the text feature of the tfds data set"),
    F.Field("data.test_fraction", 0.1, F.number(0.0, 1.0, open_lo=True, open_hi=True),
            "the test share of a data.text_file"),
    F.Field("data.seq_len", 512, F.integer(2), "L, tokens per sequence (paper: 512)"),
    F.Field("data.vocab_size", 0, F.Check(_vocab_size, int),
            "V, the tokens the model tells apart: 0 keeps GPT-2's whole vocabulary (50,257; "
            "the paper's); V in [2, 50,257] keeps the V - 1 tokens most frequent in the training "
            "text and makes every other token one shared token V - 1 (quick runs and tests: the "
            "embedding, the output layer and every evaluation scale with V; perplexity and "
            "bits per byte are then those of the coarser tokens)"),
    F.Field("model.preset", "base", F.choice(F.owned("alma_jax.models.switch:PRESETS")),
            "Switch Transformer size: base (6 layers, d=512, d_ff=2048, a mixture in every other "
            "block: 39M shared + 6.3M per expert), large (12, d=768, d_ff=3072: 96M + 28M) or "
            "tiny (CPU)"),
    F.Field("model.num_layers", 0, F.integer(0), "blocks (0: the preset's)"),
    F.Field("model.dim", 0, F.integer(0), "model dimension d (0: the preset's)"),
    F.Field("model.num_heads", 0, F.integer(0), "attention heads (0: the preset's)"),
    F.Field("model.ffn_dim", 0, F.integer(0),
            "hidden units of an expert and of a dense feed-forward layer (0: the preset's)"),
    F.Field("model.moe_every", 0, F.integer(0),
            "a mixture of experts in every this many-th block, dense feed-forward layers in the "
            "others (0: the preset's: 2 for base and large, as in Switch Transformers; 1 for "
            "tiny)"),
    F.Field("model.scan_layers", True, F.boolean(),
            "compile the blocks as one loop over the repeated group of model.moe_every blocks "
            "(parameters stacked per group); False: every block compiled on its own (the same "
            "function up to float round-off; checkpoints of one form do not resume the other)"),
    F.Field("model.dropout", 0.0, F.number(0.0, 1.0, open_hi=True),
            "dropout rate in training, on the embeddings and the output of every attention and "
            "feed-forward layer (the paper tunes it on the validation set)"),
    F.Field("model.num_experts", 4, F.integer(1), "E, experts per block (paper: 4, 8, 12)"),
    F.Field("model.capacity_factor", 1.0, F.number(0.0, math.inf, open_lo=True),
            "expert capacity in training, in multiples of tokens / E (paper: 1.0)"),
    F.Field("model.eval_capacity_factor", 2.0, F.number(0.0, math.inf),
            "expert capacity at evaluation (0: no limit)"),
    F.Field("model.balance_weight", 0.01, F.number(0.0, math.inf),
            "weight of the load-balancing loss (paper: 0.01)"),
    F.Field("train.steps_per_epoch", 0, F.integer(0),
            "> 0: an epoch is exactly this many steps over reshuffled stage data (the paper's "
            "fixed steps per mega-batch); 0: one pass over the stage data"),
    F.Field("optimizer.schedule", "constant", F.choice(SCHEDULES),
            "learning rate: constant, or warmup_linear (linear warm-up over "
            "optimizer.warmup_steps, then linear decay to 0 at the end of the stage)"),
    F.Field("optimizer.warmup_steps", 0, F.integer(0), "warm-up steps of warmup_linear"),
    F.Field("stream.iid", False, F.boolean(),
            "train once, at t=B, on the union of all B mega-batches with B times the steps "
            "(Table 1's i.i.d. counterpart of a run with wait 1)"),
)


def expand_iid(c) -> None:
  """`stream.iid` with wait 1 -> wait B and B times the steps per epoch (in place; a no-op
  once expanded, so applying it twice is the same as once)."""
  s = c.stream
  if F.get(s, "stream.iid") is True and s.wait == 1 and s.num_megabatches > 1:
    b = s.num_megabatches
    s.wait = b
    if F.get(c.train, "train.steps_per_epoch"):
      c.train.steps_per_epoch = int(c.train.steps_per_epoch) * b


# Text: the presets `base` and `large` (the paper's sizes); smoke: seconds on a CPU (the tiny
# model, L=32, 16 sequences per mega-batch, 5 steps per stage); quick: minutes on a 2-core CPU
# (the tiny model on the whole tiny_shakespeare stream, L=64, 80 steps of 8 sequences per
# stage; smoke with the speed choices by rule); iid: Table 1's i.i.d. ablation; `Kx` (e.g.
# `2x`): K times the training steps per stage, Table 2's "2x steps" rows. No `paper` variant:
# the text defaults (`tasks/text.py`:
# Adam 0.9/0.98/1e-8, warm-up then linear decay to 0, 192 sequences of 512 tokens, 120,000
# steps per mega-batch, B=4, balancing weight 0.01, capacity factor 1, k = 2, 2, 4) already
# are the paper's (section 5, App. B.2); what it leaves to tuning (the peak learning rate in
# [2e-4, 5e-3], the warm-up in [500, 4000] steps, dropout) has no one value to set, and the
# released code has no language models.
TEXT_VARIANTS = {
    "base": {"model.preset": "base"},
    "large": {"model.preset": "large"},
    "smoke": {"model.preset": "tiny", "data.seq_len": 32, "data.train_subset": 80,
              "data.test_subset": 16, "stream.val_fraction": 0.2, "train.batch_size": 4,
              "train.eval_batch_size": 8, "train.steps_per_epoch": 5,
              "optimizer.warmup_steps": 1, "optimizer.kwargs.learning_rate": 3e-3,
              "train.autotune": "rules"},
    "quick": {"model.preset": "tiny", "data.seq_len": 64, "data.test_subset": 128,
              "stream.val_fraction": 0.02, "train.batch_size": 8, "train.eval_batch_size": 16,
              "train.steps_per_epoch": 80, "optimizer.warmup_steps": 8,
              "optimizer.kwargs.learning_rate": 2e-3},
    "iid": {"stream.iid": True},
}


class Text(Declaration):
  """Next-token prediction on BPE tokens (the language-model setting, section 5)."""

  name = "text"
  FIELDS = TEXT_FIELDS
  DATASETS = ("tiny_shakespeare",)
  METHOD_ALIASES = {"lm_sm": "sm", "lm_ens": "ens", "lm_gens": "gens", "lm_gmoe": "gmoe"}
  VARIANTS = TEXT_VARIANTS
  SCALED_STEPS = re.compile(r"[1-9][0-9]*x")  # `Kx`: K times train.steps_per_epoch
  SUMMARY_STATS = (("final_perplexity", "final perplexity", "{:.2f}"),
                   ("mean_perplexity", "mean perplexity", "{:.2f}"))

  @classmethod
  def claims(cls, config) -> bool:
    return bool(F.lookup(config, "data.text_file", None)) or super().claims(config)

  @classmethod
  def defaults(cls, c) -> None:
    """Sets the base fields of a text config to the paper's language-model settings."""
    c.model.name = "switch"
    c.optimizer.name = "adam"
    c.optimizer.kwargs = {"learning_rate": 5e-4, "b1": 0.9, "b2": 0.98, "eps": 1e-8}
    c.optimizer.weight_decay = 0.0
    c.optimizer.schedule = "warmup_linear"
    c.optimizer.warmup_steps = 4000
    c.stream.num_megabatches = 4
    c.stream.wait = 1
    c.stream.val_fraction = 0.01
    c.train.batch_size = 192
    c.train.eval_batch_size = 16
    c.train.epochs = 1
    c.train.patience = 1
    c.train.steps_per_epoch = 120000
    c.train.augment = "none"

  complete = staticmethod(expand_iid)


DECLARED = (Images, Text)
