"""Tests of where runs keep their caches: the cache folder and the compilation cache in it."""

import os

import pytest

from alma_jax.runtime import caches


@pytest.fixture
def environ(monkeypatch):
  for name in ("ALMA_JAX_CACHE_DIR", "ALMA_JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", "/home/someone")
  return monkeypatch


def test_the_cache_folder_follows_the_environment(environ):
  assert caches.default_cache_dir() == "/home/someone/.cache/alma_jax"
  environ.setenv("XDG_CACHE_HOME", "/xdg")
  assert caches.default_cache_dir() == "/xdg/alma_jax"
  environ.setenv("ALMA_JAX_CACHE_DIR", "/alma")
  assert caches.default_cache_dir() == "/alma"


def test_the_compilation_cache_is_the_flag_then_its_variable_then_the_cache_folder(environ):
  environ.setenv("ALMA_JAX_CACHE_DIR", "/alma")
  assert caches.compilation_cache_dir() == os.path.join("/alma", "xla")
  environ.setenv("ALMA_JAX_COMPILATION_CACHE_DIR", "/compiled")
  assert caches.compilation_cache_dir() == "/compiled"
  assert caches.compilation_cache_dir("/flag") == "/flag"
  assert caches.compilation_cache_dir("none") is None
  assert caches.compilation_cache_dir("None") is None
  environ.setenv("ALMA_JAX_COMPILATION_CACHE_DIR", "none")
  assert caches.compilation_cache_dir() is None
