"""In CI a test that needs missing data fails instead of being skipped (tests/conftest.py)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TEST = """
from tests.conftest import requires_cifar10, requires_mnist, requires_text

@requires_mnist
def test_mnist():
  pass

@requires_cifar10
def test_cifar10():
  pass

@requires_text
def test_text():
  pass
"""


@pytest.mark.parametrize("ci,expected", [("true", "3 passed"), ("", "3 skipped")])
def test_tests_that_need_missing_data_run_in_ci_and_skip_elsewhere(tmp_path, ci, expected):
  (tmp_path / "test_data_needed.py").write_text(_TEST)
  env = dict(os.environ, PYTHONPATH=ROOT, CI=ci, TFDS_DATA_DIR=str(tmp_path / "no_data"),
             ALMA_JAX_BPE_DIR=str(tmp_path / "no_bpe"))
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "no:xdist", str(tmp_path / "test_data_needed.py")], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120, check=False)
  assert expected in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
