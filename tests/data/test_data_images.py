"""Tests of the tfds loader and its decoded-data cache (alma_jax/data/images.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from alma_jax.data import images
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT


@pytest.fixture(scope="module")
def mnist_fresh(tmp_path_factory):
  """A fresh tfds load (which also fills a private cache)."""
  cache = str(tmp_path_factory.mktemp("cache"))
  ds = images.load_image_dataset("mnist", cache_dir=cache)
  assert ds.timings["source"] == "tfds"
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
  # The rebuild decodes from tfds; the fixture already checked a real decode, so
  # this one is replaced by the fixture's arrays to keep the test fast.
  calls = []

  def decode(name, data_dir, download="no"):
    del data_dir, download
    calls.append(name)
    arrays = {f: getattr(fresh, f) for f in ("train_x", "train_y", "test_x", "test_y")}
    info = {"name": "mnist", "version": os.path.basename(folder), "num_classes": 10,
            "mean": fresh.mean.tolist(), "std": fresh.std.tolist()}
    return arrays, info

  monkeypatch.setattr(images, "_load_tfds", decode)
  ds = images.load_image_dataset("mnist", cache_dir=copy)
  assert calls == ["mnist"] and ds.timings["source"] == "tfds"
  assert_same(fresh, ds)
  again = images.load_image_dataset("mnist", cache_dir=copy)
  assert again.timings["source"] == "cache"


@requires_mnist
def test_warm_cache_does_not_import_tensorflow(mnist_fresh):
  _, cache = mnist_fresh
  code = ("import sys; from alma_jax.data import images; "
          f"ds = images.load_image_dataset('mnist', cache_dir={cache!r}); "
          "assert ds.timings['source'] == 'cache'; "
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; print('ok')")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "ok"


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
  with tfds.testing.mock_data(num_examples=12):
    ds = images.load_image_dataset("cifar10", cache_dir=str(tmp_path), use_cache=False,
                                    download="yes")  # mock_data fakes the download
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
