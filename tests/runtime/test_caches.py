"""Tests of where runs keep their caches: the cache folder, the compilation cache in it, and the
locks that let one process at a time fill it."""

import errno
import logging
import os
import threading
import time

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


# -- one process at a time -------------------------------------------------------------------------
# Each `exclusive` opens the lock file anew, and flock locks belong to an open file, so two
# threads of one process exclude each other as two processes do.
def test_exclusive_lets_one_holder_in_at_a_time_and_the_other_waits(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  path = str(tmp_path / "sub" / "x.lock")  # its folder is made
  inside, order = threading.Event(), []

  def first():
    with caches.exclusive(path, "the first") as held:
      order.append(("first in", held))
      inside.set()
      time.sleep(0.6)
      order.append(("first out", held))

  thread = threading.Thread(target=first)
  thread.start()
  inside.wait(10)
  with caches.exclusive(path, "the decoding of x", poll_s=0.05) as held:
    order.append(("second in", held))
  thread.join()
  assert order == [("first in", True), ("first out", True), ("second in", True)]
  waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
  assert waits == [f"waiting for the decoding of x in another process (lock {path})"]
  assert os.path.isfile(path)  # left for the next process


def test_exclusive_runs_unlocked_where_the_file_system_has_no_flock(tmp_path, monkeypatch):
  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(caches.fcntl, "flock", no_flock)
  ran = []
  with caches.exclusive(str(tmp_path / "x.lock"), "x") as held:
    ran.append(held)
  assert ran == [False]


def test_exclusive_runs_unlocked_where_the_lock_file_cannot_be_made(tmp_path):
  (tmp_path / "file").write_text("")
  ran = []
  with caches.exclusive(str(tmp_path / "file" / "x.lock"), "x") as held:  # a file as folder
    ran.append(held)
  assert ran == [False]


def test_an_error_in_the_block_releases_the_lock(tmp_path):
  path = str(tmp_path / "x.lock")
  with pytest.raises(RuntimeError, match="boom"):
    with caches.exclusive(path, "x"):
      raise RuntimeError("boom")
  with caches.exclusive(path, "x", poll_s=60.0) as held:  # would wait a minute if still held
    assert held


def test_a_compilation_cache_folder_that_cannot_serve_is_refused_by_where_it_came_from(
    tmp_path, monkeypatch):
  monkeypatch.delenv("ALMA_JAX_COMPILATION_CACHE_DIR", raising=False)
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match=rf"^--compilation_cache_dir={blocker} exists and is not "
                                       "a directory; give a writable folder, or "
                                       "--compilation_cache_dir=none to run without the cache$"):
    caches.check_compilation_cache_dir(str(blocker))
  with pytest.raises(ValueError, match=rf"^--compilation_cache_dir={blocker}/xla cannot be "
                                       "created: Not a directory;"):
    caches.check_compilation_cache_dir(f"{blocker}/xla")
  monkeypatch.setenv("ALMA_JAX_COMPILATION_CACHE_DIR", str(blocker))
  with pytest.raises(ValueError, match=r"^\$ALMA_JAX_COMPILATION_CACHE_DIR=.* exists and is not"):
    caches.check_compilation_cache_dir()
  monkeypatch.delenv("ALMA_JAX_COMPILATION_CACHE_DIR")
  monkeypatch.setenv("ALMA_JAX_CACHE_DIR", str(blocker))
  with pytest.raises(ValueError, match=rf"^the compilation cache {blocker}/xla \(of "
                                       rf"\$ALMA_JAX_CACHE_DIR={blocker}\) cannot be created"):
    caches.check_compilation_cache_dir()
  caches.check_compilation_cache_dir(str(tmp_path / "new" / "xla"))  # made
  assert (tmp_path / "new" / "xla").is_dir()
  caches.check_compilation_cache_dir("none")
