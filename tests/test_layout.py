"""The package layout: capability subpackages, an acyclic import graph, tests that mirror the
package, and the Python API of `alma_jax/__init__.py`."""

import ast
import os
import sys

import ml_collections
import pytest

import alma_jax
from tests import helpers
from tests.conftest import requires_mnist

PACKAGE = os.path.join(helpers.ROOT, "alma_jax")
ROOT_MODULES = {"__init__", "main", "errors"}


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, helpers.ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, modules) -> tuple[set[str], list[str]]:
  """(alma_jax modules imported at module level, those imported inside functions)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  top, local = set(), []

  def names(node):
    if isinstance(node, ast.Import):
      return [a.name for a in node.names]
    base = node.module or ""  # `from pkg import mod` depends on pkg.mod, else on pkg
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      found = [n for n in names(node) if n.startswith("alma_jax")]
      (top.update(found) if node in tree.body else local.extend(found))
  return top, local


def test_package_imports_form_a_dag_without_function_local_imports():
  modules = {}
  for root, dirs, files in os.walk(PACKAGE):
    dirs[:] = [d for d in dirs if d not in ("configs", "__pycache__")]
    for name in files:
      if name.endswith(".py"):
        modules[_module_name(os.path.join(root, name))] = os.path.join(root, name)
  graph, local = {}, {}
  for mod, path in modules.items():
    top, inner = _imports(path, modules)
    graph[mod] = {m for m in top if m in modules and m != mod}
    # Importing a.b.c first runs a.b's __init__ (unless the importer is inside a.b already).
    mine = {mod.rsplit(".", k)[0] for k in range(1, mod.count(".") + 1)} | {mod}
    for target in list(graph[mod]):
      parts = target.split(".")
      graph[mod] |= {".".join(parts[:k]) for k in range(2, len(parts))} - mine
    if path.endswith("__init__.py") and "pkgutil.iter_modules" in open(path).read():
      # A package that imports every module of its own (methods, policies) depends on them.
      graph[mod] |= {m for m in modules if m.rsplit(".", 1)[0] == mod}
    if inner:
      local[mod] = inner
  # main.py imports the run lazily on purpose (allocator tuning first), the package root's
  # API imports what each function needs when called (importing the package stays light), and
  # the report imports JAX's side (a checkpoint restored for a gating figure) only to draw its
  # gating figures (a report of result files starts without JAX); nothing else may.
  assert set(local) <= {"alma_jax.main", "alma_jax", "alma_jax.reports.report"}, local
  assert sorted(local.get("alma_jax.reports.report", [])) == [
      "alma_jax.outputs.checkpoint", "alma_jax.reports.gating_plot"], local
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        raise AssertionError(f"import cycle: {' -> '.join(stack + [m, n])}")
      if n not in state:
        visit(n, stack + [m])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [])


def test_tests_mirror_the_package():
  test_root = os.path.join(helpers.ROOT, "tests")
  folders = {d for d in os.listdir(test_root)  # test packages (kill_hook is a path entry)
             if os.path.exists(os.path.join(test_root, d, "__init__.py"))}
  packages = {d for d in os.listdir(PACKAGE) if os.path.exists(os.path.join(PACKAGE, d, "__init__.py"))}
  assert folders <= packages, sorted(folders - packages)
  for folder in folders:
    assert any(f.startswith("test_") for f in os.listdir(os.path.join(test_root, folder))), folder


def test_load_config_takes_a_name_or_a_path_with_a_variant():
  by_name = alma_jax.load_config("mnist_sm:smoke")
  by_path = alma_jax.load_config(os.path.join(helpers.ROOT, "configs", "mnist_sm.py") + ":smoke")
  assert by_name.to_dict() == by_path.to_dict()
  assert by_name.to_dict() != alma_jax.load_config("mnist_sm").to_dict()
  with pytest.raises(ValueError, match="mnist_sm"):
    alma_jax.load_config("mnsit_sm")
  # An error names the config as the caller did, not the file its name stands for.
  with pytest.raises(ValueError, match=r"^--config=mnist_sm:smok: .*config variant 'smok' is "
                                       r"unknown; valid: \['paper', 'smoke', 'quick'\]"):
    alma_jax.load_config("mnist_sm:smok")


@pytest.mark.parametrize("call, message", [
    (lambda: alma_jax.load_config(None), r"^load_config\(spec\): spec must be a config's name "
     r"or path as a string, e.g. 'mnist_sm:quick'; got NoneType None$"),
    (lambda: alma_jax.run({"seed": 0}, "/nonexistent"), r"^run\(config, workdir\): config must "
     r"be a config \(load_config's\) or a config's name or path, e.g. 'mnist_sm:quick'; got dict$"),
    (lambda: alma_jax.run("mnist_sm:smoke", None), r"^run\(config, workdir\): workdir must be "
     r"a folder's path, a string or a path object, e\.g\. '/tmp/mnist_sm'; got NoneType None$"),
    (lambda: alma_jax.read_results(3), r"^read_results\(workdir\): workdir must be a folder's "
     r"path, a string or a path object, e\.g\. '/tmp/mnist_sm'; got int 3$"),
], ids=["load_config", "run", "run_workdir", "read_results"])
def test_the_api_refuses_an_argument_of_another_type_by_its_name(call, message):
  with pytest.raises(TypeError, match=message):
    call()


def test_the_api_takes_a_config_s_name_and_its_errors_name_its_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"^--config=mnist_sm:smok: "):
    alma_jax.run("mnist_sm:smok", str(tmp_path))
  with pytest.raises(ValueError, match=r"^workdir: .* is not a run's workdir: it lacks "
                                       r"config\.json and log\.jsonl"):
    alma_jax.read_results(str(tmp_path))


# Below the run's set-up, code reads the run's frozen options (`configuration/options.py`).
_BELOW_SET_UP = ("alma_jax.engine", "alma_jax.methods", "alma_jax.tasks", "alma_jax.policies",
                 "alma_jax.models", "alma_jax.observers", "alma_jax.outputs", "alma_jax.data",
                 "alma_jax.state", "alma_jax.runtime")


def _config_dict_readers(monkeypatch) -> set:
  """Patches ConfigDict's reads to note each module below the set-up that reads one (through
  `fields.get` and the like too: the nearest caller outside `alma_jax.configuration`)."""
  readers = set()

  def spy(read):
    def wrapped(self, *args, **kwargs):
      frame = sys._getframe(1)  # pylint: disable=protected-access
      while frame is not None and frame.f_globals.get("__name__", "").startswith(
          ("alma_jax.configuration", "ml_collections")):
        frame = frame.f_back
      caller = frame.f_globals.get("__name__", "") if frame is not None else ""
      if caller.startswith(_BELOW_SET_UP):
        readers.add(f"{caller}:{frame.f_code.co_name}")
      return read(self, *args, **kwargs)
    return wrapped

  for name in ("__getattr__", "__getitem__", "get", "__contains__"):
    monkeypatch.setattr(ml_collections.ConfigDict, name,
                        spy(getattr(ml_collections.ConfigDict, name)))
  return readers


@requires_mnist
def test_run_and_read_results(tmp_path, monkeypatch):
  config = alma_jax.load_config("mnist_gmoe:smoke")
  readers = _config_dict_readers(monkeypatch)
  summary = alma_jax.run(config, tmp_path)  # a path object, as a string
  assert not readers, sorted(readers)  # nothing below the set-up reads the ConfigDict
  (seed,) = alma_jax.read_results(tmp_path)
  assert seed.summary == summary
  # One record per time step, t = 0 (before any data) to B.
  assert [r["t"] for r in seed.records] == list(range(config.stream.num_megabatches + 1))
  assert seed.curve("test_error").shape == (config.stream.num_megabatches + 1,)


# The package's layers, bottom first: a package (or a module named as `package.module`) may
# import its own layer's modules and those of the layers below it, never one above. `state` and
# `errors` are the ground floor every layer names; the engine trains one stage of a population;
# the observers write what a run did; the stream layer builds a run and runs Algorithm 1 over the
# engine; the reports read finished runs (their plotting library is below the observers, which
# draw a run's figure); `main` and the package's API sit on top.
LAYERS = (
    ("errors", "state"),
    ("runtime",),
    ("kernels",),
    ("configuration",),
    ("outputs",),
    ("data",),
    ("models",),
    ("tasks",),
    ("policies",),
    ("methods",),
    ("engine",),
    ("tuning",),
    ("reports.plots", "reports.plot_style", "reports.labels"),
    ("observers",),
    ("stream",),
    ("reports",),
    ("main", "alma_jax"),
)


def _layer_of(module: str) -> int:
  parts = module.split(".")
  for name in (".".join(parts[1:3]), parts[1] if len(parts) > 1 else parts[0]):
    for i, names in enumerate(LAYERS):
      if name in names:
        return i
  raise AssertionError(f"{module} is in no layer of LAYERS; add its package there")


def test_packages_import_only_their_own_layer_and_the_layers_below():
  upward, modules = [], set()
  for root, dirs, files in os.walk(PACKAGE):
    dirs[:] = [d for d in dirs if d not in ("configs", "__pycache__")]
    modules |= {_module_name(os.path.join(root, f)) for f in files if f.endswith(".py")}
  for root, dirs, files in os.walk(PACKAGE):
    dirs[:] = [d for d in dirs if d not in ("configs", "__pycache__")]
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(root, name)
      mod = _module_name(path)
      top, _ = _imports(path, modules)
      for target in top:
        if target != "alma_jax" and _layer_of(target) > _layer_of(mod):
          upward.append(f"{mod} imports {target}")
  assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_every_package_is_in_a_layer():
  packages = {d for d in os.listdir(PACKAGE) if os.path.exists(os.path.join(PACKAGE, d, "__init__.py"))}
  modules = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}
  layered = {n for names in LAYERS for n in names}
  assert packages | modules <= layered, sorted((packages | modules) - layered)


def test_the_package_holds_no_test_hooks():
  """Tests install their kill points around the package's functions (`tests/kill_points.py`);
  the package itself reads no test-only setting."""
  found = []
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
          if "ALMA_JAX_TEST_" in f.read():
            found.append(os.path.relpath(os.path.join(root, name), helpers.ROOT))
  assert not found, found
