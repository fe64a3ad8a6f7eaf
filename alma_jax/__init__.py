"""alma_jax: Anytime Learning at Macroscale in JAX/Flax.

The Python API, for notebooks and scripts (the command line is `alma-jax`,
i.e. `python -m alma_jax.main`):

  import alma_jax
  config = alma_jax.load_config("mnist_sm:quick")   # a name or a path, with a variant
  config.stream.wait = 2
  summary = alma_jax.run(config, "/tmp/mnist_sm")   # resumes when the folder holds this run
  for seed in alma_jax.read_results("/tmp/mnist_sm"):
    print(seed.summary["cer"], seed.curve("test_error")[-1])

Importing the package imports nothing heavy; each function imports what it
needs when first called.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"
__all__ = ["load_config", "run", "read_results"]


def load_config(spec: str):
  """The config that `--config=spec` gives: `NAME_OR_PATH[:VARIANT]`, e.g. `mnist_sm:quick`.

  Loaded as the command line loads it (`config_resolve.resolve`): its fields may be set, not
  added.

  Raises:
    ValueError: no such config file or name (the message lists the names), or a file that
      fails to load (the message names the config as `spec` gives it).
    TypeError: `spec` is not a string.
  """
  if not isinstance(spec, str):
    raise TypeError(f"load_config(spec): spec must be a config's name or path as a string, "
                    f"e.g. 'mnist_sm:quick'; got {type(spec).__name__} {spec!r}")
  from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top
  # Errors name the config as the caller did, not the file its name stands for.
  return config_resolve.resolve(config_files.resolve(spec), given=spec)


def run(config, workdir: str, *, overwrite: bool = False, log: bool = True) -> dict:
  """Runs (or resumes) one experiment in `workdir`; returns its summary.

  The same as the command line's run, without its process-level speed
  settings (allocator, XLA fusion flags), which must be set before JAX starts.
  Progress lines go to stderr as on the command line, unless the caller's
  logging already shows INFO messages (e.g. `logging.basicConfig(level=logging.INFO)`,
  or absl's flags parsed) or passes `log=False`. Errors name this function's arguments
  (`overwrite=True`, `workdir`, `config.<field>`) where the command line's
  name its flags; see `alma_jax.stream.run.run` for the errors it raises. `config` is a
  config (`load_config`, then edited) or the spec that `load_config` takes.
  """
  import contextlib  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import run as run_lib  # pylint: disable=g-import-not-at-top
  if isinstance(config, str):
    config = load_config(config)
  elif not isinstance(config, ml_collections.ConfigDict):
    raise TypeError(f"run(config, workdir): config must be a config (load_config's) or a "
                    f"config's name or path, e.g. 'mnist_sm:quick'; got {type(config).__name__}")
  workdir = _folder(workdir, "run(config, workdir)")
  with (_progress_to_stderr() if log else contextlib.nullcontext()):
    try:
      return run_lib.run(config, workdir, overwrite=overwrite)
    except Exception as e:  # pylint: disable=broad-except
      translated = _in_api_terms(e)
      if translated is None:
        raise
      raise translated from e


def _folder(workdir, call: str) -> str:
  """`workdir` as a string (a path object's text); a `TypeError` naming `call` otherwise."""
  if isinstance(workdir, os.PathLike):
    workdir = os.fspath(workdir)
  if not isinstance(workdir, str):
    raise TypeError(f"{call}: workdir must be a folder's path, a string or a path object, "
                    f"e.g. '/tmp/mnist_sm'; got {type(workdir).__name__} {workdir!r}")
  return workdir


# The command line's words for the arguments of `run`, in the order they are replaced.
_API_TERMS = (("pass --overwrite", "pass overwrite=True"), ("--overwrite", "overwrite=True"),
              ("--workdirs:", "workdir:"),
              ("another --workdir", "another workdir"), ("--workdir", "workdir"),
              ("--config.", "config."))


def _in_api_terms(e: Exception) -> Exception | None:
  """`e` again with its message in this API's terms (None: nothing to translate)."""
  if len(e.args) != 1 or not isinstance(e.args[0], str):
    return None
  text = e.args[0]
  for cli, api in _API_TERMS:
    text = text.replace(cli, api)
  if text == e.args[0]:
    return None
  try:
    return type(e)(text)
  except Exception:  # pylint: disable=broad-except  (an exception class with other arguments)
    return None


def _progress_to_stderr():
  """A context in which the run's progress lines (absl INFO) reach stderr, when the caller's
  logging would drop them (Python's default: WARNING and above)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  if flags.FLAGS.is_parsed() or absl_logging.get_absl_logger().isEnabledFor(py_logging.INFO):
    return contextlib.nullcontext()  # the caller's logging shows INFO: it is theirs to format

  @contextlib.contextmanager
  def scope():
    logger = absl_logging.get_absl_logger()
    handler = py_logging.StreamHandler(sys.stderr)
    handler.setFormatter(py_logging.Formatter("%(message)s"))
    before = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(py_logging.INFO)
    logger.propagate = False
    try:
      yield
    finally:
      logger.removeHandler(handler)
      logger.setLevel(before[0])
      logger.propagate = before[1]

  return scope()


def read_results(workdir: str) -> list:
  """Each seed's outputs in `workdir`: `alma_jax.reports.report.Run` objects with
  `config`, `records` (the log, one dict per time step), `summary` (None until
  the run finishes) and `curve(field)`."""
  from alma_jax.reports import report  # pylint: disable=g-import-not-at-top
  workdir = _folder(workdir, "read_results(workdir)")
  try:
    return report.load_runs(workdir)
  except report.ReportError as e:
    translated = _in_api_terms(e)
    if translated is None:
      raise
    raise translated from e
