"""The host's CPU, named so that two kinds of host never share a name.

A virtual machine often reports a generic model name ("AMD EPYC", "Intel(R)
Xeon(R) Processor") for processors that differ in microarchitecture and in
the instruction sets XLA:CPU and oneDNN generate code for. The speed choices
measured on one host (`alma_jax.tuning`) are remembered under this name, and a
run's provenance records it: it adds the family, model and stepping (x86) or
the implementer and part (Arm) and the instruction-set extensions that decide
the kernels, e.g. "AMD EPYC (family 26, model 2, stepping 1; avx2 avx512f
avx512_bf16 avx512_vnni avx_vnni)". Read from /proc/cpuinfo, before JAX starts.
"""

from __future__ import annotations

import functools
import platform

# The extensions that change which kernels the compilers pick, in this order (x86, then Arm).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
             "amx_tile", "asimd", "sve", "sve2", "bf16", "i8mm")
# The fields of the first processor that tell its kind apart, and how they are shown.
_X86_FIELDS = (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
_ARM_FIELDS = (("CPU implementer", "implementer"), ("CPU part", "part"),
               ("CPU variant", "variant"))


def _first_processor(cpuinfo: str) -> dict[str, str]:
  """The `key: value` lines of the first processor block of a /proc/cpuinfo text."""
  fields: dict[str, str] = {}
  for line in cpuinfo.splitlines():
    if not line.strip():
      if fields:
        break
      continue
    if ":" in line:
      key, value = line.split(":", 1)
      fields.setdefault(key.strip(), value.strip())
  return fields


def describe(cpuinfo: str, fallback: str = "") -> str:
  """The name of the CPU that the /proc/cpuinfo text `cpuinfo` describes (`fallback` as its
  model name when the text has none)."""
  fields = _first_processor(cpuinfo)
  name = fields.get("model name") or fields.get("Hardware") or fallback or "unknown CPU"
  ids = [f"{shown} {fields[key]}" for key, shown in _X86_FIELDS + _ARM_FIELDS if key in fields]
  present = set((fields.get("flags") or fields.get("Features") or "").split())
  isa = [f for f in ISA_FLAGS if f in present]
  details = "; ".join(part for part in (", ".join(ids), " ".join(isa)) if part)
  return f"{name} ({details})" if details else name


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
  """This host's CPU (see the module's docstring); the platform's processor name where
  /proc/cpuinfo cannot be read."""
  return describe(read_cpuinfo(), platform.processor() or platform.machine())


def read_cpuinfo() -> str:
  """The text of /proc/cpuinfo ("" where it cannot be read)."""
  try:
    with open("/proc/cpuinfo") as f:
      return f.read()
  except OSError:
    return ""
