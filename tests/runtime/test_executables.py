"""Compiled programs kept across processes and found again without tracing
(`alma_jax.runtime.executables`)."""

import hashlib
import importlib
import json
import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax.stream import run
from alma_jax.runtime import executables
from alma_jax.engine import timing
from tests import helpers
from tests.conftest import requires_mnist

TRACES = []
_OFFSET = [0.0]


def _affine(w, x, n):
  TRACES.append(x.shape)  # runs once per trace
  return w * x + n + _OFFSET[0]


# A number of the test run, the same in all of a parallel session's workers (which share JAX's
# persistent cache), new for every run.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or os.urandom(8).hex()


def _offsets(session) -> dict[str, float]:
  """A constant of its own for each of this module's tests in the session: a multiple of 1/1024
  in (0, 1), so that every sum in these tests is exact in float32."""
  here = sys.modules[__name__]
  ids = sorted(item.nodeid for item in session.items if getattr(item, "module", None) is here)
  start = int(hashlib.sha256(_RUN.encode()).hexdigest(), 16)
  return {node: ((start + i) % 1023 + 1) / 1024 for i, node in enumerate(ids)}


@pytest.fixture(autouse=True)
def _fresh_program(request):
  # Each test's program has a constant of its own: a program that JAX's persistent cache
  # (shared by the test session) already holds is not kept (see the last test), and a test
  # that needs its first call compiled must not find another test's program there.
  _OFFSET[0] = _offsets(request.session)[request.node.nodeid]
  yield
  _OFFSET[0] = 0.0


def test_every_test_here_has_a_constant_of_its_own(request):
  offsets = _offsets(request.session)
  assert len(set(offsets.values())) == len(offsets) > 1
  assert all(0 < value < 1 and (value * 1024).is_integer() for value in offsets.values())


def _want(size=4):
  return 2.0 * np.arange(size, dtype=np.float32) + 1.0 + np.float32(_OFFSET[0])


def _kept(name="affine", key=(), **options):
  # A new `Kept`, with JAX's in-process caches cleared, stands for the same site in a new
  # process: nothing traced or compiled is in memory.
  jax.clear_caches()
  return executables.jit(_affine, name, key + (_OFFSET[0],), **options)


def _args(size=4):
  return jnp.full((size,), 2.0), np.arange(size, dtype=np.float32), np.float32(1.0)


def _a_later_process_loads_it(folder):
  """A later process (a new `Kept`, JAX's caches cleared) loads the program kept in `folder`
  for "run A", and it computes what it should."""
  with executables.keeping(str(folder), "run A") as store:
    out = _kept()(*_args())
  assert store.loaded == 1
  np.testing.assert_array_equal(np.asarray(out), _want())


def test_a_kept_program_is_loaded_in_a_later_process_without_tracing(tmp_path):
  TRACES.clear()
  with executables.keeping(str(tmp_path), "run A") as store:
    first = _kept()(*_args())
  assert len(TRACES) == 1 and store.stored == 1 and store.loaded == 0
  before = timing.compile_counts()
  args, kept = _args(), _kept()
  with executables.keeping(str(tmp_path), "run A") as store:
    again, names = helpers.compiled(lambda: kept(*args))
  after = timing.compile_counts()
  assert len(TRACES) == 1, "the second process traced the program again"
  assert store.loaded == 1 and store.stored == 0
  np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
  np.testing.assert_array_equal(np.asarray(first), _want())
  # Reported like a program loaded from the persistent cache.
  assert names == ["jit(affine)"]
  assert after["kept_programs_loaded"] - before["kept_programs_loaded"] == 1
  assert after["compile_cache_hits"] - before["compile_cache_hits"] == 1
  assert after["xla_programs"] - before["xla_programs"] == 1


@pytest.mark.parametrize("change", ["context", "key", "name", "shape", "dtype", "options", "once"])
def test_anything_that_can_change_the_program_misses_the_kept_one(tmp_path, change):
  with executables.keeping(str(tmp_path), "run A"):
    _kept()(*_args())
  TRACES.clear()
  w, x, n = _args()
  context, kept = "run A", _kept()
  if change == "context":
    context = "run B"
  elif change == "key":
    kept = _kept(key=("structure",))
  elif change == "name":
    kept = _kept(name="another")
  elif change == "shape":
    w, x = jnp.full((5,), 2.0), np.arange(5, dtype=np.float32)
  elif change == "dtype":
    n = np.int32(1)
  elif change == "once":
    kept = _kept(once=True)
  else:
    kept = _kept(donate_argnums=(0,))
  with executables.keeping(str(tmp_path), context) as store:
    kept(w, x, n)
  assert len(TRACES) == 1 and store.loaded == 0


def test_a_key_that_names_an_address_is_not_kept_and_the_call_still_runs(tmp_path):
  TRACES.clear()
  with executables.keeping(str(tmp_path), "run A") as store:
    out = _kept(key=(object(),))(*_args())
  np.testing.assert_array_equal(np.asarray(out), _want())
  assert store.stored == 0 and not os.path.exists(tmp_path / "programs")
  with pytest.raises(executables.Unkeepable):
    executables.stable(object())


def test_without_jax_s_serialisation_nothing_is_kept_and_the_call_still_runs(tmp_path,
                                                                             monkeypatch):
  # `jax.experimental.serialize_executable` is experimental: a JAX without it keeps nothing.
  monkeypatch.setattr(executables, "serialize_executable", None)
  for _ in range(2):
    with executables.keeping(str(tmp_path), "run A") as store:
      out = _kept()(*_args())
    np.testing.assert_array_equal(np.asarray(out), _want())
    assert store.stored == 0 and store.loaded == 0
  # And the module imports without it.
  code = ("import sys; sys.modules['jax.experimental.serialize_executable'] = None; "
          "from alma_jax.runtime import executables; print(executables.serialize_executable)")
  proc = subprocess.run([sys.executable, "-c", code], cwd=helpers.ROOT, capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr[-2000:]


def test_outside_keeping_and_inside_a_trace_the_call_is_plain_jit(tmp_path):
  kept = _kept()
  with executables.keeping(None, "run A") as store:
    assert store is None
    kept(*_args())
  with executables.keeping(str(tmp_path), "run A") as store:
    outer = jax.jit(lambda w, x: kept(w, x, 1.0) * 2)  # the kept function traced inside
    np.testing.assert_array_equal(np.asarray(outer(*_args()[:2])), 2 * _want())
  assert store.stored == 0


def test_static_arguments_are_part_of_the_key(tmp_path):
  def scaled(x, *, k):
    TRACES.append(k)
    return x * k

  TRACES.clear()
  for _ in range(2):  # the second round stands for a later process
    jax.clear_caches()
    kept = executables.jit(scaled, "scaled", static_argnames=("k",))
    with executables.keeping(str(tmp_path), "run A"):
      assert float(kept(np.float32(2.0), k=3)) == 6.0
      assert float(kept(np.float32(2.0), k=4)) == 8.0
  assert TRACES == [3, 4]


def test_a_damaged_kept_program_is_compiled_again_and_replaced(tmp_path):
  with executables.keeping(str(tmp_path), "run A"):
    _kept()(*_args())
  files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "programs") for f in fs]
  assert len(files) == 1
  with open(files[0], "wb") as f:
    f.write(b"not a program")
  TRACES.clear()
  with executables.keeping(str(tmp_path), "run A") as store:
    out = _kept()(*_args())
  np.testing.assert_array_equal(np.asarray(out), _want())
  assert len(TRACES) == 1 and store.loaded == 0 and store.stored == 1
  _a_later_process_loads_it(tmp_path)


def test_a_changed_source_file_changes_the_code_digest(tmp_path, monkeypatch):
  (tmp_path / "kept_plugin.py").write_text("SCALE = 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  module = importlib.import_module("kept_plugin")
  try:
    before = executables.code_digest()
    (tmp_path / "kept_plugin.py").write_text("SCALE = 22\n")
    assert executables.code_digest() != before
  finally:
    del sys.modules[module.__name__]


def test_remembered_values_are_read_back_for_the_same_context_only(tmp_path):
  calls = []

  def compute():
    calls.append(1)
    return {"flops": float(len(calls))}

  for context, want in (("run A", 1.0), ("run A", 1.0), ("run B", 2.0)):
    with executables.keeping(str(tmp_path), context):
      assert executables.remembered("flops", ("structure", 1), compute) == {"flops": want}
  assert len(calls) == 2
  assert executables.remembered("flops", ("structure", 1), compute) == {"flops": 3.0}  # no store


def test_a_program_jax_loaded_from_its_persistent_cache_is_kept_from_that_entry(tmp_path):
  # XLA:CPU (jaxlib 0.10.2) serialises such a loaded executable without its code; the kept
  # program holds the cache entry's bytes instead, so it runs when loaded again.
  assert jax.config.jax_compilation_cache_dir, "the tests run with a persistent cache (conftest)"
  args = _args()
  _kept()(*args)  # outside `keeping`: plain jit, into JAX's persistent cache
  kept = _kept()
  before = timing.compile_counts()["compile_cache_hits"]
  with executables.keeping(str(tmp_path), "run A") as store:
    out = kept(*args)
  assert timing.compile_counts()["compile_cache_hits"] == before + 1  # JAX's cache served it
  np.testing.assert_array_equal(np.asarray(out), _want())
  assert store.stored == 1
  _a_later_process_loads_it(tmp_path)


def _counting_serialisations(monkeypatch) -> list:
  """Counts XLA's serialisations of executables for `executables.serialize_executable`."""
  made = []
  real = executables.serialize_executable.serialize

  def counted(compiled):
    made.append(compiled)
    return real(compiled)

  monkeypatch.setattr(executables.serialize_executable, "serialize", counted)
  return made


def test_a_program_compiled_afresh_is_kept_from_the_entry_jax_wrote(tmp_path, monkeypatch):
  # JAX serialises a program it compiles for its persistent cache's entry; the kept program
  # takes those bytes back instead of having XLA serialise the executable a second time.
  assert jax.config.jax_compilation_cache_dir, "the tests run with a persistent cache (conftest)"
  made = _counting_serialisations(monkeypatch)
  kept, args = _kept(), _args()
  before = timing.compile_counts()["compile_cache_hits"]
  with executables.keeping(str(tmp_path), "run A") as store:
    out = kept(*args)
  assert timing.compile_counts()["compile_cache_hits"] == before  # compiled, not loaded
  np.testing.assert_array_equal(np.asarray(out), _want())
  assert store.stored == 1 and not made
  _a_later_process_loads_it(tmp_path)


def test_a_program_compiled_without_a_cache_entry_is_serialised_and_kept(tmp_path, monkeypatch):
  # JAX writes no entry for some programs (a program with host callbacks, one under a size
  # threshold: here none at all); the kept program is then serialised from the executable.
  made = _counting_serialisations(monkeypatch)
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
  with mock.patch.object(compilation_cache, "put_executable_and_time") as put:
    with executables.keeping(str(tmp_path), "run A") as store:
      out = _kept()(*_args())
  assert put.call_count == 1  # JAX compiled it and would have written its entry
  np.testing.assert_array_equal(np.asarray(out), _want())
  assert store.stored == 1 and len(made) == 1
  _a_later_process_loads_it(tmp_path)


def test_a_cache_entry_that_cannot_be_read_back_leaves_the_program_serialised_and_kept(
    tmp_path, monkeypatch):
  # Reading JAX's entry back uses JAX's internals; where that fails (another JAX), the program
  # is serialised from the executable, as before, and still kept.
  made = _counting_serialisations(monkeypatch)

  def unreadable(*args, **kwargs):
    raise AttributeError("another JAX")

  monkeypatch.setattr(executables, "_serialize_from_cache", unreadable)
  with executables.keeping(str(tmp_path), "run A") as store:
    out = _kept()(*_args())
  np.testing.assert_array_equal(np.asarray(out), _want())
  assert store.stored == 1 and len(made) == 1
  monkeypatch.undo()
  _a_later_process_loads_it(tmp_path)


def test_only_the_compiling_thread_s_cache_notes_name_its_program():
  # JAX compiles in the calling thread; a compile in another thread (of another program) that
  # logs a hit or a miss meanwhile must not be taken for this program's entry.
  import logging  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  log = logging.getLogger("jax._src.compiler")

  def notes(prefix):
    log.debug("Persistent compilation cache hit for '%s' with key %r", "jit_f", f"{prefix}-hit")
    log.debug("PERSISTENT COMPILATION CACHE MISS for '%s' with key %r", "jit_f",
              f"{prefix}-miss")

  with executables._persistent_cache_keys() as (keys, missed):  # pylint: disable=protected-access
    other = threading.Thread(target=notes, args=("other",))
    other.start()
    other.join()
    notes("mine")
  assert keys == ["mine-hit"] and missed == ["mine-miss"]


def test_calls_of_other_shapes_trees_or_shardings_than_the_last_run_their_own_programs(tmp_path):
  kept = _kept()
  two = np.float32(2.0)
  with executables.keeping(str(tmp_path), "run A") as store:
    for size in (4, 5, 4, 5):
      out = kept(jnp.ones((size,)), np.ones((size,), np.float32), two)
      np.testing.assert_array_equal(np.asarray(out), 3.0 + np.float32(_OFFSET[0]))
      assert out.shape == (size,)
    integer = kept(jnp.ones((4,), jnp.int32), np.ones((4,), np.int32), np.int32(2))
    np.testing.assert_array_equal(np.asarray(integer), np.float32(3 + _OFFSET[0]))
    other_device = jax.device_put(jnp.ones((4,)), jax.devices()[-1])
    out = kept(other_device, np.ones((4,), np.float32), two)
    assert out.sharding.device_set == {jax.devices()[-1]}
    with pytest.raises(TypeError):
      kept((jnp.ones((4,)),), np.ones((4,), np.float32), two)  # another tree: jit's own error
  assert store.stored == 4 - (len(jax.devices()) == 1)


def test_a_program_loaded_from_the_persistent_cache_before_keeping_is_kept_with_its_code(tmp_path):
  # The same jit called outside `keeping` first (as a run's speed measurement may): JAX loads
  # the program from its persistent cache then, and inside `keeping` its compile is JAX's
  # in-memory one, with no cache hit to tell; the kept program must still hold its code.
  args = _args()
  _kept()(*args)  # plain jit, into JAX's persistent cache
  kept = _kept()
  before = timing.compile_counts()["compile_cache_hits"]
  kept(*args)  # outside `keeping`: loaded from JAX's persistent cache
  assert timing.compile_counts()["compile_cache_hits"] == before + 1
  with executables.keeping(str(tmp_path), "run A") as store:
    np.testing.assert_array_equal(np.asarray(kept(*args)), _want())
  assert store.stored == 0  # it may lack its code: not kept
  with executables.keeping(str(tmp_path), "run A") as store:  # a later process keeps it
    np.testing.assert_array_equal(np.asarray(_kept()(*_args())), _want())
  assert store.stored == 1
  _a_later_process_loads_it(tmp_path)


def test_a_program_compiled_before_keeping_is_kept(tmp_path):
  # Called outside `keeping` first and compiled there (not from JAX's persistent cache), the
  # executable JAX holds has its code: kept, and it runs when loaded again.
  args = _args()
  kept = _kept()
  before = timing.compile_counts()["compile_cache_hits"]
  kept(*args)  # outside `keeping`: compiled
  assert timing.compile_counts()["compile_cache_hits"] == before
  with executables.keeping(str(tmp_path), "run A") as store:
    np.testing.assert_array_equal(np.asarray(kept(*args)), _want())
  assert store.stored == 1
  _a_later_process_loads_it(tmp_path)


# -- programs kept in memory -----------------------------------------------------------------------
def test_in_memory_a_later_run_of_the_process_uses_the_compiled_program_itself():
  executables.keep_in_memory("salt A")
  TRACES.clear()
  with executables.keeping(executables.MEMORY, "run A") as store:
    first = _kept()(*_args())
  assert len(TRACES) == 1 and store.stored == 1
  # What it keeps is the compiled program itself, not serialised bytes.
  assert [type(v) for v in executables._memory.values()] == [jax.stages.Compiled]
  before = timing.compile_counts()
  with executables.keeping(executables.MEMORY, "run A") as store:
    again = _kept()(*_args())
  assert len(TRACES) == 1 and store.loaded == 1 and store.stored == 0
  np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
  assert timing.compile_counts()["kept_programs_loaded"] == before["kept_programs_loaded"] + 1
  # Another context, or a new salt (which forgets what was kept), traces it again.
  with executables.keeping(executables.MEMORY, "run B") as store:
    _kept()(*_args())
  assert len(TRACES) == 2 and store.loaded == 0
  executables.keep_in_memory("salt B")
  with executables.keeping(executables.MEMORY, "run A") as store:
    _kept()(*_args())
  assert len(TRACES) == 3 and store.loaded == 0
  # Not allowed: nothing is kept.
  executables.keep_in_memory(None)
  with executables.keeping(executables.MEMORY, "run A") as store:
    assert store is None


def test_a_test_forgets_what_it_kept_in_memory_when_it_patches_code(monkeypatch):
  # (`tests/conftest.py`: one salt per test, renewed by every patch of an attribute or of a
  # dict other than the environment, made or undone.)
  def kept_one():
    with executables.keeping(executables.MEMORY, "run A"):
      _kept()(*_args())
    return bool(executables._memory)

  assert kept_one()
  monkeypatch.setenv("ALMA_JAX_SOME_VARIABLE", "1")
  assert executables._memory, "an environment variable is not code"
  monkeypatch.setattr(helpers, "ROOT", helpers.ROOT)
  assert not executables._memory and kept_one()
  with monkeypatch.context() as m:
    m.setenv("ALMA_JAX_SOME_VARIABLE", "2")
  assert executables._memory
  with mock.patch.object(helpers, "ROOT", "elsewhere"):
    assert not executables._memory and kept_one()
  assert not executables._memory and kept_one()
  with mock.patch.dict(os.environ, {"ALMA_JAX_SOME_VARIABLE": "3"}):
    pass
  assert executables._memory
  with mock.patch.dict(executables.ONCE_OPTIONS, {}):
    assert not executables._memory


@requires_mnist
def test_the_second_run_of_a_config_in_a_test_loads_its_programs_from_memory(tmp_path):
  config = helpers.smoke("sm")
  run.run(config, str(tmp_path / "first"))
  run.run(config, str(tmp_path / "second"))
  assert helpers.outputs(tmp_path / "second") == helpers.outputs(tmp_path / "first")
  loaded = []
  for name in ("first", "second"):
    with open(tmp_path / name / "summary.json") as f:
      timings = json.load(f)["timings"]
    loaded.append((timings["kept_programs_loaded"], timings["xla_programs"]))
  (first, _), (second, programs) = loaded
  # Every program of the second run but the learner's initialisation, which it compiles while
  # it is set up, before `keeping` starts.
  assert first == 0 and second == programs - 1 > 0, loaded


# -- programs that run once ------------------------------------------------------------------------
# XLA:CPU's option that keeps YNNPACK's fusions out of a program: visible in its compiled text
# (`helpers.gathered_dot`).
_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def test_a_program_that_runs_once_compiles_with_the_once_options_except_inside_a_trace(
    tmp_path, monkeypatch):
  monkeypatch.setattr(executables, "ONCE_OPTIONS", _NO_YNN)
  monkeypatch.setattr(executables, "_refused", [])
  assert executables.once_options() == _NO_YNN
  assert executables.once_options({"xla_cpu_use_onednn": True}) == {
      "xla_cpu_use_onednn": True, **_NO_YNN}
  args = helpers.gathered_dot_args()
  once = executables.jit(helpers.gathered_dot, "gathered_dot", (_OFFSET[0],), once=True)
  plain = executables.jit(helpers.gathered_dot, "gathered_dot", (_OFFSET[0],))
  assert "ynn_fusion" in plain.jitted.lower(*args).compile().as_text()  # the default
  # Outside `keeping` and inside it (the program it keeps), with the options.
  assert "ynn_fusion" not in once.top_jitted().lower(*args).compile().as_text()
  with executables.keeping(str(tmp_path), "run A") as store:
    out = once(*args)
  assert store.stored == 1 and "ynn_fusion" not in once._last.as_text()
  # Inside another program's trace it is part of that program: no options of its own, with
  # traced arguments or constants alike.
  outer = jax.jit(lambda x, w: once(x, w, args[2]) + 1)
  np.testing.assert_array_equal(np.asarray(outer(*args[:2])), np.asarray(out) + 1)
  assert jax.eval_shape(lambda: once(*args)).shape == (256,)


def test_a_program_never_kept_is_compiled_with_the_once_options_and_not_stored(tmp_path,
                                                                              monkeypatch):
  monkeypatch.setattr(executables, "ONCE_OPTIONS", _NO_YNN)
  monkeypatch.setattr(executables, "_refused", [])
  args = helpers.gathered_dot_args()
  never = executables.jit(helpers.gathered_dot, "gathered_dot", (_OFFSET[0],), once=True,
                          keep=False)
  assert "ynn_fusion" not in never.top_jitted().lower(*args).compile().as_text()
  with executables.keeping(str(tmp_path), "run A") as store:
    out = never(*args)
  assert store.stored == 0 and store.loaded == 0 and never._last is None
  np.testing.assert_array_equal(np.asarray(out), np.asarray(never.jitted(*args)))


@pytest.mark.parametrize("keep", [False, True])
def test_once_options_that_xla_does_not_know_are_dropped_for_the_process(tmp_path, monkeypatch,
                                                                        keep):
  monkeypatch.setattr(executables, "ONCE_OPTIONS", {"xla_cpu_no_such_option": True})
  monkeypatch.setattr(executables, "_refused", [])
  assert not executables.accepts(executables.ONCE_OPTIONS)
  once = executables.jit(helpers.gathered_dot, "gathered_dot", (_OFFSET[0], keep), once=True)
  with executables.keeping(str(tmp_path) if keep else None, "run A"):
    assert once(*helpers.gathered_dot_args()).shape == (256,)  # compiled without them
  assert "No such compile option" in executables._refused[0]
  assert once.top_jitted() is once.jitted
  assert executables.once_options(_NO_YNN) == _NO_YNN and executables.once_options() is None


def test_an_unknown_option_of_the_program_itself_is_an_error_and_keeps_the_once_options(
    monkeypatch):
  monkeypatch.setattr(executables, "_refused", [])
  once = executables.jit(helpers.gathered_dot, "gathered_dot", (_OFFSET[0],), once=True,
                         compiler_options={"xla_cpu_no_such_option": True})
  with pytest.raises(jax.errors.JaxRuntimeError, match="xla_cpu_no_such_option"):
    once(*helpers.gathered_dot_args())
  assert not executables._refused and executables.once_options() == executables.ONCE_OPTIONS
