"""How a GPU computes the Threefry hash of a run's random draws (`train.gpu_threefry`).

Every `jax.random` draw hashes its key with Threefry-2x32, 20 rounds of 32-bit
additions, rotations and xors per element. On a GPU, JAX lowers the hash
either as those operations, which XLA:GPU compiles into the program's own
fusions (`xla`), or as one call of a kernel that jaxlib ships already
compiled (`kernel`: JAX's `jax_threefry_gpu_kernel_lowering`). Both compute the
same bits, so every parameter and every draw is the same to the bit; the
kernel writes the hash's bits to memory where XLA's fusions could have used
them in place (a dropout mask, for instance), which costs memory traffic, not
results.

The compile is what differs. The hash's operations are hundreds of HLO
instructions that XLA:GPU's fusion passes weigh against every consumer of
the bits: an initialisation, whose draws are hashed together
(`alma_jax.runtime.fused_draws`), gives its priority fusion one hash with a
consumer per parameter array. Compiled for an NVIDIA H200 on a 2-core CPU
(`benchmarks/gpu_compile_offline.py`, programs lowered as a GPU run lowers
them), P1's initialisation took 10.4-13.1 s with `xla` and 1.6-2.1 s with
`kernel`, the base Switch Transformer's 68-79 s and 3.3 s (benchmarks/README.md,
"The Threefry hash on a GPU"). Hence `kernel`, the default.

The setting is JAX's, for the whole process, and means nothing on a CPU or a
TPU (JAX lowers the hash for XLA there either way); set before anything is
traced (`alma_jax.tuning.tune.process_flags`). Speed only: it may change on
resume.
"""

from __future__ import annotations

import jax  # importing JAX starts no backend

FIELD = "train.gpu_threefry"
CHOICES = ("kernel", "xla")
JAX_OPTION = "jax_threefry_gpu_kernel_lowering"


def apply(setting: str) -> None:
  """Sets this process's lowering of the Threefry hash on a GPU for `setting` (`CHOICES`)."""
  if setting not in CHOICES:
    raise ValueError(f"config.{FIELD}={setting!r} is unknown; valid values: "
                     f"{', '.join(CHOICES)}")
  jax.config.update(JAX_OPTION, setting == "kernel")


def applied() -> str:
  """The setting in effect in this process (`CHOICES`)."""
  return "kernel" if getattr(jax.config, JAX_OPTION) else "xla"
