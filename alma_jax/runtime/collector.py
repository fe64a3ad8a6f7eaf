"""The pace of Python's cyclic garbage collector in a run's process.

Tracing a program builds and drops many small objects, so the collector's
default pace (a young-generation pass every 700 net allocations) spends a
noticeable share of a tracing-heavy process: 6-17% of the in-process tests'
time, about 8% of a cold `configs/cifar_gmoe.py:smoke` run on a 2-core CPU.
Objects in reference cycles are still freed, a little later; nothing else
changes.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 100)  # young-generation allocations, then passes per older generation


def pace() -> None:
  """Sets the collector's thresholds for a tracing-heavy process (`THRESHOLDS`)."""
  gc.set_threshold(*THRESHOLDS)
