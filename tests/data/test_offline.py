"""Runs from the caches alone: offline, without the tfds copy and without the BPE files
(alma_jax/data/text.py, alma_jax/data/images.py, the tasks' `check_available`)."""

import os

import pytest

from alma_jax import tasks
from alma_jax.data import images
from alma_jax.data import text as text_data
from alma_jax.errors import ConfigError
from alma_jax.stream import run_setup
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import BPE_DIR, requires_mnist, requires_text
from tests.data.test_text import smoke as text_smoke


def _offline(monkeypatch, tmp_path):
  """No internet, no tfds copy, no BPE folder and an empty tiktoken cache."""
  monkeypatch.setattr(images, "internet_reachable", lambda *a, **k: False)
  empty = tmp_path / "nothing"
  empty.mkdir(exist_ok=True)
  monkeypatch.setenv("TFDS_DATA_DIR", str(empty))
  monkeypatch.delenv(text_data.BPE_DIR_ENV, raising=False)
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(empty))
  return str(empty)


def _no_tfds(monkeypatch):
  """Makes a tfds read fail the test: the caches must serve."""
  def refuse(*a, **k):
    raise AssertionError("read tfds")
  monkeypatch.setattr(images, "_decode", refuse)
  monkeypatch.setattr(text_data, "_tfds_text", refuse)


def _inputs(c) -> str:
  """A config's validation (which checks its data is available), then the fingerprint of the
  data its run would read (`run_setup.fingerprint`: the arrays on the device)."""
  c = validation.validate(c)
  task = tasks.for_config(c)
  ds, _ = task.load(c, [0])
  return run_setup.fingerprint(task.device_data(ds))


@requires_text
def test_a_text_run_starts_offline_from_its_token_cache_alone(tmp_path, monkeypatch):
  c = text_smoke(data__cache_dir=str(tmp_path / "cache"), data__bpe_dir=BPE_DIR)
  online = _inputs(c)  # tokenises and writes the token cache
  empty = _offline(monkeypatch, tmp_path)
  _no_tfds(monkeypatch)
  c = text_smoke(data__cache_dir=str(tmp_path / "cache"), data__bpe_dir="", data__data_dir=empty)
  assert _inputs(c) == online
  # Without the cache, the error names what is missing and where the cache was looked for.
  c.data.cache_dir = str(tmp_path / "other_cache")
  with pytest.raises(ConfigError, match=r"config\.data\.bpe_dir is not set.*; nor is there a "
                     r"token cache to run from \(.*other_cache/text\)"):
    validation.validate(c)


@requires_mnist
def test_an_image_run_starts_offline_from_its_decoded_cache_alone(tmp_path, monkeypatch):
  c = helpers.smoke(data__cache_dir=str(tmp_path / "cache"))
  online = _inputs(c)  # decodes and writes the cache
  empty = _offline(monkeypatch, tmp_path)
  _no_tfds(monkeypatch)
  c = helpers.smoke(data__cache_dir=str(tmp_path / "cache"), data__data_dir=empty)
  assert _inputs(c) == online
  assert os.listdir(empty) == []
