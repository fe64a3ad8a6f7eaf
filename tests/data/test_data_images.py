"""Tests of the tfds loader and its decoded-data cache (alma_jax/data/images.py)."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from alma_jax.data import images
from tests import helpers
from tests.conftest import requires_cifar10, requires_mnist

ROOT = helpers.ROOT


@pytest.fixture(scope="module")
def mnist_fresh(tmp_path_factory):
  """A fresh decode of the prepared files (which also fills a private cache)."""
  cache = str(tmp_path_factory.mktemp("cache"))
  ds = images.load_image_dataset("mnist", cache_dir=cache)
  assert ds.timings["source"] == "prepared files"
  return ds, cache


def assert_same(a, b):
  for f in ("train_x", "train_y", "test_x", "test_y", "mean", "std"):
    np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)))
  assert a.num_classes == b.num_classes


@requires_mnist
def test_cache_round_trips_exactly(mnist_fresh):
  fresh, cache = mnist_fresh
  warm = images.load_image_dataset("mnist", cache_dir=cache)
  assert warm.timings["source"] == "cache"
  assert_same(fresh, warm)
  assert fresh.train_x.dtype == np.uint8 and fresh.train_y.dtype == np.int32
  assert fresh.train_x.shape == (60000, 28, 28, 1) and fresh.test_x.shape == (10000, 28, 28, 1)


@requires_mnist
def test_mean_and_std_are_mnist_values(mnist_fresh):
  ds, _ = mnist_fresh
  assert ds.mean.shape == (1,) and ds.std.shape == (1,)
  assert ds.mean[0] == pytest.approx(0.1307, abs=1e-3)
  assert ds.std[0] == pytest.approx(0.3081, abs=1e-3)


@pytest.mark.parametrize("shape", [(5, 7, 3), (4, 6, 6, 1), (3, 2)])
def test_channel_statistics_are_those_of_the_exact_sums(shape):
  """The mean is the float64 nearest the exact mean; the standard deviation is the square
  root of the float64 nearest the exact variance, so within one ulp of the exact one
  (rounding the variance, a relative 2**-53 at most, moves its root by at most half an ulp;
  rounding the root, by at most another half). Counting in chunks of any size changes
  nothing."""
  import decimal  # pylint: disable=g-import-not-at-top
  from fractions import Fraction  # pylint: disable=g-import-not-at-top

  x = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
  x.reshape(-1, shape[-1])[:2] = [[0] * shape[-1], [255] * shape[-1]]  # both ends present
  mean, std = images.channel_stats(x)
  assert (mean, std) == images.channel_stats(x, chunk=3)
  pixels = x.reshape(-1, shape[-1])
  n = pixels.shape[0]
  for c in range(shape[-1]):
    values = [int(v) for v in pixels[:, c]]
    exact_mean = Fraction(sum(values), 255 * n)
    assert mean[c] == float(exact_mean)
    variance = sum((Fraction(v, 255) - exact_mean) ** 2 for v in values) / n
    with decimal.localcontext(prec=60):
      root = (decimal.Decimal(variance.numerator) / variance.denominator).sqrt()
      assert abs(decimal.Decimal(std[c]) - root) <= decimal.Decimal(float(np.spacing(std[c])))
  with pytest.raises(ValueError, match="uint8"):
    images.channel_stats(x.astype(np.float32))


@requires_mnist
@pytest.mark.parametrize("damage", ["flip", "truncate", "meta"])
def test_corrupt_cache_is_detected_and_rebuilt(mnist_fresh, tmp_path, monkeypatch, damage):
  fresh, cache = mnist_fresh
  import shutil
  copy = str(tmp_path / "cache")
  shutil.copytree(cache, copy)
  folder = os.path.join(copy, "mnist", os.listdir(os.path.join(copy, "mnist"))[0])
  path = os.path.join(folder, "train_x.npy")
  if damage == "flip":
    with open(path, "r+b") as f:
      f.seek(1000)
      chunk = f.read(1)
      f.seek(1000)
      f.write(bytes([chunk[0] ^ 0xFF]))
  elif damage == "truncate":
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  else:
    with open(os.path.join(folder, "meta.json"), "w") as f:
      f.write("{not json")
  # The rebuild decodes the data set; the fixture already checked a real decode, so
  # this one is replaced by the fixture's arrays to keep the test fast.
  calls = []

  def decode(name, data_dir, download="no"):
    del data_dir, download
    calls.append(name)
    arrays = {f: getattr(fresh, f) for f in ("train_x", "train_y", "test_x", "test_y")}
    info = {"name": "mnist", "version": os.path.basename(folder), "num_classes": 10,
            "mean": fresh.mean.tolist(), "std": fresh.std.tolist()}
    return arrays, info, "decoded"

  monkeypatch.setattr(images, "_decode", decode)
  ds = images.load_image_dataset("mnist", cache_dir=copy)
  assert calls == ["mnist"] and ds.timings["source"] == "decoded"
  assert_same(fresh, ds)
  again = images.load_image_dataset("mnist", cache_dir=copy)
  assert again.timings["source"] == "cache"


def _prepared_copy(tmp_path, edit=None, name="mnist", keep=None):
  """A copy of the prepared data set's folder whose dataset_info.json `edit` changes; with
  `keep` ({split: n}), each split's file holds its first n records (copied whole, with their
  checksums) and the description says so."""
  src = os.path.join(os.environ["TFDS_DATA_DIR"], name)
  version = os.listdir(src)[0]
  dst = tmp_path / "tfds" / name / version
  dst.mkdir(parents=True)
  for f in os.listdir(os.path.join(src, version)):
    os.symlink(os.path.join(src, version, f), dst / f)
  info = json.loads((dst / "dataset_info.json").read_text())
  for split in info["splits"] if keep else []:
    path = dst / f"{name}-{split['name']}.tfrecord-00000-of-00001"
    data, end = path.read_bytes(), 0
    for _ in range(keep[split["name"]]):
      end += 16 + int.from_bytes(data[end:end + 8], "little")
    path.unlink()
    path.write_bytes(data[:end])
    split.update(shardLengths=[str(keep[split["name"]])], numBytes=str(end))
  if edit:
    edit(info)
  (dst / "dataset_info.json").unlink()
  (dst / "dataset_info.json").write_text(json.dumps(info))
  return str(tmp_path / "tfds"), str(dst)


@requires_mnist
@requires_cifar10
@pytest.mark.parametrize("name", ["mnist", "cifar10"])  # grey and colour PNGs
def test_the_prepared_files_read_directly_are_the_arrays_tfds_decodes(tmp_path, name):
  data_dir, _ = _prepared_copy(tmp_path, name=name, keep={"train": 300, "test": 200})
  direct, info = images._read_prepared(name, data_dir)  # pylint: disable=protected-access
  decoded, tfds_info = images._load_tfds(name, data_dir, "no")  # pylint: disable=protected-access
  assert info == tfds_info and info["num_classes"] == 10
  for f, a in decoded.items():
    assert direct[f].dtype == a.dtype and direct[f].shape == a.shape
    np.testing.assert_array_equal(direct[f], a)
  assert len(direct["test_y"]) == 200 and len(set(direct["test_y"].tolist())) == 10


@requires_mnist
def test_neither_a_fresh_decode_nor_the_cache_imports_tensorflow(tmp_path):
  data_dir, _ = _prepared_copy(tmp_path, keep={"train": 100, "test": 50})
  load = f"images.load_image_dataset('mnist', data_dir={data_dir!r}, cache_dir={str(tmp_path)!r})"
  code = ("import sys; from alma_jax.data import images; "
          f"fresh = {load}; warm = {load}; "
          "print(fresh.timings['source'], warm.timings['source'], fresh.train_x.shape, sep=','); "
          "print(sorted(m for m in ('tensorflow', 'tensorflow_datasets') if m in sys.modules))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split("\n")[:2] == ["prepared files,cache,(100, 28, 28, 1)", "[]"]


@requires_mnist
@pytest.mark.parametrize("edit, reason", [
    (lambda i: i["splits"][0].update(shardLengths=["30000", "30000"]), "split 'train' has 2 files"),
    (lambda i: i.update(fileFormat="array_record"), "file format 'array_record'"),
    (lambda i: i["splits"][0].update(shardLengths=["59999"]), "holds 60000 examples, its "
     "description 59999"),
    (lambda i: i.update(supervisedKeys={}), "supervised keys []"),
], ids=["shards", "format", "count", "keys"])
def test_a_prepared_copy_not_read_directly_goes_to_tfds_and_says_why(tmp_path, monkeypatch, edit,
                                                                     reason):
  data_dir, _ = _prepared_copy(tmp_path, edit)
  with pytest.raises(images.NotDirect, match=re.escape(reason)):
    images._read_prepared("mnist", data_dir)  # pylint: disable=protected-access
  calls = []
  monkeypatch.setattr(images, "_load_tfds", lambda *a: calls.append(a) or ({}, {}))
  assert images._decode("mnist", data_dir, "no")[2] == "tfds"  # pylint: disable=protected-access
  assert calls == [("mnist", data_dir, "no")]


def test_missing_data_names_tfds_data_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "empty"))
  with pytest.raises(images.DatasetUnavailableError, match="TFDS_DATA_DIR") as e:
    images.load_image_dataset("mnist", data_dir=str(tmp_path / "empty"), cache_dir=str(tmp_path / "c"))
  assert "\n" not in str(e.value)
  assert str(tmp_path / "empty") in str(e.value)


def test_unknown_name_lists_valid_names(tmp_path):
  with pytest.raises(images.DatasetUnavailableError, match="config.data.name='not_a_dataset'"):
    images.load_image_dataset("not_a_dataset", data_dir=str(tmp_path), cache_dir=str(tmp_path / "c"))


def test_mock_data_goes_through_the_loader(tmp_path):
  # No prepared copy to read directly: tfds decodes (mock_data fakes its download and data).
  with tfds.testing.mock_data(num_examples=12):
    ds = images.load_image_dataset("cifar10", cache_dir=str(tmp_path), use_cache=False,
                                    data_dir=str(tmp_path / "none_prepared"), download="yes")
  assert ds.timings["source"] == "tfds"
  assert ds.train_x.shape == (12, 32, 32, 3) and ds.train_x.dtype == np.uint8
  assert ds.num_classes == 10 and ds.mean.shape == (3,)
  assert ((ds.train_y >= 0) & (ds.train_y < 10)).all()


def test_a_mistyped_name_gets_the_name_it_is_close_to(tmp_path):
  prepared = tmp_path / "tfds"
  (prepared / "my_digits" / "1.0.0").mkdir(parents=True)
  (prepared / "my_digits" / "1.0.0" / "dataset_info.json").write_text("{}")
  assert images.name_hint("mnsit") == "; did you mean 'mnist'?"
  assert images.name_hint("cifar_10") == "; did you mean 'cifar10'?"
  assert images.name_hint("my_digit", str(prepared)) == "; did you mean 'my_digits'?"
  assert images.name_hint("mnist") == images.name_hint("imagenet2012") == ""
  with pytest.raises(images.DatasetUnavailableError,
                     match=r"config\.data\.name='mnsit' is not a tfds data set .*; did you mean "
                     r"'mnist'\?$"):
    images.load_image_dataset("mnsit", data_dir=str(tmp_path), cache_dir=str(tmp_path / "c"),
                              download="no")


def test_loads_that_start_together_decode_a_data_set_once(tmp_path, monkeypatch):
  """Two loads on a fresh cache (a sweep's parallel runs): one decodes and writes the cache,
  the other waits for it and reads it. Threads stand for processes: each load opens the lock
  file anew, and flock locks belong to an open file."""
  rng = np.random.default_rng(0)
  arrays = {"train_x": rng.integers(0, 256, (20, 4, 4, 1), dtype=np.uint8),
            "train_y": rng.integers(0, 3, 20).astype(np.int32),
            "test_x": rng.integers(0, 256, (10, 4, 4, 1), dtype=np.uint8),
            "test_y": rng.integers(0, 3, 10).astype(np.int32)}
  calls = []

  def decode(name, data_dir, download):
    del data_dir, download
    calls.append(name)
    time.sleep(0.5)  # long enough for the other load to reach the lock
    return dict(arrays), images._info(name, "1.0.0", 3, arrays["train_x"]), "decoded"  # pylint: disable=protected-access

  monkeypatch.setattr(images, "_decode", decode)
  cache, results = str(tmp_path / "cache"), [None, None]

  def load(i):
    results[i] = images.load_image_dataset("tiny", data_dir=str(tmp_path / "none"),
                                           cache_dir=cache, download="no")

  threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert calls == ["tiny"]
  assert sorted(r.timings["source"] for r in results) == ["cache", "decoded"]
  assert_same(results[0], results[1])
  np.testing.assert_array_equal(results[0].train_x, arrays["train_x"])
  assert os.listdir(os.path.join(cache, "tiny")) == ["1.0.0"]  # the lock is apart
  assert os.listdir(os.path.join(cache, ".locks")) == ["decode_tiny.lock"]
