"""Text corpora as GPT-2 byte-level BPE tokens, with a token cache.

A corpus is a tfds data set with a text feature (`tiny_shakespeare`, ...),
whose `train` split is the stream's text and whose `test` split is the test
text, or a plain UTF-8 file, whose last `test_fraction` (cut at a line break)
is the test text. The text is tokenised with GPT-2's BPE (50,257 tokens)
through `tiktoken`: from a local `encoder.json` and `vocab.bpe` when a folder
is given (`config.data.bpe_dir` or $ALMA_JAX_BPE_DIR), so that no download is
needed; otherwise with tiktoken's own `gpt2` encoding, which tiktoken
downloads once (the same two files) and keeps in its cache
($TIKTOKEN_CACHE_DIR, by default <tmp>/data-gym-cache). Offline with neither,
the error names the files, where to get them and how to point the run at
them. The first load writes the token arrays (uint16) and the
byte length of every test target under the cache directory, keyed by the
source and a digest of the tokenizer files; later loads read the cache
without importing TensorFlow or tokenising again. A run whose token cache is
there needs nothing else: offline, without the tfds copy (the newest cached
version of the corpus is read) and without the BPE files (a cache made with
GPT-2's BPE is keyed by the digest of GPT-2's published files, which a local
copy of them has too).

The token stream is cut into sequences of L + 1 tokens that overlap by one
(sequence i holds tokens iL ... iL + L): the model reads the first L and
predicts the last L. The sequences are the examples of the mega-batch stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tempfile
import time

import numpy as np
from absl import logging

from alma_jax.configuration.plugins import tasks as declared_tasks
from alma_jax.data import images
from alma_jax.runtime import caches

BPE_FILES = ("encoder.json", "vocab.bpe")
BPE_DIR_ENV = "ALMA_JAX_BPE_DIR"
VOCAB_SIZE = declared_tasks.GPT2_VOCAB_SIZE  # its config field checks values against it
# tfds text data sets offered for a mistyped name (with those prepared here).
KNOWN_NAMES = ("tiny_shakespeare", "lm1b")


# The `bpe_dir` that stands for tiktoken's own `gpt2` encoding (no local folder given).
TIKTOKEN_GPT2 = "tiktoken:gpt2"
# Where tiktoken downloads GPT-2's files from, and their SHA-256 (as tiktoken checks them).
BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
BPE_HOST = ("openaipublic.blob.core.windows.net", 443)
BPE_SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
              "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}


class TokenizerUnavailableError(ValueError):
  """The BPE files cannot be found or read."""


def _digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def tiktoken_cache_file(name: str) -> str | None:
  """Where tiktoken keeps its download of GPT-2's file `name` (a SHA-1 of its URL in
  $TIKTOKEN_CACHE_DIR, $DATA_GYM_CACHE_DIR or <tmp>/data-gym-cache); None when its cache is
  off (an empty $TIKTOKEN_CACHE_DIR)."""
  for env in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
    if env in os.environ:
      folder = os.environ[env]
      break
  else:
    folder = os.path.join(tempfile.gettempdir(), "data-gym-cache")
  if not folder:
    return None
  return os.path.join(folder, hashlib.sha1((BPE_URL + name).encode()).hexdigest())


def _tiktoken_has_gpt2() -> bool:
  """Whether tiktoken's cache holds both of GPT-2's files, intact."""
  paths = {f: tiktoken_cache_file(f) for f in BPE_FILES}
  return all(p and os.path.isfile(p) and _digest(p) == BPE_SHA256[f] for f, p in paths.items())


def _how_to_get_files() -> str:
  return (f"download {BPE_URL}encoder.json and {BPE_URL}vocab.bpe into a folder and set "
          f"config.data.bpe_dir (or ${BPE_DIR_ENV}) to it, or run once with internet access "
          "(tiktoken then keeps them in $TIKTOKEN_CACHE_DIR)")


def bpe_dir(configured: str | None) -> str:
  """The folder of the GPT-2 BPE files (`configured`, else $ALMA_JAX_BPE_DIR), or, with
  neither, `TIKTOKEN_GPT2` when tiktoken has the files in its cache or can download them."""
  folder = configured or os.environ.get(BPE_DIR_ENV)
  if not folder:
    if _tiktoken_has_gpt2() or images.internet_reachable(host=BPE_HOST):
      return TIKTOKEN_GPT2
    cache = tiktoken_cache_file(BPE_FILES[0])
    raise TokenizerUnavailableError(
        f"config.data.bpe_dir is not set, ${BPE_DIR_ENV} is empty, and tiktoken's gpt2 "
        f"encoding is not in its cache ({os.path.dirname(cache) if cache else 'off'}) and "
        f"cannot be downloaded (no internet connection); {_how_to_get_files()}")
  missing = [f for f in BPE_FILES if not os.path.isfile(os.path.join(folder, f))]
  if missing:
    raise TokenizerUnavailableError(
        f"config.data.bpe_dir={folder!r} lacks {missing}; it must hold GPT-2's {list(BPE_FILES)}")
  return folder


def tokenizer_digest(folder: str) -> str:
  """A digest of the BPE files (the same for tiktoken's `gpt2` and a local copy of them)."""
  digests = (BPE_SHA256[f] if folder == TIKTOKEN_GPT2 else _digest(os.path.join(folder, f))
             for f in BPE_FILES)
  return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


def load_tokenizer(folder: str):
  """GPT-2's byte-level BPE as a `tiktoken.Encoding`, read from `folder` (no download), or
  tiktoken's own `gpt2` encoding for `TIKTOKEN_GPT2` (downloaded once into its cache)."""
  import tiktoken  # pylint: disable=g-import-not-at-top
  from tiktoken import load as tiktoken_load  # pylint: disable=g-import-not-at-top
  from tiktoken_ext import openai_public  # pylint: disable=g-import-not-at-top
  if folder == TIKTOKEN_GPT2:
    try:
      return tiktoken.get_encoding("gpt2")
    except Exception as e:  # pylint: disable=broad-except  (a failed download, a bad file)
      raise TokenizerUnavailableError(
          f"tiktoken's gpt2 encoding cannot be loaded ({type(e).__name__}: "
          f"{' '.join(str(e).split())[:200]}); {_how_to_get_files()}") from e
  encoder, vocab = (os.path.join(folder, f) for f in BPE_FILES)
  # The hashes make tiktoken's own file cache check its copies against these files.
  ranks = tiktoken_load.data_gym_to_mergeable_bpe_ranks(
      vocab_bpe_file=vocab, encoder_json_file=encoder, vocab_bpe_hash=_digest(vocab),
      encoder_json_hash=_digest(encoder))
  enc = tiktoken.Encoding(name="gpt2_local", pat_str=openai_public.r50k_pat_str,
                          mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256},
                          explicit_n_vocab=VOCAB_SIZE)
  return enc


def encode(enc, text: str) -> np.ndarray:
  """Tokens of `text` (special-token strings are encoded as plain text)."""
  return np.asarray(enc.encode_ordinary(text), np.uint16)


def token_bytes(enc) -> np.ndarray:
  """The number of UTF-8 bytes each token stands for (int32, vocabulary-sized)."""
  return np.asarray([len(enc.decode_single_token_bytes(t)) for t in range(enc.n_vocab)], np.int32)


@dataclasses.dataclass(frozen=True)
class TextCorpus:
  """The tokens of the stream's text and of the test text."""

  name: str
  train_tokens: np.ndarray  # uint16 (T,)
  test_tokens: np.ndarray  # uint16 (T_test,)
  test_bytes: np.ndarray  # int32 (T_test,): UTF-8 bytes of each test token
  vocab_size: int
  timings: dict = dataclasses.field(default_factory=dict, compare=False)


# -- sources ---------------------------------------------------------------------------------------
def _tfds_text(name: str, data_dir: str | None, feature: str, download: str) -> dict[str, str]:
  """The `train` and `test` splits of a tfds text data set, each joined into one string."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    hint = images.name_hint(name, data_dir, KNOWN_NAMES, tuple(tfds.list_builders()))
    raise images.DatasetUnavailableError(
        f"config.data.name={name!r} is not a tfds data set ({type(e).__name__}); set it to "
        f"one, or config.data.text_file to a UTF-8 text file{hint}") from e
  if not builder.is_prepared():
    if download == "no" or (download == "auto" and not images.internet_reachable()):
      raise images.DatasetUnavailableError(
          f"data set {name!r} is not prepared in {data_dir or os.environ.get('TFDS_DATA_DIR')} "
          "and cannot be downloaded; set TFDS_DATA_DIR (or config.data.data_dir), or "
          f"config.data.text_file{images.name_hint(name, data_dir, KNOWN_NAMES)}")
    builder.download_and_prepare()
  features = list(builder.info.features.keys())
  if feature not in features:
    raise images.DatasetUnavailableError(
        f"config.data.text_feature={feature!r} is not a feature of {name!r}; valid values: "
        f"{features}")
  out = {}
  for split in ("train", "test"):
    parts = [ex[feature] for ex in tfds.as_numpy(builder.as_dataset(split=split))]
    out[split] = "\n".join(p.decode("utf-8") if isinstance(p, bytes) else str(p) for p in parts)
  out["version"] = str(builder.info.version)
  return out


def split_text(text: str, test_fraction: float) -> tuple[str, str]:
  """(stream text, test text): the last `test_fraction` of `text`, cut after a line break."""
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"config.data.test_fraction={test_fraction} must be in (0.0, 1.0)")
  cut = int(len(text) * (1.0 - test_fraction))
  newline = text.rfind("\n", 0, cut)
  cut = newline + 1 if newline > 0 else cut
  return text[:cut], text[cut:]


def _file_text(path: str) -> str:
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise images.DatasetUnavailableError(f"config.data.text_file={path!r} cannot be read: "
                                         f"{e.strerror}") from e
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise images.DatasetUnavailableError(
        f"config.data.text_file={path!r} is not UTF-8 text (byte {e.start})") from e


def _file_key(path: str) -> str:
  return _digest(path)[:16]


# -- loading with the cache -----------------------------------------------------------------------
def token_cache(*, name: str, text_file: str | None, bpe_folder: str | None,
                data_dir: str | None = None, cache_dir: str | None = None,
                text_feature: str = "text", test_fraction: float = 0.1) -> tuple[str, str]:
  """(the folder of the corpus's token cache, the corpus's label). `bpe_folder` None: the BPE
  files are not at hand, so only a cache made with GPT-2's BPE can serve. Without a prepared
  tfds copy of `name`, the newest version of it in the cache."""
  tok = tokenizer_digest(bpe_folder if bpe_folder else TIKTOKEN_GPT2)
  root = os.path.join(cache_dir or images.default_cache_dir(), "text")
  if text_file:
    source = f"file_{_file_key(text_file)}_test{test_fraction!r}"
    return os.path.join(root, f"{source}_bpe{tok}"), os.path.basename(text_file)
  versions = images.prepared_versions(name, data_dir)
  folder = os.path.join(root, f"tfds_{name}_{versions[-1] if versions else 'any'}_"
                              f"{text_feature}_bpe{tok}")
  if not versions and os.path.isdir(root):  # no tfds copy: the newest cached version
    pattern = re.compile(
        rf"tfds_{re.escape(name)}_(\d[\w.]*)_{re.escape(text_feature)}_bpe{tok}")
    cached = sorted((m.group(1), d) for d in os.listdir(root) if (m := pattern.fullmatch(d))
                    and has_cache(os.path.join(root, d)))
    if cached:
      folder = os.path.join(root, cached[-1][1])
  return folder, name


def has_cache(folder: str) -> bool:
  """Whether the cache folder `folder` holds a cache (not checked for damage)."""
  return os.path.isfile(os.path.join(folder, "meta.json"))


def load_corpus(*, name: str, text_file: str | None, bpe_folder: str | None,
                data_dir: str | None = None, cache_dir: str | None = None, use_cache: bool = True,
                text_feature: str = "text", test_fraction: float = 0.1,
                download: str = "auto") -> TextCorpus:
  """Loads (or tokenises and caches) a text corpus; see the module docstring. `bpe_folder`
  None: the BPE files are not at hand, the token cache must serve."""
  t0 = time.monotonic()
  folder, label = token_cache(name=name, text_file=text_file, bpe_folder=bpe_folder,
                              data_dir=data_dir, cache_dir=cache_dir, text_feature=text_feature,
                              test_fraction=test_fraction)

  def tokenise(write: bool) -> TextCorpus:
    if bpe_folder is None:
      raise TokenizerUnavailableError(
          f"no usable token cache of {label!r} in {os.path.dirname(folder)}, and the GPT-2 BPE "
          f"files to make one are not at hand; {_how_to_get_files()}")
    if text_file:
      train_text, test_text = split_text(_file_text(text_file), test_fraction)
    else:
      splits = _tfds_text(name, data_dir, text_feature, download)
      train_text, test_text = splits["train"], splits["test"]
    enc = load_tokenizer(bpe_folder)
    arrays = {"train": encode(enc, train_text), "test": encode(enc, test_text)}
    arrays["test_bytes"] = token_bytes(enc)[arrays["test"]]
    if write:
      try:
        images.write_cache(folder, arrays, {"name": label, "vocab_size": int(enc.n_vocab)})
      except OSError as e:
        logging.warning("could not write the token cache under %s: %s", folder, e)
    return TextCorpus(label, arrays["train"], arrays["test"], arrays["test_bytes"],
                      int(enc.n_vocab), {"load_s": time.monotonic() - t0, "source": "tokenised"})

  if not use_cache:
    return tokenise(write=False)
  # One process tokenises; another that needs the corpus meanwhile waits and reads its copy.
  lock = caches.lock_file(os.path.dirname(os.path.dirname(folder)),  # <cache>/text/<folder>
                          f"tokens_{os.path.basename(folder)}")
  return caches.read_or_make(lock, f"the tokenisation of {label}",
                             lambda warn: _from_token_cache(folder, label, t0, warn),
                             lambda: tokenise(write=True))


def _from_token_cache(folder: str, label: str, t0: float, warn: bool) -> TextCorpus | None:
  """The corpus from its token cache; None if there is none, or it is stale or damaged
  (`warn`: say so)."""
  if not has_cache(folder):
    return None
  try:
    arrays, meta = images.read_cache(folder)
  except ValueError as e:
    if warn:
      logging.warning("token cache %s is stale or corrupt (%s); tokenising again", folder, e)
    return None
  return TextCorpus(label, arrays["train"], arrays["test"], arrays["test_bytes"],
                    int(meta["vocab_size"]), {"load_s": time.monotonic() - t0,
                                              "source": "cache"})


def frequent_tokens(tokens: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
  """The table (int32, `vocab_size` entries) that maps a token to one of `size` tokens: the
  `size - 1` tokens most frequent in `tokens` to 0, 1, ... by falling count (a tie: the
  smaller id first), every other token to `size - 1`."""
  if not 2 <= size <= vocab_size:
    raise ValueError(f"a vocabulary of {size} tokens cannot be cut from one of {vocab_size}")
  counts = np.bincount(np.asarray(tokens, np.int64), minlength=vocab_size)
  kept = np.argsort(-counts, kind="stable")[:size - 1]
  table = np.full(vocab_size, size - 1, np.int32)
  table[kept] = np.arange(size - 1, dtype=np.int32)
  return table


def num_sequences(num_tokens: int, seq_len: int) -> int:
  """How many sequences of L + 1 tokens (overlapping by one) `num_tokens` tokens give."""
  return max(0, (num_tokens - 1) // seq_len)
