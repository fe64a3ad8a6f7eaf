"""The run's error types and how the command line reports them.

Invalid inputs (config, data, workdir, checkpoints) are `ValueError`s and end
a command-line run with exit code 2; failures while running (a diverged
stage, an unexpected exception) end it with exit code 1.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import traceback
from typing import Any, Callable, Sequence


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


# absl's flags that print help and end the process (with exit code 1) as they are parsed, with
# one dash or two, as absl takes every flag.
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def asks_help(argv: Sequence[str]) -> bool:
  """Whether the arguments `argv[1:]` hold one of absl's help flags."""
  return any(a.startswith("-") and a.split("=", 1)[0].lstrip("-") in _HELP_FLAGS
             for a in argv[1:])


def help_succeeds(parse: Callable[[Sequence[str]], Any], argv: Sequence[str]) -> Any:
  """`parse(argv)` (absl's flag parse), where a help flag that printed what was asked ends the
  process with exit code 0, not absl's 1: asking for help is not a failure."""
  try:
    return parse(argv)
  except SystemExit as e:
    if e.code == 1 and asks_help(argv):
      sys.exit(0)
    raise


# absl's words around an error raised while a config file loads (e.g. an unknown variant):
# "flag --config=<arg>: Error whilst parsing config file: ValueError: <the error>".
_CONFIG_FILE_WORDS = re.compile(r"^flag --\w+=.*?: Error whilst parsing config file: "
                                r"(?:ValueError: )?")


def flag_error(exc: BaseException) -> str:
  """The gist of a flag or config-file error: one line, no traceback (for a config file that
  raised while loading, the error it raised, without absl's words around it)."""
  text = str(exc)
  if text[:1] in "'\"":  # a quoted message (a KeyError inside an AttributeError)
    try:
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      pass
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  if any(l.startswith("Traceback") for l in lines):
    lines = lines[:1] + lines[-1:]
  return _CONFIG_FILE_WORDS.sub("", " ".join(lines), count=1)


def located(exc: BaseException, path: str) -> str | None:
  """`<path>, line <n>: <what went wrong>` for an exception raised while the Python file `path`
  (a config or grid file) was compiled or run: a syntax error in it, or an exception raised
  by its code (the last line of `path` in the traceback; a `ValueError` raised deeper, by a
  library it calls, names itself and is left out); None when `path` is not where it arose.
  The exception's causes and contexts are searched too (a flag parser may wrap it)."""
  if not path:
    return None
  target = os.path.realpath(path)

  def here(filename) -> bool:
    return bool(filename) and os.path.realpath(filename) == target

  seen, e = set(), exc
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, SyntaxError) and here(e.filename):
      return (f"{path}, line {e.lineno}: {type(e).__name__}: {e.msg} (a config or grid file "
              "is Python source)")
    line, innermost = None, False
    for frame, lineno in traceback.walk_tb(e.__traceback__):
      innermost = here(frame.f_code.co_filename)
      if innermost:
        line = lineno
    # A library's own error with a message for the user (an unknown variant) speaks for itself.
    if line is not None and (innermost or not _plain(e)):
      return f"{path}, line {line}: {one_line(e)}"
    e = e.__cause__ or e.__context__
  return None


def program(argv0: str) -> list[str]:
  """How a process whose `sys.argv[0]` is `argv0` was started: `python -m alma_jax.main` (also
  when run through `runpy` as `alma_jax.main`), `python -m <package>`, or its script's name
  (`alma-jax`)."""
  if argv0.endswith(os.path.join("alma_jax", "main.py")) or argv0 == "alma_jax.main":
    return ["python", "-m", "alma_jax.main"]
  if os.path.basename(argv0) == "__main__.py":  # python -m <package>
    return ["python", "-m", os.path.basename(os.path.dirname(argv0))]
  return [os.path.basename(argv0)]
