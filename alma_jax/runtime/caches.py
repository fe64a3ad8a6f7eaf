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
"""

from __future__ import annotations

import os


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
