"""Plain log lines for the command-line programs (the run, the report).

absl's default prefix (level, date, time, thread, source line) on every line
hides the message; the libraries' INFO notices (JAX's "Unable to initialize
backend" for each plugin it does not find) are noise to a user. `plain()`
writes the message alone at INFO, `warning: ` or `error: ` before it above,
and leaves the libraries' notices out below WARNING.
"""

from __future__ import annotations

import logging as py_logging

from absl import logging

QUIET_LIBRARIES = ("jax", "jaxlib", "tensorflow", "tensorflow_datasets", "orbax")


class PlainFormatter(logging.PythonFormatter):
  """The message alone at INFO, `warning: ` or `error: ` before it above."""

  def format(self, record) -> str:
    text = record.getMessage()
    if record.exc_info:
      text += "\n" + self.formatException(record.exc_info)
    if record.levelno >= py_logging.ERROR:
      return f"error: {text}"
    return f"warning: {text}" if record.levelno >= py_logging.WARNING else text


def plain(debug: bool = False) -> None:
  """Plain lines on absl's handler (absl's own format with `debug`); the libraries' notices at
  WARNING and above only (unless a level was set for them)."""
  if not debug:
    logging.get_absl_handler().setFormatter(PlainFormatter())
  for name in QUIET_LIBRARIES:
    if py_logging.getLogger(name).level == py_logging.NOTSET:
      py_logging.getLogger(name).setLevel(py_logging.WARNING)
