"""XLA's GPU autotuning level for a run's process (`train.gpu_autotune`).

While it compiles a program, XLA:GPU times candidate kernels for its matrix
products and convolutions and keeps the fastest (`--xla_gpu_autotune_level`,
default 4; 0 turns it off). That buys faster steps with compile time, and the
persistent compilation cache keeps the tuned programs, so a later run of the
same shapes pays neither. Measured on one NVIDIA H200 (jax 0.11.2), P1
(`configs/bench/p1_cifar_sm.py`, VGG at C = 16, about 800 train steps) on a
cold cache: level 4 compiled for 47.4 s and trained 3.4 s (evaluation 0.4 s);
level 0 compiled for 13.6 s and trained 5.4 s (evaluation 1.7 s): 33.8 s less
compiling for 3.3 s more stepping, about 4 ms per train step. The base Switch
Transformer's evaluation program alone compiled for 37.1 s at level 4 and
3.6 s at level 0 (`benchmarks/compile_budget.py`).

The rule of `auto`, applied when an accelerator backend is expected: level 0
when the run plans fewer than `MIN_STEPS` train steps (the compile time saved
by P1's measurement over the time lost per step, rounded down), XLA's default
otherwise. The planned steps are counted from the config before JAX starts
(`config_lib.planned_steps`: an upper bound, every stage running all its epochs; a data
set of unknown size counts as long). A run on a CPU leaves `XLA_FLAGS` alone:
the flag means nothing to XLA:CPU, and setting it would only change the keys
of the persistent cache. An `XLA_FLAGS` that already sets the flag wins. The
level is a speed choice: the learned function is the same, only the kernels
(and so float round-off) may differ.
"""

from __future__ import annotations

from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.runtime import xla_flags

FIELD = "train.gpu_autotune"
FLAG = "--xla_gpu_autotune_level"
LEVELS = ("0", "1", "2", "3", "4")
CHOICES = ("auto",) + LEVELS
XLA_DEFAULT = "4"
# A run this short is better off without what costs compile time for faster steps.
MIN_STEPS = config_lib.SHORT_RUN_STEPS


def choose(config, accelerator: bool) -> tuple[str | None, str]:
  """(level, how it was decided) for `config`; level None: `XLA_FLAGS` stays as it is (no
  accelerator expected)."""
  given = [v for v in xla_flags.values(FLAG) if v]
  if given:
    return given[-1], f"set in XLA_FLAGS ({xla_flags.current()})"
  if not accelerator:
    return None, "not set (no accelerator expected)"
  setting = F.get(config.train, FIELD)
  if setting != "auto":
    return setting, "set in the config"
  steps = config_lib.planned_steps(config)
  if steps is None:
    return XLA_DEFAULT, "by rule (the data's size is unknown before loading it)"
  if steps < MIN_STEPS:
    return "0", f"by rule ({steps:,} planned train steps < {MIN_STEPS:,}: no autotuning)"
  return XLA_DEFAULT, f"by rule ({steps:,} planned train steps >= {MIN_STEPS:,})"


def flags_with(level: str, current: str) -> str:
  """`XLA_FLAGS` with the autotuning `level`, the other flags of `current` kept."""
  return xla_flags.replaced(current, (FLAG,), (f"{FLAG}={level}",))


def apply(level: str) -> None:
  """Sets this process's `XLA_FLAGS` for `level`; must run before JAX starts its backend."""
  if level in LEVELS:
    xla_flags.replace((FLAG,), (f"{FLAG}={level}",))
