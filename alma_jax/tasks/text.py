"""Language modelling: sequences of BPE tokens gathered on the device, next-token NLL.

The resident data (`TextData`) holds the stream's tokens followed by the test
tokens in one int32 array and the start of every sequence (training
sequences first); example i is the L + 1 tokens from `starts[i]`, read as
inputs (the first L) and targets (the last L). A step receives sequence
indices only. `per_example` gives each sequence's token error rate and mean
token NLL, so the loop's "accuracy" is next-token accuracy and its NLL the
mean token NLL (perplexity = exp(NLL), capped at `MAX_PERPLEXITY`). The training loss
is the mean token cross-entropy plus `config.model.balance_weight` times the
backbone's load-balancing loss (`aux["balance"]`, summed over its blocks).

The config fields of the text setting (data, the Switch Transformer,
fixed-step stages, the learning-rate schedule, the i.i.d. ablation), the base
fields it sets (paper section 5 and Appendix B.2), its variants and which
configs are text (`data.text_file`, `data.name` in its data sets, the Switch
Transformer as backbone, or one of the method names `lm_sm`, `lm_ens`,
`lm_gens` and `lm_gmoe`: SM, Ens, gEns and gMoE on text) are declared in
`alma_jax.configuration.plugins.tasks.Text`, the base of `TextTask`.
"""

from __future__ import annotations

import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from alma_jax import models
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.configuration.plugins import tasks as declared
from alma_jax.data import text as text_data
from alma_jax.errors import ConfigError
from alma_jax.tasks import base

# A record's perplexity is at most this: exp of a huge (finite) NLL overflows a float, and a capped
# value stays finite in JSON and in the summary's sums and standard deviations.
MAX_PERPLEXITY = 1e30

# Base fields of image backbones that the Switch Transformer does not read, with their defaults
# (`alma_jax.configuration.config_lib.BASE_FIELDS`): a text config that sets another value is refused.
IMAGE_MODEL_FIELDS = {"model.width": 64, "model.init": "lecun", "model.conv_impl": "auto"}


@struct.dataclass
class TextData:
  """Tokens of the stream and test text, and the start of every sequence (train, then test)."""

  tokens: jax.Array
  starts: jax.Array
  num_train: int = struct.field(pytree_node=False)
  seq_len: int = struct.field(pytree_node=False)

  def size(self, split: str) -> int:
    return self.num_train if split == "train" else int(self.starts.shape[0]) - self.num_train


def _corpus(config, bpe_folder: str | None) -> dict:
  """Where a config's corpus comes from (`alma_jax.data.text.token_cache`'s arguments)."""
  d = config.data
  return {"name": d.name, "text_file": d.text_file or None, "bpe_folder": bpe_folder,
          "data_dir": d.data_dir, "cache_dir": d.cache_dir, "text_feature": d.text_feature,
          "test_fraction": d.test_fraction}


class TextTask(declared.Text, base.Task):
  """Next-token prediction on sequences of L + 1 tokens."""

  input_dtype = np.int32

  def __init__(self, seq_len: int, balance_weight: float = 0.01):
    self.seq_len = int(seq_len)
    self.balance_weight = float(balance_weight)
    # The test targets that an evaluation scores: their number and UTF-8 bytes (set by `load`).
    self.test_target_tokens = 0
    self.test_target_bytes = 0

  @classmethod
  def from_config(cls, config) -> "TextTask":
    return cls(config.data.seq_len, F.get(config.model, "model.balance_weight"))

  # -- config -------------------------------------------------------------------------------
  @classmethod
  def check(cls, config) -> None:
    """The checks of a text config that tie fields together."""
    for path, default in IMAGE_MODEL_FIELDS.items():
      value = F.lookup(config, path, default)
      if value != default:
        raise ConfigError(f"config.{path}={value!r} does not apply to the Switch Transformer "
                          "(its size: config.model.preset, num_layers, dim, num_heads, ffn_dim); "
                          f"allowed values: [{default!r}]")
    if config.train.augment != "none":
      raise ConfigError(f"config.train.augment={config.train.augment!r} does not apply to "
                        "text; valid values: ['none']")
    o, steps = config.optimizer, config_lib.stage_steps(config)
    if o.schedule == "warmup_linear" and o.warmup_steps >= steps:
      raise ConfigError(f"config.optimizer.warmup_steps={o.warmup_steps} must be below the steps "
                        f"of a stage ({steps}: config.train.epochs x "
                        "config.train.steps_per_epoch)")
    if o.schedule == "warmup_linear" and not config.train.steps_per_epoch:
      raise ConfigError("config.optimizer.schedule='warmup_linear' needs a fixed number of steps "
                        "per stage: set config.train.steps_per_epoch > 0")
    if config.stream.iid and config.stream.wait not in (1, config.stream.num_megabatches):
      raise ConfigError(f"config.stream.iid=True with config.stream.wait={config.stream.wait}; "
                        f"allowed values: [1, {config.stream.num_megabatches}]")

  @classmethod
  def check_available(cls, config) -> None:
    """The text (a file, or a tfds data set prepared or downloadable) and the BPE files, or the
    corpus's token cache alone (offline, without either)."""
    d = config.data
    if d.text_file and not os.path.isfile(d.text_file):
      raise ConfigError(f"config.data.text_file={d.text_file!r} is not a file")
    try:
      folder, missing = text_data.bpe_dir(d.bpe_dir), None
    except text_data.TokenizerUnavailableError as e:
      folder, missing = None, e
    cache = text_data.token_cache(**_corpus(config, folder))[0]
    if d.use_cache and text_data.has_cache(cache):
      return  # the token cache serves
    if missing is not None:
      raise ConfigError(f"{missing}; nor is there a token cache to run from "
                        f"({os.path.dirname(cache)})") from missing
    if not d.text_file:
      base.check_dataset_available(config)

  @classmethod
  def known_shape(cls, config):
    return (config.data.seq_len,), config.data.vocab_size or text_data.VOCAB_SIZE

  # -- data ---------------------------------------------------------------------------------
  def load(self, config, seeds):
    """The corpus as sequences (a data set object for the loop) and each seed's subset (None)."""
    d = config.data
    try:
      bpe_folder = text_data.bpe_dir(d.bpe_dir)
    except text_data.TokenizerUnavailableError:
      bpe_folder = None  # the token cache must serve (`check_available`)
    corpus = text_data.load_corpus(**_corpus(config, bpe_folder), use_cache=d.use_cache,
                                   download=d.download)
    l = self.seq_len
    n_train = text_data.num_sequences(len(corpus.train_tokens), l)
    n_test = text_data.num_sequences(len(corpus.test_tokens), l)
    if d.train_subset:
      n_train = base.subset_size("train_subset", int(d.train_subset), n_train,
                                 f"training sequences of {corpus.name!r} at seq_len={l}")
    if d.test_subset:
      n_test = base.subset_size("test_subset", int(d.test_subset), n_test,
                                f"test sequences of {corpus.name!r} at seq_len={l}")
    if n_train < 1 or n_test < 1:
      raise ConfigError(f"config.data.seq_len={l} leaves {n_train} training and {n_test} test "
                        f"sequences of {corpus.name!r} ({len(corpus.train_tokens)} and "
                        f"{len(corpus.test_tokens)} tokens); use a shorter config.data.seq_len")
    train_tokens = np.asarray(corpus.train_tokens[:n_train * l + 1], np.int32)
    test_tokens = np.asarray(corpus.test_tokens[:n_test * l + 1], np.int32)
    num_classes = corpus.vocab_size
    if d.vocab_size:  # the most frequent tokens of the whole training text, the rest as one
      table = text_data.frequent_tokens(corpus.train_tokens, corpus.vocab_size, d.vocab_size)
      train_tokens, test_tokens = table[train_tokens], table[test_tokens]
      num_classes = d.vocab_size
    self.test_target_tokens = n_test * l
    self.test_target_bytes = int(np.sum(corpus.test_bytes[1:n_test * l + 1]))
    starts = np.concatenate([np.arange(n_train) * l,
                             len(train_tokens) + np.arange(n_test) * l]).astype(np.int32)
    ds = types.SimpleNamespace(
        name=corpus.name, tokens=np.concatenate([train_tokens, test_tokens]), starts=starts,
        num_train=n_train, num_classes=num_classes,
        # Shapes only (no memory): the loop reads the number of examples and the input shape.
        train_x=np.broadcast_to(np.zeros((), np.int32), (n_train, l)),
        train_y=np.broadcast_to(np.zeros((), np.int32), (n_train,)),
        test_y=np.broadcast_to(np.zeros((), np.int32), (n_test,)))
    return ds, [None] * len(seeds)

  def device_data(self, ds) -> TextData:
    return TextData(tokens=ds.tokens, starts=ds.starts, num_train=ds.num_train,
                    seq_len=self.seq_len)

  def inputs(self, data: TextData, idx, rng=None):
    """(input tokens (..., L), target tokens (..., L)) of sequences `idx`."""
    del rng
    seq = data.tokens[data.starts[idx][..., None] + jnp.arange(data.seq_len + 1)]
    return seq[..., :-1], seq[..., 1:]

  # -- models and losses ----------------------------------------------------------------------
  def backbone(self, model_config, num_classes: int, input_shape: tuple[int, ...], **overrides):
    """The backbone of `config.model` with position embeddings for `input_shape[0]` tokens."""
    return models.get_backbone(model_config.name).from_config(
        model_config, num_classes, max_len=input_shape[0], **overrides)

  def aux_loss(self, aux) -> jax.Array:
    """`config.model.balance_weight` times the load-balancing loss."""
    return self.balance_weight * aux["balance"]

  def per_example(self, logp, y):
    """(token error rate, mean token NLL) of every sequence."""
    nll = base.nll(logp, y)
    errors = base.errors(logp, y)
    return jnp.mean(errors, -1), jnp.mean(nll.astype(jnp.float32), -1)

  # -- records, summaries and log lines -------------------------------------------------------
  def record_metrics(self, nll_mean: float, flops: dict) -> dict:
    """The language-model fields of a record: test NLL (nats per token), perplexity (at most
    `MAX_PERPLEXITY`), bits per byte, and the costs per token."""
    bits = nll_mean * self.test_target_tokens / math.log(2)
    return {"test_nll": float(nll_mean), "test_perplexity": perplexity(nll_mean),
            "test_bits_per_byte": float(bits / self.test_target_bytes),
            "forward_macs_per_token": flops["train_macs_per_example"] / self.seq_len,
            "inference_flops_per_token": flops["inference_per_example"] / self.seq_len}

  def summary(self, records) -> dict[str, float]:
    """The test perplexity averaged over t = 1 ... B (the paper's average perplexity, one point
    per mega-batch) and over t = 0 ... B, its final value, the same for bits per byte, and
    the costs per token; empty when the records have no perplexity."""
    if not records or "test_perplexity" not in records[0].extra:
      return {}
    ppl = [r.extra["test_perplexity"] for r in records]
    bpb = [r.extra["test_bits_per_byte"] for r in records]
    after = ppl[1:] or ppl
    return {"mean_perplexity": float(sum(after) / len(after)),
            "mean_perplexity_with_t0": float(sum(ppl) / len(ppl)),
            "final_perplexity": float(ppl[-1]),
            "mean_bits_per_byte": float(sum(bpb[1:] or bpb) / len(bpb[1:] or bpb)),
            "final_bits_per_byte": float(bpb[-1]),
            "forward_macs_per_token": float(records[-1].extra["forward_macs_per_token"]),
            "inference_flops_per_token": float(records[-1].extra["inference_flops_per_token"])}

  def progress(self, records) -> str:
    """The test perplexity (the mean over the seeds)."""
    if not records or "test_perplexity" not in records[0].extra:
      return ""
    return "test_ppl=%.3f" % float(np.mean([r.extra["test_perplexity"] for r in records]))

  def summary_line(self, summary) -> str:
    if "mean_perplexity" not in summary:
      return ""
    return ("perplexity: mean over t=1..B %.3f, final %.3f; bits per byte: mean %.4f"
            % (summary["mean_perplexity"], summary["final_perplexity"],
               summary["mean_bits_per_byte"]))

def perplexity(nll: float) -> float:
  """exp(`nll`), capped at `MAX_PERPLEXITY` (with a warning: such a model has diverged)."""
  nll = float(nll)
  if nll > math.log(MAX_PERPLEXITY):
    logging.warning("test NLL %.4g nats per token: its perplexity is recorded as %g, the cap "
                    "(the model has diverged; a smaller config.optimizer.kwargs.learning_rate "
                    "may help)", nll, MAX_PERPLEXITY)
    return MAX_PERPLEXITY
  return math.exp(nll)
