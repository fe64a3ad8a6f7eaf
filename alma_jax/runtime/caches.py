"""Where runs keep what they can reuse, for every process of the project and its tests.

The cache folder (`default_cache_dir`: $ALMA_JAX_CACHE_DIR, else
~/.cache/alma_jax) holds decoded data sets, token caches and the speed
choices measured on this machine; the persistent compilation cache of XLA
programs (`compilation_cache_dir`) lives in its `xla` folder unless
--compilation_cache_dir or $ALMA_JAX_COMPILATION_CACHE_DIR names another
("none": no persistent cache). Every program is stored, however fast it
compiled, unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.
A run of `alma_jax.main` also keeps its whole compiled programs in that
folder's `alma_jax_programs` (`kept_programs_dir`), found again without
tracing by a later run of the same config, data and code.

A data set is decoded (or a corpus tokenised) into the cache by one process at a
time (`exclusive`): runs that start together on a fresh cache (a sweep's
parallel runs, a cluster's array job) wait for the first one's copy and read
it instead of each decoding, downloading or tokenising the data again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Callable, Iterator, TypeVar

from absl import logging

try:
  import fcntl
except ImportError:  # not a POSIX system: no locks
  fcntl = None

T = TypeVar("T")
# errno values of `fcntl.flock(..., LOCK_NB)`: another holds the lock, or the file system does
# not support flock (some network file systems; `alma_jax.outputs.workdir_lock` too).
FLOCK_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
FLOCK_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS,
                               errno.EINVAL})


def default_cache_dir() -> str:
  """The cache folder: $ALMA_JAX_CACHE_DIR, else $XDG_CACHE_HOME/alma_jax (~/.cache/alma_jax)."""
  if os.environ.get("ALMA_JAX_CACHE_DIR"):
    return os.environ["ALMA_JAX_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "alma_jax")


def compilation_cache_dir(chosen: str | None = None) -> str | None:
  """The persistent compilation cache's folder: `chosen` (a flag's value), else
  $ALMA_JAX_COMPILATION_CACHE_DIR, else `<cache folder>/xla`; None for "none"."""
  path = chosen or os.environ.get("ALMA_JAX_COMPILATION_CACHE_DIR")
  path = path or os.path.join(default_cache_dir(), "xla")
  return None if path.lower() == "none" else path


def check_compilation_cache_dir(chosen: str | None = None) -> None:
  """Raises ValueError, naming where the folder came from, when the persistent compilation
  cache's folder (`compilation_cache_dir(chosen)`) cannot serve: a file, or a folder that
  cannot be created or written (JAX would warn at every program instead)."""
  path = compilation_cache_dir(chosen)
  if path is None:
    return
  if chosen:
    where = f"--compilation_cache_dir={path}"
  elif os.environ.get("ALMA_JAX_COMPILATION_CACHE_DIR"):
    where = f"$ALMA_JAX_COMPILATION_CACHE_DIR={path}"
  elif os.environ.get("ALMA_JAX_CACHE_DIR"):
    where = f"the compilation cache {path} (of $ALMA_JAX_CACHE_DIR={default_cache_dir()})"
  else:
    where = f"the compilation cache {path}"
  hint = "; give a writable folder, or --compilation_cache_dir=none to run without the cache"
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{where} exists and is not a directory{hint}")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{where} cannot be created: {e.strerror or e}{hint}") from e
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"{where} is not writable{hint}")


def enable_compilation_cache(chosen: str | None = None) -> str | None:
  """Points this process's JAX at the persistent compilation cache (`compilation_cache_dir`);
  returns its folder (None: no persistent cache)."""
  import jax  # pylint: disable=g-import-not-at-top  (the folders above need no JAX)

  path = compilation_cache_dir(chosen)
  if path is None:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # the user's setting wins
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path


def kept_programs_dir() -> str | None:
  """Where runs keep whole compiled programs (`alma_jax.runtime.executables`): the folder
  `alma_jax_programs` of this process's persistent compilation cache (whose own entries are
  its files); None when it has none."""
  import jax  # pylint: disable=g-import-not-at-top

  path = jax.config.jax_compilation_cache_dir
  return os.path.join(path, "alma_jax_programs") if path else None


LOCKS = ".locks"  # the cache folder's folder of lock files (`lock_file`)


def lock_file(cache_dir: str, key: str) -> str:
  """The lock file of `key` (what one process at a time makes in `cache_dir`): in the cache
  folder's `.locks`, apart from the data, whose folders hold only what a load reads."""
  return os.path.join(cache_dir, LOCKS, f"{key}.lock")


@contextlib.contextmanager
def exclusive(path: str, what: str, poll_s: float = 0.2) -> Iterator[bool]:
  """The block runs while this process holds an exclusive lock (`flock`) on the file `path`,
  created if missing; another process in the same block meanwhile waits (saying so once, in
  the log, with `what`: what it waits for). The OS releases the lock of a process that dies.
  Where the file cannot be created or the file system has no `flock` (some network file
  systems), the block runs without a lock. Yields whether the lock is held."""
  fd = None
  if fcntl is not None:
    try:
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
                   | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError:  # a link or a folder there, or a read-only cache: unlocked
      fd = None
  waiting = False
  try:
    while fd is not None:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except OSError as e:
        if e.errno not in FLOCK_BUSY:  # no flock here: unlocked
          os.close(fd)
          fd = None
          break
      if not waiting:
        logging.info("waiting for %s in another process (lock %s)", what, path)
        waiting = True
      time.sleep(poll_s)  # in steps, so that a signal's handler runs
  except BaseException:
    if fd is not None:
      os.close(fd)
    raise
  try:
    yield fd is not None
  finally:
    if fd is not None:
      os.close(fd)  # releases the lock; the file stays, for the next process


def read_or_make(lock: str, what: str, read: Callable[[bool], T | None],
                 make: Callable[[], T]) -> T:
  """`read(warn)` of a cache, else `make()`, which fills it, by one process at a time: a
  process that finds no cache takes the lock file `lock` (`exclusive`; `what`: what the
  others wait for), reads again (another process may have filled it meanwhile; a damaged
  cache was reported by the first read: `warn` False) and makes it only if it is still
  missing."""
  found = read(True)
  if found is not None:
    return found
  with exclusive(lock, what):
    found = read(False)
    return make() if found is None else found
