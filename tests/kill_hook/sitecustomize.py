"""Installs the test kill points (`tests/kill_points.py`) in a run started as a subprocess.

On `PYTHONPATH` only in tests. The points are installed once the run's module
(`alma_jax.stream.run`) has been imported, so that this file imports nothing of
the package (nor JAX) before the run itself does.
"""

import importlib.abc
import os
import sys

_TARGET = "alma_jax.stream.run"


class _InstallAfterRun(importlib.abc.MetaPathFinder):
  """Wraps the loading of the run's module: once it is executed, the points are installed."""

  def find_spec(self, name, path, target=None):
    if name != _TARGET:
      return None
    sys.meta_path.remove(self)
    spec = None
    for finder in sys.meta_path:
      spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
      if spec is not None:
        break
    if spec is None:
      return None
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
      if root not in sys.path:
        sys.path.insert(0, root)
      from tests import kill_points  # pylint: disable=g-import-not-at-top
      kill_points.install()
    spec.loader.exec_module = exec_module
    return spec


if os.environ.get("ALMA_JAX_TEST_KILL_AT"):
  sys.meta_path.insert(0, _InstallAfterRun())
