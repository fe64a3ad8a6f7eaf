"""tfds image-classification data sets as numpy arrays, with a decoded cache.

The first load of a data set decodes it and writes the uint8 images and int32
labels of each split as `.npy` files (plus a `meta.json`) under the cache
directory, keyed by name and tfds version. Later loads memory-map those files.
A prepared copy of PNG images and class labels in one TFRecord file per split
(MNIST, CIFAR-10, ...) is decoded from its files directly; anything else with
tensorflow_datasets, whose TensorFlow import alone costs seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import json
import os
import time
import zlib

import numpy as np
from absl import logging

from alma_jax.data import tfrecord
from alma_jax.outputs import io_utils
from alma_jax.runtime import caches
from alma_jax.runtime.caches import default_cache_dir

CACHE_FORMAT = 2
SPLITS = ("train", "test")


class DatasetUnavailableError(ValueError):
  """The data set is neither prepared locally nor downloadable."""


@dataclasses.dataclass(frozen=True)
class ImageDataset:
  name: str
  train_x: np.ndarray  # uint8 (N, H, W, C)
  train_y: np.ndarray  # int32 (N,)
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  mean: np.ndarray  # float32 (C,), per-channel mean of train_x / 255
  std: np.ndarray  # float32 (C,)
  timings: dict = dataclasses.field(default_factory=dict, compare=False)


DOWNLOAD_CHOICES = ("auto", "yes", "no")
DOWNLOAD_HOST = ("storage.googleapis.com", 443)  # where tfds downloads from


def internet_reachable(timeout: float = 2.0, host: tuple[str, int] = DOWNLOAD_HOST) -> bool:
  """Whether a download host (tfds's by default) answers (a quick probe, so that an offline
  machine fails at once instead of after minutes of download retries)."""
  import socket  # pylint: disable=g-import-not-at-top
  try:
    socket.create_connection(host, timeout=timeout).close()
    return True
  except OSError:
    return False


def _tfds_dir(data_dir: str | None) -> str | None:
  return data_dir or os.environ.get("TFDS_DATA_DIR")


def _prepared_versions(name: str, data_dir: str | None) -> list[str]:
  """Versions of `name` prepared under the tfds data dir, found with plain os calls."""
  d = _tfds_dir(data_dir)
  if not d:
    return []
  root = os.path.join(d, name)
  if not os.path.isdir(root):
    return []
  return sorted(v for v in os.listdir(root)
                if os.path.isfile(os.path.join(root, v, "dataset_info.json")))


# tfds image-classification data sets offered for a mistyped name (with those prepared here).
KNOWN_NAMES = ("mnist", "fashion_mnist", "kmnist", "emnist", "cifar10", "cifar100",
               "svhn_cropped")


def prepared_names(data_dir: str | None) -> list[str]:
  """The data sets prepared under the tfds data dir (any version)."""
  d = _tfds_dir(data_dir)
  if not d or not os.path.isdir(d):
    return []
  return sorted(n for n in os.listdir(d) if _prepared_versions(n, d))


def name_hint(name: str, data_dir: str | None = None, known: tuple[str, ...] = KNOWN_NAMES,
              more: tuple[str, ...] = ()) -> str:
  """"; did you mean 'mnist'?" for a data set name that is none of `known`, `more` and those
  prepared under the tfds data dir but close to one of them (a typo); "" otherwise."""
  names = set(known) | set(more) | set(prepared_names(data_dir))
  if name in names:
    return ""
  close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
  return f"; did you mean {close[0]!r}?" if close else ""


def _cached_versions(name: str, cache_dir: str) -> list[str]:
  root = os.path.join(cache_dir, name)
  if not os.path.isdir(root):
    return []
  return sorted(v for v in os.listdir(root) if os.path.isfile(os.path.join(root, v, "meta.json")))


# -- checksums ---------------------------------------------------------------
# Every load checks shape, dtype and a CRC32 of every byte: measured here at
# ~35 ms for MNIST and ~60 ms for CIFAR-10, small next to a TensorFlow import.


def _crc(a: np.ndarray) -> int:
  flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
  return zlib.crc32(memoryview(flat)) & 0xFFFFFFFF


def _write_cache(folder: str, arrays: dict[str, np.ndarray], info: dict) -> None:
  os.makedirs(folder, exist_ok=True)
  meta = dict(info, format=CACHE_FORMAT, arrays={})
  for key, a in arrays.items():
    with io_utils.atomic_writer(os.path.join(folder, f"{key}.npy"), "wb") as f:
      np.save(f, a)
    meta["arrays"][key] = {"shape": list(a.shape), "dtype": str(a.dtype),
                           "crc32": _crc(a)}
  # Written last: its presence marks the cache complete. (atomic_writer, not
  # write_json_atomic: a failed cache write is a warning, not a run's error.)
  with io_utils.atomic_writer(os.path.join(folder, "meta.json")) as f:
    f.write(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def remove_stale_temporaries(cache_dir: str, name: str) -> None:
  """Removes the temp files of cache writes of `name` that were killed (any version)."""
  root = os.path.join(cache_dir, name)
  try:
    versions = [os.path.join(root, v) for v in os.listdir(root)]
  except OSError:
    return
  for folder in versions:
    if os.path.isdir(folder):
      for path in io_utils.remove_stale_temporaries(folder):
        logging.info("removed %s, left by a cache write that did not finish", path)


def _read_cache(folder: str) -> tuple[dict[str, np.ndarray], dict]:
  """Loads and validates a cache folder; raises ValueError when stale or corrupt."""
  try:
    with open(os.path.join(folder, "meta.json")) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"unreadable meta.json: {e}") from e
  if meta.get("format") != CACHE_FORMAT:
    raise ValueError(f"cache format {meta.get('format')} != {CACHE_FORMAT}")
  arrays = {}
  for key, spec in meta["arrays"].items():
    path = os.path.join(folder, f"{key}.npy")
    try:
      a = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
      raise ValueError(f"{key}.npy: {e}") from e
    if list(a.shape) != spec["shape"] or str(a.dtype) != spec["dtype"]:
      raise ValueError(f"{key}.npy: shape/dtype {a.shape}/{a.dtype} != {spec['shape']}/{spec['dtype']}")
    if _crc(a) != spec["crc32"]:
      raise ValueError(f"{key}.npy: checksum mismatch")
    arrays[key] = a
  return arrays, meta


# -- tfds ----------------------------------------------------------------------
def _load_tfds(name: str, data_dir: str | None,
               download: str = "auto") -> tuple[dict[str, np.ndarray], dict]:
  """Decodes both splits with tensorflow_datasets (imported only here)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")  # keep TensorFlow off accelerators
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  where = _tfds_dir(data_dir) or "tfds's default directory (~/tensorflow_datasets)"
  hint = ("set TFDS_DATA_DIR or config.data.data_dir to a folder holding prepared tfds data, "
          "or run once with internet access (config.data.download=auto or yes)")
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    known = sorted(tfds.list_builders())
    raise DatasetUnavailableError(
        f"config.data.name={name!r} is not a tfds data set ({type(e).__name__}); valid names "
        f"include {list(KNOWN_NAMES)} ... ({len(known)} in all)"
        f"{name_hint(name, data_dir, more=tuple(known))}") from e
  if not builder.is_prepared():
    if download == "no" or (download == "auto" and not internet_reachable()):
      why = "downloads are off" if download == "no" else "there is no internet connection"
      raise DatasetUnavailableError(
          f"data set {name!r} is not prepared in {where} and {why}; {hint}"
          f"{name_hint(name, data_dir)}")
    try:
      builder.download_and_prepare()
    except Exception as e:  # pylint: disable=broad-except
      raise DatasetUnavailableError(
          f"data set {name!r} is not prepared in {where} and could not be downloaded "
          f"({type(e).__name__}); {hint}") from e
  arrays = {}
  for split in SPLITS:
    # Fixed-size batches rather than batch_size=-1: the latter needs a known
    # cardinality, which generator-backed sources (tfds.testing.mock_data) lack.
    batches = list(tfds.as_numpy(builder.as_dataset(split=split, batch_size=10_000,
                                                    as_supervised=True)))
    arrays[f"{split}_x"] = np.concatenate([b[0] for b in batches]).astype(np.uint8, copy=False)
    arrays[f"{split}_y"] = np.concatenate([b[1] for b in batches]).astype(np.int32, copy=False)
  return arrays, _info(name, str(builder.info.version),
                       int(builder.info.features["label"].num_classes), arrays["train_x"])


def _info(name: str, version: str, num_classes: int, train_x: np.ndarray) -> dict:
  mean, std = channel_stats(train_x)
  return {"name": name, "version": version, "num_classes": num_classes, "mean": mean,
          "std": std}


def channel_stats(x: np.ndarray, chunk: int = 1 << 22) -> tuple[list[float], list[float]]:
  """Per-channel mean and standard deviation (of the population) of uint8 images `x`
  (..., C) scaled to [0, 1], from each channel's exact count of every byte value: the mean
  correctly rounded to float64, the standard deviation the float64 square root of the
  correctly rounded variance. Exact sums of integers, so neither the order of the pixels
  nor the machine changes them; `chunk` pixels are counted at a time."""
  from fractions import Fraction  # pylint: disable=g-import-not-at-top

  if x.dtype != np.uint8 or x.ndim < 1 or x.size == 0:
    raise ValueError(f"channel_stats takes a non-empty uint8 array, got {x.dtype} {x.shape}")
  flat = x.reshape(-1, x.shape[-1])
  counts = np.zeros((flat.shape[1], 256), np.int64)
  for start in range(0, flat.shape[0], chunk):
    for c in range(flat.shape[1]):
      counts[c] += np.bincount(flat[start:start + chunk, c], minlength=256)
  n, values = flat.shape[0], range(256)
  mean, std = [], []
  for row in counts.tolist():  # Python integers: the sums below are exact
    s1 = sum(k * v for k, v in zip(row, values))
    s2 = sum(k * v * v for k, v in zip(row, values))
    mean.append(float(Fraction(s1, 255 * n)))
    std.append(float(np.sqrt(float(Fraction(n * s2 - s1 * s1, (255 * n) ** 2)))))
  return mean, std


# -- prepared files, read directly ---------------------------------------------
class NotDirect(Exception):
  """A prepared copy that `_read_prepared` leaves to tfds (the reason is the message)."""


_PNG = b"\x89PNG\r\n\x1a\n"
_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"


def _prepared_layout(name: str, data_dir: str | None) -> tuple[str, dict, tuple, int]:
  """(folder, {split: (file, examples)}, image shape, classes) of the one prepared version of
  `name`, when tfds would read it as one file per split of PNG images and class labels."""
  versions = _prepared_versions(name, data_dir)
  if len(versions) != 1:
    raise NotDirect(f"{len(versions)} prepared versions")
  folder = os.path.join(_tfds_dir(data_dir), name, versions[0])
  try:
    with open(os.path.join(folder, "dataset_info.json")) as f:
      info = json.load(f)
    with open(os.path.join(folder, "features.json")) as f:
      features = json.load(f)["featuresDict"]["features"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise NotDirect(f"its description is not readable here ({e!r})") from e
  file_format = info.get("fileFormat", "tfrecord")
  keys = [k.get("featureKey") for k in
          info.get("supervisedKeys", {}).get("tuple", {}).get("items", [])]
  image, label = features.get("image", {}), features.get("label", {})
  if file_format != "tfrecord" or keys != ["image", "label"]:
    raise NotDirect(f"file format {file_format!r}, supervised keys {keys}")
  if (not image.get("pythonClassName", "").endswith("image_feature.Image")
      or image.get("image", {}).get("dtype") != "uint8"
      or "classLabel" not in label):
    raise NotDirect("its features are not uint8 images and class labels")
  try:
    shape = tuple(int(d) for d in image["image"]["shape"]["dimensions"])
    num_classes = int(label["classLabel"]["numClasses"])
  except (KeyError, ValueError) as e:
    raise NotDirect(f"an image of unknown size or labels of unknown count ({e!r})") from e
  if len(shape) != 3 or min(shape) < 1 or shape[-1] not in (1, 3):
    raise NotDirect(f"image shape {shape}")
  splits = {s.get("name"): s for s in info.get("splits", [])}
  files = {}
  for split in SPLITS:
    lengths = splits.get(split, {}).get("shardLengths", [])
    if len(lengths) != 1:  # tfds interleaves the records of several shards
      raise NotDirect(f"split {split!r} has {len(lengths)} files")
    template = splits[split].get("filepathTemplate", _TEMPLATE)
    file = template.format(DATASET=name, SPLIT=split, FILEFORMAT=file_format,
                           SHARD_X_OF_Y="00000-of-00001")
    files[split] = (os.path.join(folder, file), int(lengths[0]))
  return folder, files, shape, num_classes


def read_prepared_split(path: str, count: int, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
  """The images (uint8, (count, *shape)) and labels (int32) of one prepared TFRecord file of
  PNG images and class labels, in file order: the arrays tfds decodes from it."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  records = list(tfrecord.records(path))
  if len(records) != count:
    raise NotDirect(f"{path} holds {len(records)} examples, its description {count}")
  x = np.empty((count, *shape), np.uint8)
  y = np.empty((count,), np.int32)
  mode = {1: "L", 3: "RGB"}[shape[-1]]
  for i, record in enumerate(records):
    ex = tfrecord.example(record)
    png, labels = ex.get("image", [b""])[0], ex.get("label", [])
    if not png.startswith(_PNG) or len(labels) != 1:
      raise NotDirect(f"example {i} of {path} is not one PNG image and one label")
    with Image.open(io.BytesIO(png)) as im:
      if im.mode != mode or im.size != (shape[1], shape[0]):
        raise NotDirect(f"example {i} of {path}: a {im.mode} image of {im.size}, not "
                        f"{mode} of {shape[1]}x{shape[0]}")
      x[i] = np.asarray(im).reshape(shape)
    y[i] = labels[0]
  return x, y


def _read_prepared(name: str, data_dir: str | None) -> tuple[dict[str, np.ndarray], dict]:
  """Decodes both splits of a prepared copy from its files (`_prepared_layout` says which
  copies); raises NotDirect for any other."""
  try:
    import PIL  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise NotDirect("Pillow is not installed") from e
  folder, files, shape, num_classes = _prepared_layout(name, data_dir)
  arrays = {}
  try:
    for split, (path, count) in files.items():
      arrays[f"{split}_x"], arrays[f"{split}_y"] = read_prepared_split(path, count, shape)
  except (OSError, ValueError, SyntaxError) as e:  # an unreadable file, record or PNG
    raise NotDirect(repr(e)) from e
  return arrays, _info(name, os.path.basename(folder), num_classes, arrays["train_x"])


def _make(arrays, info, timings) -> ImageDataset:
  return ImageDataset(name=info["name"], train_x=arrays["train_x"], train_y=arrays["train_y"],
                      test_x=arrays["test_x"], test_y=arrays["test_y"],
                      num_classes=int(info["num_classes"]),
                      mean=np.asarray(info["mean"], np.float32),
                      std=np.asarray(info["std"], np.float32), timings=timings)


def _decode(name: str, data_dir: str | None,
            download: str) -> tuple[dict[str, np.ndarray], dict, str]:
  """Both splits' arrays, the cache's description and where they came from: the prepared
  files read directly where `_read_prepared` can, else tfds."""
  try:
    return (*_read_prepared(name, data_dir), "prepared files")
  except NotDirect as e:
    logging.info("decoding %s with tensorflow_datasets: %s", name, e)
    return (*_load_tfds(name, data_dir, download), "tfds")


def load_image_dataset(name: str, *, data_dir: str | None = None, cache_dir: str | None = None,
                       use_cache: bool = True, download: str = "auto") -> ImageDataset:
  """Loads a tfds image-classification data set by name.

  Args:
    name: tfds name, e.g. "mnist", "cifar10", "fashion_mnist", "cifar100".
    data_dir: tfds data directory; None means $TFDS_DATA_DIR or tfds's default.
    cache_dir: decoded-array cache; None means `default_cache_dir()`.
    use_cache: read and write the cache.
    download: whether tfds may download and prepare a data set missing from
      `data_dir`: "yes", "no", or "auto" (when its download host answers;
      offline, tfds would retry for minutes before giving up).

  Raises:
    DatasetUnavailableError: unknown name, or no prepared copy and no download.
  """
  if download not in DOWNLOAD_CHOICES:
    raise ValueError(f"download={download!r} is not valid; valid values: {list(DOWNLOAD_CHOICES)}")
  t0 = time.monotonic()
  cache_dir = cache_dir or default_cache_dir()

  def decode(write: bool) -> ImageDataset:
    arrays, info, source = _decode(name, data_dir, download)
    if write:
      try:
        _write_cache(os.path.join(cache_dir, name, info["version"]), arrays, info)
      except OSError as e:
        logging.warning("could not write the decoded cache under %s: %s", cache_dir, e)
    return _make(arrays, info, {"load_s": time.monotonic() - t0, "source": source})

  if not use_cache:
    return decode(write=False)
  remove_stale_temporaries(cache_dir, name)
  # One process decodes; another that needs the data meanwhile waits and reads its copy.
  return caches.read_or_make(caches.lock_file(cache_dir, f"decode_{name}"),
                             f"the decoding of {name}",
                             lambda warn: _from_cache(name, data_dir, cache_dir, t0, warn),
                             lambda: decode(write=True))


def _from_cache(name: str, data_dir: str | None, cache_dir: str, t0: float,
                warn: bool) -> ImageDataset | None:
  """The data set from its decoded cache (the version of the prepared copy, or the only one
  cached); None if there is none, or it is stale or damaged (`warn`: say so)."""
  prepared = _prepared_versions(name, data_dir)
  cached = _cached_versions(name, cache_dir)
  candidates = [v for v in cached if v in prepared] if prepared else (cached if len(cached) == 1 else [])
  if not candidates:
    return None
  folder = os.path.join(cache_dir, name, candidates[-1])
  try:
    arrays, meta = _read_cache(folder)
  except ValueError as e:
    if warn:
      logging.warning("decoded cache %s is stale or corrupt (%s); decoding the data set again",
                      folder, e)
    return None
  return _make(arrays, meta, {"load_s": time.monotonic() - t0, "source": "cache"})


# The cache and tfds helpers that other corpora (alma_jax.data.text) share.
write_cache = _write_cache
read_cache = _read_cache
prepared_versions = _prepared_versions
