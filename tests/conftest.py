"""Test setup: 8 CPU devices (to exercise sharding), shared data, a private cache."""

import gc
import os
import shutil
import sys
import tempfile

# The suite's time goes to compiling small programs on a CPU, where XLA's optimisation passes
# cost more than they save; set before JAX is imported, and inherited by the runs the tests
# start as subprocesses. Export JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test optimised programs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# With those passes off, XLA:CPU's MLIR fusion emitters are most of what is left of a
# compile; its older emitters build the same programs in about half the time (measured on
# `configs/cifar_gmoe.py:smoke`, whose records were the same either way). Not set when
# optimised programs are tested, nor over a choice in XLA_FLAGS.
# And XLA:CPU splits a program's LLVM module into parts to generate their code on several
# threads; the suite's workers already keep every core busy, so the parts only add their own
# overheads: with one part, four files of tests spent 8-28% less time in XLA's compiles
# (benchmarks/results/epyc25m1_2026-11-29/suite_codegen_split.txt). A run's optimised
# compiles, one program at a time, keep XLA's parts. Neither flag is set over a choice in
# XLA_FLAGS.
_TEST_FLAGS = {"--xla_cpu_use_fusion_emitters": "false",
               "--xla_cpu_parallel_codegen_split_count": "1"}
if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1":
  for _flag, _value in _TEST_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()

# Where the environment asks Python not to write bytecode (PYTHONDONTWRITEBYTECODE), every
# process the suite starts (hundreds of runs of `alma_jax.main`) would compile the package's
# sources again, about 0.15 s each; the controlling process writes their bytecode once, into
# the usual `__pycache__` folders (ignored by git). Python checks each file's source against
# it, so an edited file is compiled afresh as usual.
if sys.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
  import compileall  # pylint: disable=g-import-not-at-top
  for _package in ("alma_jax", "tests"):
    compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), _package), quiet=2)

import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_num_cpu_devices", 8)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHARED = os.path.join(os.path.dirname(_ROOT), "shared", "tensorflow_datasets")
if "TFDS_DATA_DIR" not in os.environ and os.path.isdir(_SHARED):
  os.environ["TFDS_DATA_DIR"] = _SHARED
_BPE = os.path.join(os.path.dirname(_ROOT), "shared", "gpt2_bpe")
if "ALMA_JAX_BPE_DIR" not in os.environ and os.path.isdir(_BPE):
  os.environ["ALMA_JAX_BPE_DIR"] = _BPE


def _session_cache_dir(run: str | None) -> str:
  """The test session's cache folder (decoded data, tuning choices, compiled programs): one
  for all of a parallel session's workers (named after its run), so that what one of them
  compiled the others load."""
  if not run:
    return tempfile.mkdtemp(prefix="alma_jax_test_cache_")
  path = os.path.join(tempfile.gettempdir(), f"alma_jax_test_cache_{run}")
  os.makedirs(path, exist_ok=True)
  return path


_OWN_CACHE = "ALMA_JAX_CACHE_DIR" not in os.environ  # removed at the end of the session
if _OWN_CACHE:
  os.environ["ALMA_JAX_CACHE_DIR"] = _session_cache_dir(os.environ.get("PYTEST_XDIST_TESTRUNUID"))
# In-process runs use the persistent compilation cache as `alma_jax.main` does for a process.
from alma_jax.runtime import caches  # pylint: disable=g-import-not-at-top

caches.enable_compilation_cache()
from alma_jax.runtime import collector  # pylint: disable=g-import-not-at-top

collector.pace()  # as a run's process does

import pytest  # pylint: disable=g-import-not-at-top

from tests import kill_points  # pylint: disable=g-import-not-at-top

kill_points.install()  # in-process runs may be killed at a point (set by the environment)


def data_available(name: str) -> bool:
  d = os.environ.get("TFDS_DATA_DIR", "")
  return bool(d) and os.path.isdir(os.path.join(d, name))


# In CI (CI=true) the data must be there: a test that needs missing data runs and fails
# instead of being skipped, so a CI run cannot pass with its data-dependent tests unseen.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def requires(available: bool, reason: str):
  """Skips the test when `available` is false, except in CI, where it runs (and fails)."""
  return pytest.mark.skipif(not available and not IN_CI, reason=reason)


BPE_DIR = os.environ.get("ALMA_JAX_BPE_DIR", "")
requires_mnist = requires(data_available("mnist"), "prepared MNIST not found under $TFDS_DATA_DIR")
requires_cifar10 = requires(data_available("cifar10"),
                            "prepared CIFAR-10 not found under $TFDS_DATA_DIR")
requires_bpe = requires(os.path.isdir(BPE_DIR), "GPT-2 BPE files not found ($ALMA_JAX_BPE_DIR)")
requires_shakespeare = requires(data_available("tiny_shakespeare"),
                                "tiny_shakespeare not under $TFDS_DATA_DIR")
requires_text = requires(data_available("tiny_shakespeare") and os.path.isdir(BPE_DIR),
                         "tiny_shakespeare or the GPT-2 BPE files not found")


_REMOVE_AT_END = [os.environ["ALMA_JAX_CACHE_DIR"]] if _OWN_CACHE else []


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """(pytest-xdist, in the controlling process) The workers' shared cache goes at the end."""
  if _OWN_CACHE:
    path = _session_cache_dir(node.workerinput["testrunuid"])
    if path not in _REMOVE_AT_END:
      _REMOVE_AT_END.append(path)


def pytest_unconfigure(config):
  if not hasattr(config, "workerinput"):  # the controlling (or only) process
    for path in _REMOVE_AT_END:
      shutil.rmtree(path, ignore_errors=True)


# -- the figure of a finished run -------------------------------------------------------------------
from alma_jax.reports import plots  # pylint: disable=g-import-not-at-top,wrong-import-position


def _draw_here(self, path, curves, title="", ylabel="test error (%)", scale=100.0):
  """`plots.PlotChild.draw` in this process: the same figure, drawn by the same function."""
  del self
  try:
    plots.run_error_png(path, curves, title, ylabel, scale)
  except Exception as e:  # pylint: disable=broad-except  (as the child reports it)
    return f"{type(e).__name__}: {e}"
  return None


@pytest.fixture(autouse=True)
def _runs_draw_in_this_process(request):
  """A run in a test's own process draws error.png there (matplotlib imported once per worker)
  instead of starting a child process per run, which costs more than the run itself for most
  tests' tiny runs; the runs of `alma_jax.main` that tests start as processes, and the tests
  marked `drawing_child`, use the child as a run does. Patched apart from the test's own
  `monkeypatch`, which a test may undo part-way."""
  if request.node.get_closest_marker("drawing_child") is not None:
    yield
    return
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(plots.PlotChild, "start", lambda self: self)
    patch.setattr(plots.PlotChild, "draw", _draw_here)
    yield


# -- programs kept between a test's runs --------------------------------------------------------
from unittest import mock  # pylint: disable=g-import-not-at-top,wrong-import-position

from alma_jax.runtime import executables  # pylint: disable=g-import-not-at-top,wrong-import-position

_salt = {"test": None, "patches": 0}


def _renew_salt() -> None:
  """A new salt for programs kept in memory (forgetting those kept): the code they were
  traced from may have changed."""
  _salt["patches"] += 1
  if _salt["test"] is not None:
    executables.keep_in_memory(f"{_salt['test']}#{_salt['patches']}")


def _changes_code(entries) -> bool:
  return any(target is not os.environ for target, *_ in entries)


def _renewing(method, when=lambda *args, **kwargs: True):
  """`method`, renewing the salt after it where `when` (asked before it) says so."""
  def wrapper(*args, **kwargs):
    renew = when(*args, **kwargs)
    try:
      return method(*args, **kwargs)
    finally:
      if renew:
        _renew_salt()
  return wrapper


# Every patch of an attribute (monkeypatch, mock.patch) or of a dict other than the
# environment, made or undone, renews the salt; environment variables do not.
pytest.MonkeyPatch.setattr = _renewing(pytest.MonkeyPatch.setattr)
pytest.MonkeyPatch.delattr = _renewing(pytest.MonkeyPatch.delattr)
_item_of_code = lambda self, dic, *args, **kwargs: dic is not os.environ  # pylint: disable=unnecessary-lambda-assignment
_dict_of_code = lambda self: self.in_dict is not os.environ  # pylint: disable=unnecessary-lambda-assignment
pytest.MonkeyPatch.setitem = _renewing(pytest.MonkeyPatch.setitem, _item_of_code)
pytest.MonkeyPatch.delitem = _renewing(pytest.MonkeyPatch.delitem, _item_of_code)
pytest.MonkeyPatch.undo = _renewing(
    pytest.MonkeyPatch.undo,
    lambda self: bool(getattr(self, "_setattr", True)) or _changes_code(
        getattr(self, "_setitem", [(None,)])))
mock._patch.__enter__ = _renewing(mock._patch.__enter__)  # pylint: disable=protected-access
mock._patch.__exit__ = _renewing(mock._patch.__exit__)  # pylint: disable=protected-access
mock._patch_dict._patch_dict = _renewing(  # pylint: disable=protected-access
    mock._patch_dict._patch_dict, _dict_of_code)  # pylint: disable=protected-access
mock._patch_dict._unpatch_dict = _renewing(  # pylint: disable=protected-access
    mock._patch_dict._unpatch_dict, _dict_of_code)  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _programs_kept_between_runs(request):
  """The runs of one test, in its process, keep their compiled programs and FLOP counts in
  memory for the test's later runs (`executables.keep_in_memory`): a resumed run, or a
  second run of one config, does not trace and compile them again. Kept for one test only,
  and forgotten at every patch of code."""
  _salt["test"] = request.node.nodeid
  _renew_salt()
  yield
  _salt["test"] = None
  executables.keep_in_memory(None)


# -- the garbage of earlier tests -------------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # pylint: disable=unused-argument
  """Before each test, the garbage that earlier tests left is collected and what survives them
  (JAX's caches, compiled programs, imported modules: over a million objects in a worker) is
  frozen out of the collector's later passes (`gc.freeze`). Otherwise every full pass walks
  all of it again: about a second each, several times a minute, and in every test that
  collects explicitly (`helpers.unraisable_reports`). A pass then walks only what the tests
  since the last freeze made."""
  gc.collect()
  gc.freeze()
