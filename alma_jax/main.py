"""Entry point: `python -m alma_jax.main --config=configs/mnist_sm.py --workdir=DIR`.

Fields of the config are overridden on the command line, e.g.
`--config.stream.wait=5 --config.model.width=16`. Rerunning the same command
resumes the run in DIR; `--overwrite` starts it afresh. Errors are one line on
stderr, exit code 2 for invalid inputs (config, data, workdir, checkpoints, a
JAX_PLATFORMS whose backend cannot start), 1 for failures while running, 128 +
signal number after SIGINT/SIGTERM/SIGHUP (130 for Ctrl-C while starting);
`--debug` shows tracebacks. A multi-process run (`alma_jax.runtime.multihost`,
the launchers in `launch/`) runs this same command in every process.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys


def _exit_now(message: str, code: int, before_exit=None):
  """Prints `message` as the one-line error, calls `before_exit` (if given) and ends the
  process at once with `code`.

  For interruptions: native work that no exception stops (an XLA compilation
  in a thread of its own) would otherwise keep the exiting interpreter busy
  for minutes and then crash it. The run's outputs are complete and its
  workdir lock released by then; `os._exit` skips only the interpreter's
  clean-up.
  """
  print(f"alma_jax: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  _flush_output()
  if before_exit is not None:
    before_exit()
  os._exit(code)


def _flush_output() -> None:
  """Flushes stdout and stderr, as the interpreter does at exit (a closed stream is left)."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass


def _finished() -> None:
  """Ends the process of a run that finished, as a normal exit would but without the
  interpreter's teardown (freeing every module and the XLA client: about 0.3 s of a short
  run on a CPU). The run's outputs are written and closed, and its workdir lock released, by
  then; other threads are waited for, the exit handlers run and the streams are flushed as
  at a normal exit. Under a profiler or a tracer (cProfile, coverage, a debugger), which may
  write its results after the program returns, the process ends normally."""
  if sys.getprofile() is not None or sys.gettrace() is not None:
    return
  import atexit  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and not thread.daemon:
      thread.join()
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  _flush_output()
  os._exit(0)


# TensorFlow (which reads the data sets) says its C++ notices at INFO: warnings and errors only,
# unless the user chose a level. Its oneDNN notice (twice, on the first run that decodes a data
# set) ignores that level; TensorFlow only decodes images here (integers, no float arithmetic
# that oneDNN would change), so its oneDNN operations are off unless the user chose otherwise.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

try:  # Ctrl-C while the libraries load (seconds): one line, no traceback
  if __name__ == "__main__":  # the command line's process (the `alma-jax` script: `console`)
    from alma_jax.outputs import interrupts as _early  # pylint: disable=g-import-not-at-top
    _early.catch_early_sigint()
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  from alma_jax.tuning import cpu_tuning  # pylint: disable=g-import-not-at-top
  from alma_jax import errors  # pylint: disable=g-import-not-at-top
  from alma_jax.configuration import fields as F  # pylint: disable=g-import-not-at-top
  from alma_jax.runtime import caches  # pylint: disable=g-import-not-at-top
  from alma_jax.runtime import collector  # pylint: disable=g-import-not-at-top
  from alma_jax.runtime import multihost  # pylint: disable=g-import-not-at-top
except KeyboardInterrupt:
  if __name__ != "__main__":
    raise
  _exit_now("interrupted by SIGINT while starting, before the run; run the same command again "
            "to start it", 130)


def _flag_file_error(exc: BaseException) -> str:
  """The one line for a `--flagfile` that cannot be read."""
  return f"--flagfile: {' '.join(str(exc).replace('ERROR::', '').split())}"


try:  # the config flag reads the flag files of sys.argv as it is defined
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "The experiment: a config name (mnist_sm) or file (configs/mnist_sm.py), "
      "with variants after a colon (mnist_sm:quick).", lock_config=True)
except flags.Error as _e:
  print(f"alma_jax: error: {_flag_file_error(_e)}", file=sys.stderr, flush=True)
  sys.exit(2)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, log.jsonl, summary.json.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Discard a previous run's outputs in --workdir "
                               "(by default a run there is resumed).")
_DEBUG = flags.DEFINE_bool("debug", False, "Show tracebacks instead of one-line errors.")
_DISTRIBUTED = flags.DEFINE_bool("jax_distributed", False,
                                 "Call jax.distributed.initialize() (multi-process runs); also "
                                 "enabled by ALMA_JAX_DISTRIBUTED=1, config.mesh.distributed=yes "
                                 "or a cluster environment (see alma_jax/runtime/multihost.py).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0's "
                                   "coordinator (default: detected by JAX on SLURM, Open MPI, TPU)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes of a multi-process run "
                                      "(default: detected)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (default: detected)")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache_dir", None,
    "Persistent cache of compiled XLA programs, shared by runs (a sweep compiles each model "
    "once). Default: $ALMA_JAX_COMPILATION_CACHE_DIR, else <cache dir>/xla (the cache dir is "
    "$ALMA_JAX_CACHE_DIR or ~/.cache/alma_jax); 'none' turns it off.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Resolve and validate the config with "
                                   "its overrides, print it as the config.json a run of it "
                                   "writes, and exit (no --workdir needed).")
flags.mark_flags_as_required(["config"])
flags.register_validator("workdir", lambda v: v is not None or "--print_config" in sys.argv,
                         message="flag --workdir must have a value (or give --print_config)")
_OWN_FLAGS = (_CONFIG, _WORKDIR, _OVERWRITE, _PRINT_CONFIG, _DEBUG, _COMPILATION_CACHE,
              _DISTRIBUTED, _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)
_HELP = ("--help", "-h", "--helpshort", "-?")


def help_text() -> str:
  """`--help`: what the command does, the config names with their variants, its own flags."""
  import textwrap  # pylint: disable=g-import-not-at-top
  from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
  from alma_jax.configuration import config_lib  # pylint: disable=g-import-not-at-top
  from alma_jax.configuration import plugins  # pylint: disable=g-import-not-at-top
  usage = ("usage: alma-jax --config=NAME[:VARIANT[,VARIANT]] --workdir=DIR "
           "[--config.<field>=VALUE ...]\n       (or python -m alma_jax.main with the same flags)\n"
           + "".join(f"       alma-jax {n} ...: {what}\n" for n, what in SUBCOMMANDS.items()))
  names = config_files.available()
  wrap = lambda text, indent="  ", more=None: textwrap.fill(  # pylint: disable=unnecessary-lambda-assignment
      text, 96, initial_indent=indent, subsequent_indent=indent if more is None else more)
  lines = [usage, "", __doc__.strip(), "",
           "Configs (a name, or the path of a config file):",
           wrap("  ".join(n for n in names if "/" not in n)),
           wrap("timing protocols: " + "  ".join(n for n in names if "/" in n)), "",
           "Variants (after a colon, several joined by commas):",
           wrap("image configs (mnist_*, cifar_*): " + ", ".join(plugins.tasks.IMAGE_VARIANTS)),
           wrap("language-model configs (lm_*): " + ", ".join(plugins.tasks.TEXT_VARIANTS)
                + ", Kx (K times the training steps per stage, e.g. 2x)"),
           wrap("timing protocols (bench/*): " + ", ".join(config_lib.PROTOCOL_VARIANTS)), "",
           "Flags:"]
  for holder in _OWN_FLAGS:
    flag = flags.FLAGS[holder.name]
    default = "" if flag.default in (None, False) else f" (default: {flag.default})"
    lines.append(wrap(f"--{holder.name}: {flag.help}{default}", "  ", "      "))
  lines += ["", wrap("Every config field is a flag too: --config.<field>=VALUE (docs/fields.md "
                     "lists them; --print_config shows a config's values). --helpfull lists the "
                     "flags of every library.", "")]
  return "\n".join(lines)


def _fail(message: str, code: int):
  print(f"alma_jax: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  sys.exit(code)


def _parse_flags(argv):
  if any(a in _HELP for a in argv[1:]):
    print(help_text())
    sys.exit(0)
  if not (errors.asks_help(argv) or any(a.startswith(("--flagfile", "-flagfile"))
                                        for a in argv[1:])):
    from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
    given = config_files.config_value(argv)
    if not given:  # None: no --config flag at all; "": an empty one
      _fail(f"--config is {'missing' if given is None else 'empty'}: give a config name or "
            "file, e.g. --config=mnist_sm:quick (alma-jax --help lists them)", 2)
  try:
    return errors.help_succeeds(flags.FLAGS, argv)
  except Exception as e:  # pylint: disable=broad-except
    if "--debug" in argv:
      raise
    config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
    where = errors.located(e, config_arg.partition(":")[0])
    if where is not None:  # the config file does not compile or raised
      _fail(f"--config={config_arg}: {where} (rerun with --debug for the traceback)", 2)
    if isinstance(e, flags.Error) and str(e).startswith("flag --config="):  # the file itself
      from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
      typed = config_files.config_value(_TYPED_ARGV) or config_arg
      _fail(f"--config={typed}: {errors.flag_error(e)}", 2)
    if isinstance(e, flags.Error):
      from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top
      typed = config_resolve.override_type_error(e)
      _fail(f"invalid --config override: {typed} (see --helpfull)" if typed else
            f"{errors.flag_error(e)} (see --helpfull)", 2)
    if not isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
      _fail(f"--config={config_arg}: {errors.flag_error(e)} (rerun with --debug for the "
            "traceback)", 2)
    from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top
    _fail(f"invalid --config override: "
          f"{config_resolve.override_error(config_arg, argv, e)} (see --helpfull)", 2)


def _check_config(multiprocess: bool) -> None:
  """Reports a config that loads but is invalid (its overrides contradicting each other, a
  field or rule broken, its data missing), a workdir that cannot be written, holds another
  config's run or is in use by a running process, before anything slow: before the speed
  settings, which may be measured for minutes. The checks that start JAX's backend come
  with the run's (except the mesh's fields against a CPU backend's devices, whose count is
  known before it starts), as do the outputs found in the workdir, and the lock that the
  run holds (here only tried, in a run of one process); a config that fails to load is
  reported later, with its file and line."""
  try:
    config = _CONFIG.value
    config.get("seed")
  except Exception:  # pylint: disable=broad-except
    return
  from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import validation  # pylint: disable=g-import-not-at-top
  try:
    config_resolve.check_overrides(sys.argv[1:])
  except ValueError as e:
    if _DEBUG.value:
      raise
    _fail(str(e), 2)
  from alma_jax.outputs import interrupts  # pylint: disable=g-import-not-at-top
  from alma_jax.outputs import workdir as wd  # pylint: disable=g-import-not-at-top
  from alma_jax.outputs import workdir_lock  # pylint: disable=g-import-not-at-top
  from alma_jax.tuning import cpu_fusion  # pylint: disable=g-import-not-at-top
  from alma_jax.tuning import tune  # pylint: disable=g-import-not-at-top
  try:
    with interrupts.Signals():  # a signal: one line and 128 + its number, as later
      devices = None if multiprocess else cpu_fusion.cpu_devices_expected()
      config = validation.validate(config, backend=False, devices=devices)
      if _WORKDIR.value is not None:  # given, as the flag's check asks: empty is refused here
        wd.check_writable(_WORKDIR.value)
        if not multiprocess:
          with workdir_lock.hold(_WORKDIR.value):
            pass
        if not _OVERWRITE.value:
          wd.check_resume(_WORKDIR.value, tune.resumed(config, _WORKDIR.value, log=False))
  except interrupts.RunInterrupted as e:
    _exit_now(f"interrupted by {signal.Signals(e.signum).name} while checking the config and "
              f"the workdir, before the run; to start it, run the same command again: "
              f"{_resume_command()}", e.exit_code)
  except Exception as e:  # pylint: disable=broad-except
    if _DEBUG.value:
      raise
    _fail(*errors.cli_error(e))


def _choose_cpu_fusion(multiprocess: bool) -> None:
  """Sets XLA_FLAGS for `config.train.cpu_fusion` (`alma_jax.tuning.tune.process_flags`); a
  config that fails to load is reported later, by the run."""
  from alma_jax.stream import validation  # pylint: disable=g-import-not-at-top
  from alma_jax.tuning import tune  # pylint: disable=g-import-not-at-top
  try:
    config = _CONFIG.value
    shapes = validation.KNOWN_SHAPES.get(config.data.name)
  except Exception:  # pylint: disable=broad-except
    return
  from alma_jax.outputs import interrupts  # pylint: disable=g-import-not-at-top
  try:
    with interrupts.Signals():  # a measuring child is killed, and the run says how to restart
      tune.process_flags(config, None if _OVERWRITE.value else _WORKDIR.value, shapes=shapes,
                         multiprocess=multiprocess, debug=_DEBUG.value)
  except interrupts.RunInterrupted as e:
    _exit_now(f"interrupted by {signal.Signals(e.signum).name} while measuring the speed "
              f"settings, before the run; to start it, run the same command again: "
              f"{_resume_command()}", e.exit_code)


def _resume_command() -> str:
  """The command that resumes this run: this one without --overwrite, or the command of the
  launcher that started this process ($ALMA_JAX_RESUME_COMMAND)."""
  launcher = os.environ.get("ALMA_JAX_RESUME_COMMAND")
  if launcher:
    return launcher
  typed = _TYPED_ARGV or sys.argv  # nothing imported: a Ctrl-C may have cut an import short
  args = [a for a in typed[1:] if not a.lstrip("-").startswith("overwrite")]
  return shlex.join(errors.program(typed[0]) + args)


# The command line as the user typed it (a config's name, not the file it names), for the
# resume hint; set by `console`.
_TYPED_ARGV: list[str] = []


def _read_flag_files(argv: list[str]) -> list[str]:
  """`argv` with every `--flagfile=FILE` replaced by the flags that FILE holds, as absl reads
  them, so that a config name given in a flag file is resolved as one typed is."""
  if not any(a.startswith(("--flagfile", "-flagfile")) for a in argv[1:]):
    return argv
  try:
    return argv[:1] + flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error as e:
    _fail(_flag_file_error(e), 2)


def _print_config() -> None:
  """`--print_config`: the resolved, validated config as JSON on stdout."""
  import json  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import validation  # pylint: disable=g-import-not-at-top
  from alma_jax.outputs import workdir as wd  # pylint: disable=g-import-not-at-top
  try:
    config = validation.validate(_CONFIG.value)
  except Exception as e:  # pylint: disable=broad-except
    if _DEBUG.value:
      raise
    _fail(*errors.cli_error(e))
  print(json.dumps(wd.config_dict(config), indent=2, sort_keys=True))


def _plain_logging() -> None:
  """Plain log lines, the libraries' INFO notices left out (`alma_jax.outputs.log_lines`)."""
  from alma_jax.outputs import log_lines  # pylint: disable=g-import-not-at-top
  log_lines.plain(debug=_DEBUG.value)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {argv[1:]}", 2)
  collector.pace()  # tracing-heavy from here on
  _plain_logging()
  if _PRINT_CONFIG.value:
    _print_config()
    return
  import jax  # pylint: disable=g-import-not-at-top
  try:
    setting = F.get(_CONFIG.value.mesh, "mesh.distributed")
  except Exception:  # pylint: disable=broad-except
    setting = "auto"  # a config that fails to load is reported below
  start, why = multihost.wanted(setting, _DISTRIBUTED.value)
  try:
    multihost.check_flags(start, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    caches.check_compilation_cache_dir(_COMPILATION_CACHE.value)
    cpu_tuning.check_env()
  except ValueError as e:
    _fail(str(e), 2)
  _check_config(multiprocess=start)
  _choose_cpu_fusion(multiprocess=start)  # before JAX starts its backend
  from alma_jax.outputs import interrupts  # pylint: disable=g-import-not-at-top
  if start:
    interrupts.hold_early()  # the processes stop together, at the run's first check
    logging.info("starting jax.distributed (%s)", why)
    try:
      multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    except Exception as e:  # pylint: disable=broad-except  (JAX's own errors: one line)
      if _DEBUG.value:
        raise
      _fail(f"jax.distributed.initialize() failed ({why}): {errors.one_line(e).rstrip('.')}; "
            "where JAX cannot detect the processes, give --coordinator_address, "
            "--num_processes and --process_id (docs/devices.md)", errors.exit_code(e))
  cache = caches.enable_compilation_cache(_COMPILATION_CACHE.value)
  try:
    backend = jax.default_backend()  # the first use of a device starts it
  except Exception as e:  # pylint: disable=broad-except  (a platform not here, a driver failing)
    if _DEBUG.value:
      raise
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:  # JAX's own errors here range from a RuntimeError to a bare AssertionError
      _fail(f"JAX cannot start the backend of JAX_PLATFORMS={platforms!r}: "
            f"{errors.one_line(e).rstrip('.')}; install JAX's build for it (README, Setup) or "
            "unset JAX_PLATFORMS to run on the devices that are here", 2)
    _fail(f"JAX cannot start its backend: {errors.one_line(e).rstrip('.')}", 1)
  logging.info("JAX %s, backend %s, process %d of %d, devices: %s; allocator tuned for XLA:CPU: "
               "%s; compilation cache: %s", jax.__version__, backend,
               jax.process_index(), jax.process_count(), jax.devices(), cpu_tuning.is_applied(),
               cache)
  from alma_jax.engine import timing  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import run  # pylint: disable=g-import-not-at-top
  try:
    config = _CONFIG.value
    config.get("seed")  # a config file that failed to load raises here
  except Exception as e:  # pylint: disable=broad-except
    if _DEBUG.value:
      raise
    config_arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), "")
    _fail(f"--config: {errors.located(e, config_arg.partition(':')[0]) or errors.flag_error(e)}",
          2)
  if jax.process_count() == 1:  # a signal during a long compile: out at once, not after it

    def stop_while_compiling(signum, last_checkpoint):
      e = interrupts.RunInterrupted(signum, last_checkpoint)
      _exit_now(f"{e} (during a compilation, not waited for); to resume, run the same command "
                f"again: {_resume_command()}", e.exit_code)

    interrupts.on_stop_while_compiling(stop_while_compiling)
  try:
    run.run(config, _WORKDIR.value, overwrite=_OVERWRITE.value, startup_s=timing.process_age_s(),
            keep_programs=True)
  except run.RunInterrupted as e:
    # Every process stopped at the same check, and they leave together (`multihost.leave`).
    # Each says why first: process 0 ends the coordination service as it exits, which aborts a
    # process that has not written its message yet.
    _exit_now(f"{e}; to resume, run the same command again: {_resume_command()}", e.exit_code,
              before_exit=multihost.leave)
  except Exception as e:  # pylint: disable=broad-except
    if _DEBUG.value:
      raise
    _fail(*errors.cli_error(e))
  _finished()


# `alma-jax sweep ...`, `alma-jax report ...` and the like: the sweep launcher and the reports'
# commands, from any folder and with the installed package alone.
SUBCOMMANDS = {"sweep": "run a grid of configs (launch/sweep.py; --help lists its flags)",
               "report": "the report of finished runs (alma_jax.reports.report; --helpshort)",
               "findings": "the verdicts on the paper's findings from a results.csv "
                           "(alma_jax.reports.findings; --help)",
               "rerun": "a grid's rerun against the results.csv it repeats "
                        "(alma_jax.reports.rerun; --help)"}
_SUBCOMMAND_MODULES = {"report": "alma_jax.reports.report",
                       "findings": "alma_jax.reports.findings", "rerun": "alma_jax.reports.rerun"}


def launch_dir() -> str | None:
  """The folder of the launchers: `alma_jax/launch` when installed from a wheel, else the
  checkout's top-level `launch/`."""
  package = os.path.dirname(os.path.abspath(__file__))
  for folder in (os.path.join(package, "launch"), os.path.join(os.path.dirname(package), "launch")):
    if os.path.isfile(os.path.join(folder, "sweep.py")):
      return folder
  return None


def _subcommand(name: str, args: list[str]) -> None:
  """Replaces this process by the subcommand `name` with `args`."""
  if name in _SUBCOMMAND_MODULES:
    cmd = [sys.executable, "-m", _SUBCOMMAND_MODULES[name], *args]
  else:
    folder = launch_dir()
    if folder is None:
      _fail("alma-jax sweep: the launchers are not installed with this copy of alma_jax (no "
            "launch/sweep.py beside the package)", 2)
    cmd = [sys.executable, os.path.join(folder, "sweep.py"), *args]
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, cmd)


def console():
  """The `alma-jax` command: this module's entry point, also taking configs by name.

  `--config=mnist_sm:quick` names `configs/mnist_sm.py:quick` (alma_jax.configuration.config_files).
  """
  if sys.argv[1:2] and sys.argv[1] in SUBCOMMANDS:
    _subcommand(sys.argv[1], sys.argv[2:])
  if sys.argv[1:2] and not sys.argv[1].startswith("-"):  # a word that names no command
    import difflib  # pylint: disable=g-import-not-at-top
    close = difflib.get_close_matches(sys.argv[1], SUBCOMMANDS, n=1)
    _fail(f"unknown command {sys.argv[1]!r}"
          + (f" (did you mean {close[0]!r}?)" if close else "")
          + f"; the commands: {', '.join(SUBCOMMANDS)}; a run takes flags only: alma-jax "
          "--config=NAME --workdir=DIR (--help lists them)", 2)
  from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top
  from alma_jax.outputs import interrupts  # pylint: disable=g-import-not-at-top
  interrupts.catch_early_sigint()  # until the run's own handlers
  _TYPED_ARGV[:] = sys.argv
  sys.argv = config_files.resolve_argv_or_exit(_read_flag_files(sys.argv))
  try:
    app.run(main, flags_parser=_parse_flags)
  except KeyboardInterrupt:  # outside the run's own handling (`alma_jax.outputs.interrupts`)
    if "--debug" in sys.argv:
      raise
    _exit_now(f"interrupted by SIGINT; to resume, run the same command again: "
              f"{_resume_command()}", 130)


if __name__ == "__main__":
  console()
