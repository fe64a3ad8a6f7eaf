"""Runs from the caches alone: offline, without the tfds copy and without the BPE files
(alma_jax/data/text.py, alma_jax/data/images.py, the tasks' `check_available`)."""

import os

from alma_jax.core import run as run_lib
from alma_jax.data import images
from alma_jax.data import text as text_data
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
  monkeypatch.setattr(images, "_load_tfds", refuse)
  monkeypatch.setattr(text_data, "_tfds_text", refuse)


@requires_text
def test_a_text_run_starts_offline_from_its_token_cache_alone(tmp_path, monkeypatch):
  c = text_smoke(data__cache_dir=str(tmp_path / "cache"), data__bpe_dir=BPE_DIR)
  run_lib.run(c, str(tmp_path / "online"))  # tokenises and writes the token cache
  expected = helpers.outputs(str(tmp_path / "online"))
  empty = _offline(monkeypatch, tmp_path)
  _no_tfds(monkeypatch)
  c = text_smoke(data__cache_dir=str(tmp_path / "cache"), data__bpe_dir="", data__data_dir=empty)
  run_lib.run(c, str(tmp_path / "offline"))
  assert helpers.outputs(str(tmp_path / "offline")) == expected
  # Without the cache, the error names what is missing, as before.
  c.data.cache_dir = str(tmp_path / "other_cache")
  try:
    run_lib.run(c, str(tmp_path / "none"))
  except ValueError as e:
    assert "config.data.bpe_dir is not set" in str(e)
  else:
    raise AssertionError("ran without a cache, the BPE files or the data")


@requires_mnist
def test_an_image_run_starts_offline_from_its_decoded_cache_alone(tmp_path, monkeypatch):
  c = helpers.smoke(data__cache_dir=str(tmp_path / "cache"))
  run_lib.run(c, str(tmp_path / "online"))  # decodes and writes the cache
  expected = helpers.outputs(str(tmp_path / "online"))
  empty = _offline(monkeypatch, tmp_path)
  _no_tfds(monkeypatch)
  c = helpers.smoke(data__cache_dir=str(tmp_path / "cache"), data__data_dir=empty)
  run_lib.run(c, str(tmp_path / "offline"))
  assert helpers.outputs(str(tmp_path / "offline")) == expected
  assert os.listdir(empty) == []
