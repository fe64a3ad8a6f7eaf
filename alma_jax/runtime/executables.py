"""Compiled programs kept across processes and found again without tracing them.

JAX's persistent compilation cache saves XLA's work, but finding an entry
needs the program's HLO, so every process still traces and lowers every
program (P4 on a 2-core CPU: ~4 s of a warm run's ~5.5 s of compilation).
This module keeps the compiled executables themselves, under a key computed
without tracing: a run's *context* and the program's *site* and *arguments*.

- The context (`keeping`): what the caller says determines its programs (a
  run passes its resolved config but for its seed, waiting time and replay,
  and the fingerprint of its data: runs that differ only in those share
  programs, unless the seed draws their data) and what
  determines the code: every source file of this package and of any loaded
  module that no installed distribution holds (config files, a user's
  plug-ins), the installed distributions' versions, Python, JAX's
  configuration, `XLA_FLAGS`, the backend and its devices.
- The site (`jit(fn, name, key=...)`): the program's name, the code location
  of `fn`, the caller's `key` (e.g. the structure a step is built for) and the
  jit options (shardings, donation, compiler options, whether it runs once).
- The arguments: the tree structure and every leaf's shape, dtype, weak type
  and sharding, and the values of static arguments.

Anything whose text is not reproducible across processes (a `repr` holding an
address) is not kept: the call goes through `jax.jit` as usual, as does every
call outside `keeping` and in a run of several processes. A program that
cannot be serialised (closed-over constants) is compiled and used, not kept.
A program that JAX loaded from its persistent cache, or compiled and wrote
there, is kept from that entry's bytes (`_serialize_from_cache`): XLA
serialises an executable once, for JAX's entry, not a second time for the
kept one. One that JAX loaded from that cache for a call outside `keeping`
first (a speed measurement before the run) is not kept by that process, as
JAX may then hand it back from memory without a hit to tell which entry.

A kept program loaded from disk is reported through `jax.monitoring` as a
compilation-cache hit and a backend compile of its name (the seconds the load
took), so compile accounting (`alma_jax.engine.timing`) sees a program loaded
from either cache alike. `remembered` keeps small computed values (FLOP counts)
under the same kind of key.

A process that runs several runs in turn can keep them in its memory instead
(`keep_in_memory`, `keeping(MEMORY, ...)`): the compiled programs themselves,
under the same keys and a salt of the caller's. The test suite does, one salt
per test and per patch of code; the library's own runs (`alma_jax.run`) keep
nothing unless told, since code patched at run time is not in any key.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import pickle
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

try:  # experimental in JAX: without it (another release) no program is kept, runs still run
  from jax.experimental import serialize_executable
except ImportError:  # pragma: no cover (a JAX other than the pinned one)
  serialize_executable = None

_active: "_Store | None" = None
_serial = 0  # numbers the stores, so that a program's memory of one is not taken for another's
_EVENTS = ("/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits",
           "/alma_jax/kept_programs/loaded")
_LOAD_EVENT = "/jax/core/compile/backend_compile_duration"
_log = logging.getLogger(__name__)
_HIT_NOTE = "Persistent compilation cache hit for"  # JAX's compiler's debug notes
_MISS_NOTE = "PERSISTENT COMPILATION CACHE MISS for"  # (then it compiles and writes)
_persistent_hits = [0]  # programs this process loaded from JAX's persistent compilation cache


def _count_hits(event: str, **kwargs) -> None:
  del kwargs
  if event == "/jax/compilation_cache/cache_hits":
    _persistent_hits[0] += 1


jax.monitoring.register_event_listener(_count_hits)


class Unkeepable(Exception):
  """A key's text would not be the same in another process."""


def stable(value: Any) -> str:
  """`repr(value)`, refused (`Unkeepable`) when it names an address (` at 0x`)."""
  text = value if isinstance(value, str) else repr(value)
  if " at 0x" in text or "object at" in text:
    raise Unkeepable(text[:200])
  return text


def site_of(fn: Callable) -> str:
  """Where `fn` is written (module, qualified name, first line), through wrappers."""
  while True:
    inner = getattr(fn, "__wrapped__", None) or getattr(fn, "func", None)
    if inner is None or inner is fn:
      break
    if isinstance(fn, functools.partial):
      return f"{site_of(fn.func)}{stable(fn.args)}{stable(sorted(fn.keywords.items()))}"
    fn = inner
  code = getattr(fn, "__code__", None)
  where = f":{code.co_firstlineno}" if code is not None else ""
  qualname = getattr(fn, "__qualname__", None) or stable(fn)
  return f"{getattr(fn, '__module__', '?')}.{qualname}{where}"


# -- the context ---------------------------------------------------------------------------------
_INSTALLED = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["stdlib"],
                                                 sysconfig.get_paths()["purelib"],
                                                 sysconfig.get_paths()["platlib"]})


@functools.lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
  del mtime_ns, size  # part of the cache key only
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _sources() -> set[str]:
  """Every source file of this package, wherever it is installed (whichever modules a process
  happened to import), and every loaded module's that no installed distribution holds."""
  package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
  files = {os.path.join(d, f) for d, _, names in os.walk(package) for f in names
           if f.endswith(".py")}
  for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if path and path.endswith(".py"):
      real = os.path.realpath(path)
      if not real.startswith(_INSTALLED) and os.path.exists(real):
        files.add(real)
  return files


def code_digest() -> str:
  """SHA-256 of the sources of `_sources`."""
  parts = []
  for path in sorted(_sources()):
    st = os.stat(path)
    parts.append(f"{path} {_file_digest(path, st.st_mtime_ns, st.st_size)}")
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _distributions() -> str:
  return "\n".join(sorted(f"{d.metadata['Name']}=={d.version}"
                          for d in importlib.metadata.distributions()))


def environment() -> str:
  """What besides the code decides what a program compiles to: the installed distributions,
  Python, JAX's configuration, XLA's flags, the backend and its devices, the processes."""
  devices = jax.devices()
  config = sorted((k, repr(v)) for k, v in jax.config.values.items())
  return json.dumps({
      "distributions": _distributions(), "python": sys.version,
      "jax_config": config, "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "libtpu": os.environ.get("LIBTPU_INIT_ARGS", ""),
      "backend": [jax.default_backend(), devices[0].client.platform_version,
                  sorted({d.device_kind for d in devices}), len(devices), jax.process_count()],
  })


class _Store:
  """A folder of kept executables and values for one context."""

  def __init__(self, folder: str, context: str):
    self.folder = folder
    self.context = hashlib.sha256(
        "\n".join((context, self._code(), environment())).encode()).hexdigest()
    self.backend = jax.devices()[0].client
    self.loaded = self.stored = 0
    global _serial
    _serial += 1
    self.serial = _serial

  def _code(self) -> str:
    return code_digest()

  def path(self, kind: str, text: str) -> str:
    digest = hashlib.sha256(f"{self.context}\n{text}".encode()).hexdigest()
    return os.path.join(self.folder, kind, digest[:2], digest)

  def read(self, path: str):
    """What `write` wrote at `path`; None if nothing is there (a damaged file is removed)."""
    try:
      with open(path, "rb") as f:
        return pickle.load(f)
    except OSError:
      return None
    except Exception:  # pylint: disable=broad-except  (a damaged or foreign file)
      self.forget(path)
      return None

  def forget(self, path: str) -> None:
    with contextlib.suppress(OSError):
      os.unlink(path)

  def write(self, path: str, value) -> None:
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
      with os.fdopen(fd, "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
      os.replace(tmp, path)  # whole or not at all, for a reader in another process
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
      with contextlib.suppress(OSError, UnboundLocalError):
        os.unlink(tmp)

  def save_program(self, compiled, cache_keys: list[str] | None, loaded_plain: bool,
                   written: tuple[str, ...] = ()):
    """What `write` keeps of `compiled` (None: not kept). `cache_keys`: the persistent cache
    entries JAX loaded while compiling it (None: it compiled); `loaded_plain`: a plain call
    of the same program loaded one from that cache earlier; `written`: the entries JAX
    looked for and missed while compiling it (then it writes the executable there)."""
    try:
      if cache_keys is None:
        if loaded_plain:  # perhaps that loaded executable, without its code: not kept
          return None
        # The entry JAX has just written holds the executable's bytes: read back, not made
        # again. Where there is none (JAX writes none for a program with host callbacks, for
        # example) or it cannot be read back (another JAX's cache), XLA serialises it.
        try:
          saved = _serialize_from_cache(compiled, written[0]) if len(written) == 1 else None
        except Exception:  # pylint: disable=broad-except
          saved = None
        if saved is None:
          saved = serialize_executable.serialize(compiled)
      elif len(cache_keys) == 1:
        saved = _serialize_from_cache(compiled, cache_keys[0])
      else:
        return None
      return saved + (tuple(d.id for d in compiled.runtime_executable().local_devices()),)
    except Exception:  # pylint: disable=broad-except  (closed-over constants, another jax...)
      return None

  def load_program(self, saved):
    """The program `save_program` saved; None if it cannot be loaded."""
    try:
      payload, in_tree, out_tree, device_ids = saved
      by_id = {d.id: d for d in jax.devices()}
      return serialize_executable.deserialize_and_load(
          payload, in_tree, out_tree, backend=self.backend,
          execution_devices=[by_id[i] for i in device_ids])
    except Exception:  # pylint: disable=broad-except  (damaged, or not a program)
      return None


class _MemoryStore(_Store):
  """Programs and values kept in this process's memory (`keep_in_memory`): the compiled
  programs themselves, never serialised."""

  def __init__(self, context: str):
    super().__init__(MEMORY, f"{context}\n{_memory_salt}")

  def _code(self) -> str:
    # The code a process runs is what it imported: its source files may change on disk, not
    # in the process (but through patches, which the salt is for).
    return ""

  def read(self, path: str):
    return _memory.get(path)

  def forget(self, path: str) -> None:
    _memory.pop(path, None)

  def write(self, path: str, value) -> None:
    _memory[path] = value

  def save_program(self, compiled, cache_keys, loaded_plain, written=()):
    del cache_keys, loaded_plain, written
    return compiled

  def load_program(self, saved):
    return saved


MEMORY = ":memory:"  # `keeping`'s folder for this process's memory
_memory: dict[str, Any] = {}
_memory_salt: str | None = None


def keep_in_memory(salt: str | None) -> None:
  """Lets `keeping(MEMORY, ...)` keep programs and values in this process's memory, for a
  process that runs several runs in turn (`memory_folder`). `salt` is what, besides the
  context, the code and the environment, decides them: a process that changes code at run
  time (a test patching a module) gives a new salt after each change, and a new salt forgets
  everything kept. None (the default): nothing is kept in memory."""
  global _memory_salt
  if salt != _memory_salt:
    _memory.clear()
  _memory_salt = salt


def memory_folder() -> str | None:
  """`MEMORY` where `keep_in_memory` allows it, else None."""
  return MEMORY if _memory_salt is not None else None


@contextlib.contextmanager
def keeping(folder: str | None, context: str) -> Iterator["_Store | None"]:
  """Within this block, programs of `jit` are kept in `folder` for `context` (the text of
  what, besides the code and the environment, decides the programs: e.g. a resolved config
  and a data fingerprint). `folder` None, `MEMORY` before `keep_in_memory` gave a salt, or
  several processes: nothing is kept."""
  global _active
  before = _active
  if not folder or jax.process_count() > 1 or (folder == MEMORY and _memory_salt is None):
    _active = None
  else:
    _active = _MemoryStore(context) if folder == MEMORY else _Store(folder, context)
  try:
    yield _active
  finally:
    _active = before


# -- programs ------------------------------------------------------------------------------------
def _leaf_signature(x):
  if isinstance(x, jax.core.Tracer):  # called inside another program's trace: part of it
    raise Unkeepable("traced")
  if isinstance(x, jax.Array):
    return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
  if isinstance(x, np.ndarray):
    return (x.shape, x.dtype, "host")
  if isinstance(x, (bool, int, float)):
    return (type(x).__name__,)
  if isinstance(x, np.generic):
    return ((), x.dtype, "host")
  raise Unkeepable(type(x).__name__)


class Kept:
  """`jax.jit(fn, **options)` whose compiled programs are kept (`keeping`) and loaded again
  without tracing. Arguments are positional, but for those that `static_argnames` names."""

  def __init__(self, fn: Callable, name: str, key: Any = (), origin: Callable | None = None,
               once: bool = False, keep: bool = True, **options):
    self.jitted = jax.jit(fn, **options)
    self.name = name
    self._fn, self._options, self._once = fn, options, once
    self._top_jitted = None  # the jit of calls outside a trace (`top_jitted`)
    self._static = tuple(sorted(options.get("static_argnums", ()) or ()))
    self._static_names = frozenset(options.get("static_argnames", ()) or ())
    try:
      self._site = "\n".join((name, site_of(origin or fn), stable(key),
                              stable(sorted((k, repr(v)) for k, v in options.items())),
                              "once" if once else ""))
    except Unkeepable:
      self._site = None
    if not keep:
      self._site = None
    self._programs: dict[tuple, Any] = {}  # signature -> Compiled, or None: not kept
    # A plain jit call (outside `keeping`) that JAX served from its persistent cache: JAX then
    # holds that loaded executable, which a later compile returns from memory without a hit.
    self._loaded_plain = False
    self._serial = 0  # the store `_programs` belongs to
    self._last = None  # the Compiled of the last call (no static arguments)

  def __call__(self, *args, **kwargs):
    store = _active
    if store is None or self._site is None or not self._static_names.issuperset(kwargs):
      return self._plain(*args, **kwargs)
    if store.serial != self._serial:
      self._programs, self._serial, self._last = {}, store.serial, None
    if self._last is not None:
      # Most calls repeat the last one's shapes: the Compiled checks them itself (types,
      # tree, shardings) before it runs, and refuses others, which are looked up below.
      try:
        return self._last(*args)
      except (TypeError, ValueError):
        pass
    static = (tuple(args[i] for i in self._static), tuple(sorted(kwargs.items())))
    dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
    try:
      leaves, tree = jax.tree.flatten(dynamic)
      signature = (tree, tuple(_leaf_signature(x) for x in leaves), static)
      compiled = self._programs.get(signature, False)
    except (Unkeepable, TypeError):  # unhashable static values or unusual leaves
      return self._plain(*args, **kwargs)
    if compiled is False:
      compiled = self._load(store, args, kwargs, static, tree, leaves)
      self._programs[signature] = compiled
    if compiled is None:
      return self._plain(*args, **kwargs)
    if not self._static and not self._static_names:
      self._last = compiled
    return compiled(*dynamic)

  def top_jitted(self):
    """The jit of a call outside another program's trace: with `ONCE_OPTIONS` for a program
    that runs about once (`once_options`, decided at its first call: the backend is known
    then). A call inside a trace becomes part of that program, which has options of its own."""
    if self._top_jitted is None:
      given = self._options.get("compiler_options")
      options = once_options(given) if self._once else given
      self._top_jitted = (self.jitted if options == given else
                          jax.jit(self._fn, **{**self._options, "compiler_options": options}))
    return self._top_jitted

  def _outside_traces(self, run: Callable, args, kwargs):
    """`run(jit)` with `top_jitted()`, or with the jit without `ONCE_OPTIONS` inside another
    program's trace and where XLA does not know them (a jaxlib that dropped one: then no
    program of the process asks for them again)."""
    top = self.top_jitted()
    if top is self.jitted or any(isinstance(x, jax.core.Tracer)
                                 for x in jax.tree.leaves((args, kwargs))):
      return run(self.jitted)
    try:
      return run(top)
    except ValueError as e:  # inside a trace that the arguments do not show (constants)
      if "compiler_options" not in str(e):
        raise
    except jax.errors.JaxRuntimeError as e:  # not one of the program's own options
      if "No such compile option" not in str(e) or not any(k in str(e) for k in ONCE_OPTIONS):
        raise
      _log.info("XLA:CPU does not know %s (%s): programs that run once are compiled as "
                "the others", ONCE_OPTIONS, e)
      _refused.append(str(e))
      self._top_jitted = self.jitted
    return run(self.jitted)

  def _plain(self, *args, **kwargs):
    hits = _persistent_hits[0]
    out = self._outside_traces(lambda jitted: jitted(*args, **kwargs), args, kwargs)
    if _persistent_hits[0] != hits:
      self._loaded_plain = True
    return out

  def _load(self, store: _Store, args, kwargs, static, tree, leaves):
    """The compiled program of these arguments: loaded from the store, else compiled (and
    stored when it can be); None when it cannot be kept."""
    try:
      text = "\n".join((self._site, stable(tree), stable(static),
                        stable([_leaf_signature(x)[:3] + (str(getattr(x, "sharding", "")),)
                                for x in leaves])))
    except Unkeepable:
      return None
    path = store.path("programs", text)
    t0 = time.monotonic()
    saved = store.read(path)
    if saved is not None:
      compiled = store.load_program(saved)
      if compiled is None:  # damaged, or not a program: rebuild
        store.forget(path)
      else:
        for event in _EVENTS:
          jax.monitoring.record_event(event)
        jax.monitoring.record_event_duration_secs(_LOAD_EVENT, time.monotonic() - t0,
                                                  fun_name=f"jit({self.name})")
        store.loaded += 1
        _log.debug("Kept program loaded for '%s'", self.name)
        return compiled
    hits = _persistent_hits[0]
    with _persistent_cache_keys() as (keys, missed):
      compiled = self._outside_traces(lambda jitted: jitted.lower(*args, **kwargs).compile(),
                                      args, kwargs)
    saved = store.save_program(compiled, keys if _persistent_hits[0] != hits else None,
                               self._loaded_plain, tuple(missed))
    if saved is not None:
      store.write(path, saved)
      store.stored += 1
    return compiled


@contextlib.contextmanager
def _persistent_cache_keys() -> Iterator[tuple[list[str], list[str]]]:
  """(the keys of the entries JAX loads from its persistent cache inside the block, those it
  looks for there and misses), from its compiler's notes, which are dropped unless that logger
  shows debug messages (JAX may log a miss as a warning: that one is shown). Only this
  thread's notes count: JAX compiles in the calling thread, and another thread's compile
  (of another program) may log meanwhile."""
  keys: list[str] = []
  missed: list[str] = []
  logger = logging.getLogger("jax._src.compiler")
  level, shown = logger.level, logger.getEffectiveLevel() <= logging.DEBUG
  here = threading.get_ident()

  class Notes(logging.Filter):
    def filter(self, record):
      if (record.thread == here and isinstance(record.msg, str)
          and isinstance(record.args, tuple) and len(record.args) == 2):
        for note, found in ((_HIT_NOTE, keys), (_MISS_NOTE, missed)):
          if record.msg.startswith(note):
            found.append(str(record.args[1]))
      return shown or record.levelno > logging.DEBUG

  notes = Notes()
  logger.addFilter(notes)
  logger.setLevel(logging.DEBUG)
  try:
    yield keys, missed
  finally:
    logger.removeFilter(notes)
    logger.setLevel(level)


def _serialize_from_cache(compiled, cache_key: str) -> tuple:
  """`serialize_executable.serialize(compiled)` for a program JAX loaded from its persistent
  cache entry `cache_key`, or compiled and wrote there: the executable's bytes are that
  entry's (XLA:CPU, jaxlib 0.10.2, serialises such a loaded executable again without its
  code: loaded from those bytes, it fails when run; and a compiled one's serialisation is
  what JAX has just made for the entry). No entry: ValueError."""
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top

  cache = compilation_cache._get_cache(compiled.runtime_executable().client)  # pylint: disable=protected-access
  raw = None if cache is None else cache.get(cache_key)
  if raw is None:
    raise ValueError(f"no persistent cache entry {cache_key}")
  code, _ = compilation_cache.extract_executable_and_time(
      compilation_cache.decompress_executable(raw))
  executable = compiled._executable  # pylint: disable=protected-access
  loaded = executable.xla_executable

  class Pickler(serialize_executable._JaxPjrtPickler):  # pylint: disable=protected-access
    def persistent_id(self, obj):
      return ("exec", code) if obj is loaded else super().persistent_id(obj)

  if compiled._params.const_args:  # pylint: disable=protected-access
    raise NotImplementedError("closed-over constants")
  args_info, in_tree = jax.tree.flatten(compiled.args_info)
  with io.BytesIO() as f:
    Pickler(f).dump((executable._unloaded_executable, args_info, compiled._no_kwargs))  # pylint: disable=protected-access
    return f.getvalue(), in_tree, compiled.out_tree


def jit(fn: Callable, name: str, key: Any = (), origin: Callable | None = None,
        once: bool = False, keep: bool = True, **options) -> Kept:
  """`jax.jit(fn, **options)`, its programs kept while `keeping` is active; `name` and `key`
  tell it apart from every other program that the code location of `origin` (default `fn`:
  the function a wrapper calls) does not, e.g. the structure a closure was built for.
  `once`: a program that runs about once per structure it is built for, compiled for a short
  compile (`once_options`). `keep=False`: never kept (e.g. a static argument whose value no
  text identifies), a plain jit with the options of `once`."""
  return Kept(fn, name, key, origin, once, keep, **options)


# XLA:CPU's options for a program that runs about once per structure it is built for (an
# initialisation, a growth, a pass over data that growth or a probe runs): with the older
# elemental emitters XLA compiles them in about four fifths of the time it takes with its MLIR
# fusion emitters, and their run time is small beside their compile (benchmarks/README.md,
# "Programs that run once").
ONCE_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


_refused: list[str] = []  # why XLA refused ONCE_OPTIONS in this process, if it did


def once_options(options: dict | None = None) -> dict | None:
  """`options` (XLA compiler options) with `ONCE_OPTIONS` on top where the backend is a CPU
  (whose XLA has not refused them); elsewhere `options`."""
  if _refused or jax.default_backend() != "cpu":
    return options
  return {**(options or {}), **ONCE_OPTIONS}


def accepts(options: dict | None) -> bool:
  """Whether this process's XLA:CPU accepts the compiler options `options` (a jaxlib may drop
  one), found once by compiling a one-operation program with them."""
  return not options or _accepts(tuple(sorted(options.items())))


@functools.cache
def _accepts(items: tuple) -> bool:
  try:
    jax.jit(lambda x: x + 1).lower(jax.device_put(np.float32(0), jax.devices("cpu")[0])).compile(
        compiler_options=dict(items))
  except jax.errors.JaxRuntimeError as e:
    _log.info("XLA:CPU options %s are not available here: %s", dict(items), e)
    return False
  return True


def shapes(tree) -> str:
  """The text of `tree`'s structure and its leaves' shapes and dtypes (arrays or abstract)."""
  leaves, treedef = jax.tree.flatten(tree)
  return f"{treedef} {[(tuple(x.shape), str(x.dtype)) for x in leaves]}"


def remembered(name: str, key: Any, compute: Callable[[], Any]) -> Any:
  """`compute()` (a small picklable value), kept under (`name`, `key`) while `keeping` is
  active and read back in later processes of the same context."""
  store = _active
  if store is None:
    return compute()
  try:
    path = store.path("values", f"{name}\n{stable(key)}")
  except Unkeepable:
    return compute()
  saved = store.read(path)
  if saved is not None:
    return saved[0]
  value = compute()
  store.write(path, (value,))
  return value
