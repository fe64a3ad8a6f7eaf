"""The run's error types and how the command line reports them.

Invalid inputs (config, data, workdir, checkpoints) are `ValueError`s and end
a command-line run with exit code 2; failures while running (a diverged
stage, an unexpected exception) end it with exit code 1.
"""

from __future__ import annotations

import ast


class ConfigError(ValueError):
  """An invalid config field, input or output location."""


class DivergenceError(RuntimeError):
  """A non-finite loss or parameter appeared during training."""


def divergence_error(t: int, epoch: int, where: str = "") -> DivergenceError:
  """The error of a stage whose loss or parameters became non-finite."""
  return DivergenceError(f"stage t={t} epoch {epoch}{where}: non-finite training loss or "
                         "parameters; rerun the same command with "
                         "--config.train.on_divergence=rollback to resume from the last checkpoint "
                         "(each diverging stage then keeps its best epoch and the run goes on)")


def _plain(exc: BaseException) -> bool:
  """Errors whose message says all (invalid inputs, divergence, a full disk)."""
  return isinstance(exc, (ValueError, DivergenceError)) or getattr(exc, "plain_message", False)


def one_line(exc: BaseException) -> str:
  """A readable single line for `exc` (type name added for unexpected errors)."""
  msg = " ".join(str(exc).split())
  if _plain(exc):
    return msg or type(exc).__name__
  return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def exit_code(exc: BaseException) -> int:
  """2 for invalid inputs (config, data, workdir, checkpoints), 1 for runtime failures."""
  return 2 if isinstance(exc, ValueError) else 1


def cli_error(exc: BaseException) -> tuple[str, int]:
  """(one-line message, exit code) for an exception that ends a command-line run."""
  msg = one_line(exc)
  if not _plain(exc):
    msg += " (rerun with --debug for the traceback)"
  return msg, exit_code(exc)


def flag_error(exc: BaseException) -> str:
  """The gist of a flag or config-file error: one line, no traceback."""
  text = str(exc)
  if text[:1] in "'\"":  # a quoted message (a KeyError inside an AttributeError)
    try:
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      pass
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  if any(l.startswith("Traceback") for l in lines):
    lines = lines[:1] + lines[-1:]
  return " ".join(lines)
