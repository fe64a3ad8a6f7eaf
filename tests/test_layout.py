"""The package layout: capability subpackages, an acyclic import graph, tests that mirror the
package, and the Python API of `alma_jax/__init__.py`."""

import ast
import os

import pytest

import alma_jax
from tests import helpers
from tests.conftest import requires_mnist

PACKAGE = os.path.join(helpers.ROOT, "alma_jax")
ROOT_MODULES = {"__init__", "main", "errors"}


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every module of the package (configs aside)."""
  out = {}
  for folder, dirs, files in os.walk(PACKAGE):
    dirs[:] = [d for d in dirs if d not in ("configs", "__pycache__")]
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, f), helpers.ROOT)[:-3].replace(os.sep, ".")
        out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
  return out


def _module_level_imports(path: str, modules: dict[str, str]) -> set[str]:
  """The package's modules that `path` imports when it is imported (not inside functions)."""
  tree = ast.parse(open(path).read())
  found = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # `from package import module` needs the module; `from module import name`, the module.
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
               for a in node.names]
    else:
      continue
    found.update(n for n in names if n in modules)
  return found


def test_the_package_root_keeps_only_the_entry_point_errors_and_api():
  flat = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
  assert flat == ROOT_MODULES


def test_module_imports_form_a_dag():
  modules = _modules()
  graph = {m: _module_level_imports(p, modules) - {m} for m, p in modules.items()}
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        cycle = stack[stack.index(n):] + [n]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if n not in state:
        visit(n)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)


def test_the_schema_and_errors_import_nothing_of_the_package_but_each_other():
  modules = _modules()
  leaves = {"alma_jax.errors", "alma_jax.configuration.fields"}
  for leaf in leaves:
    assert _module_level_imports(modules[leaf], modules) <= leaves | {"alma_jax",
                                                                     "alma_jax.configuration"}


def test_tests_mirror_the_package():
  test_root = os.path.join(helpers.ROOT, "tests")
  folders = {d for d in os.listdir(test_root)
             if os.path.isdir(os.path.join(test_root, d)) and d != "__pycache__"}
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


@requires_mnist
def test_run_and_read_results(tmp_path):
  config = alma_jax.load_config("mnist_sm:smoke")
  summary = alma_jax.core.run(config, str(tmp_path))
  (seed,) = alma_jax.read_results(str(tmp_path))
  assert seed.summary == summary
  # One record per time step, t = 0 (before any data) to B.
  assert [r["t"] for r in seed.records] == list(range(config.stream.num_megabatches + 1))
  assert seed.curve("test_error").shape == (config.stream.num_megabatches + 1,)
