"""The collector's pace in a run's process."""

import gc
import subprocess
import sys

from alma_jax.runtime import collector
from tests import helpers


def test_pace_sets_the_thresholds():
  old = gc.get_threshold()
  try:
    gc.set_threshold(700, 10, 10)
    collector.pace()
    assert gc.get_threshold() == collector.THRESHOLDS
  finally:
    gc.set_threshold(*old)


_MAIN_THEN_THRESHOLDS = """
import gc, runpy, sys
gc.set_threshold(700, 10, 10)
sys.argv = ["alma_jax.main", "--config=configs/mnist_sm.py:smoke", "--print_config"]
try:
  runpy.run_module("alma_jax.main", run_name="__main__")
except SystemExit as e:
  if e.code:
    raise
print("THRESHOLDS", gc.get_threshold())
"""


def test_the_entry_point_paces_its_process_s_collector():
  proc = subprocess.run([sys.executable, "-c", _MAIN_THEN_THRESHOLDS], cwd=helpers.ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"THRESHOLDS {collector.THRESHOLDS}" in proc.stdout, proc.stdout[-2000:]
