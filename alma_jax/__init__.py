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

__version__ = "0.1.0"
__all__ = ["load_config", "run", "read_results"]


def load_config(spec: str):
  """The config that `--config=spec` gives: `NAME_OR_PATH[:VARIANT]`, e.g. `mnist_sm:quick`.

  Loaded as the command line loads it (`config_resolve.resolve`): its fields may be set, not
  added.

  Raises:
    ValueError: no such config file or name (the message lists the names), or a file that
      fails to load.
  """
  from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
  from alma_jax.configuration import config_resolve  # pylint: disable=g-import-not-at-top
  return config_resolve.resolve(config_files.resolve(spec))


def run(config, workdir: str, *, overwrite: bool = False) -> dict:
  """Runs (or resumes) one experiment in `workdir`; returns its summary.

  The same as the command line's run, without its process-level speed
  settings (allocator, XLA fusion flags), which must be set before JAX starts.
  See `alma_jax.core.run.run` for the errors it raises.
  """
  from alma_jax.core import run as run_lib  # pylint: disable=g-import-not-at-top
  return run_lib.run(config, workdir, overwrite=overwrite)


def read_results(workdir: str) -> list:
  """Each seed's outputs in `workdir`: `alma_jax.reports.report.Run` objects with
  `config`, `records` (the log, one dict per time step), `summary` (None until
  the run finishes) and `curve(field)`."""
  from alma_jax.reports import report  # pylint: disable=g-import-not-at-top
  return report.load_runs(workdir)
