"""The host's CPU name (alma_jax/runtime/host.py): hosts of one model name told apart."""

import json
import platform

from alma_jax.runtime import host
from alma_jax.tuning import autotune
from alma_jax.tuning import cpu_fusion
from tests import helpers


def _x86(name, family, model, flags, stepping=1):
  block = (f"processor\t: {{i}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\n"
           f"model\t\t: {model}\nmodel name\t: {name}\nstepping\t: {stepping}\n"
           f"flags\t\t: fpu sse2 {flags}\n\n")
  return block.format(i=0) + block.format(i=1)


ZEN3 = _x86("AMD EPYC", 25, 1, "avx avx2 fma")
ZEN4 = _x86("AMD EPYC", 25, 17, "avx2 avx512f avx512bw avx512_bf16 avx512_vnni")
ZEN5 = _x86("AMD EPYC", 26, 2, "avx2 avx512f avx512_bf16 avx512_vnni avx_vnni")
SAPPHIRE = _x86("Intel(R) Xeon(R) Processor", 6, 143,
                "avx2 avx512f avx512_bf16 avx512_fp16 avx512_vnni avx_vnni amx_tile amx_bf16")
ARM = ("processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd aes crc32 sve sve2 bf16 i8mm\n"
       "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd4f\n\n")


def test_a_cpu_is_named_by_its_model_family_stepping_and_instruction_sets():
  assert host.describe(ZEN5) == (
      "AMD EPYC (family 26, model 2, stepping 1; avx2 avx512f avx512_bf16 avx512_vnni avx_vnni)")
  assert host.describe(ZEN3) == "AMD EPYC (family 25, model 1, stepping 1; avx2)"
  assert host.describe(SAPPHIRE) == (
      "Intel(R) Xeon(R) Processor (family 6, model 143, stepping 1; avx2 avx512f avx512_bf16 "
      "avx512_fp16 avx512_vnni avx_vnni amx_tile)")
  # Arm's cpuinfo has no model name: the platform's processor name, and its implementer and part.
  assert host.describe(ARM, "aarch64") == (
      "aarch64 (implementer 0x41, part 0xd4f, variant 0x0; asimd sve sve2 bf16 i8mm)")
  assert host.describe("", "x86_64") == "x86_64"
  assert host.describe("") == "unknown CPU"


def test_hosts_that_share_a_model_name_have_different_names():
  names = [host.describe(text) for text in (ZEN3, ZEN4, ZEN5)]
  assert len(set(names)) == 3
  # A stepping alone (the same flags) tells two hosts apart too.
  assert host.describe(_x86("AMD EPYC", 25, 1, "avx2", stepping=0)) != host.describe(ZEN3)


def test_this_host_is_read_once_and_named_with_its_model_name():
  name = host.cpu_name()
  assert name and name is host.cpu_name()
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:  # not Linux: the platform's name
    assert name == (platform.processor() or platform.machine() or "unknown CPU")
    return
  assert name == host.describe(text, platform.processor() or platform.machine())
  assert name.startswith(host._first_processor(text).get("model name", ""))  # pylint: disable=protected-access


def test_the_choices_of_one_cpu_are_not_those_of_another(monkeypatch):
  # A remembered choice is found under its key: two hosts with one model name (a cache folder
  # shared by a cluster's nodes) each measure their own.
  c = helpers.small_config("cifar10", "sm")
  keys = {}
  for text in (ZEN3, ZEN5):
    monkeypatch.setattr(host, "cpu_name", lambda text=text: host.describe(text))
    keys[text] = (autotune.machine_key(c, (32, 32, 3), autotune.STEP_FUSION),
                  cpu_fusion.process_key(c, (32, 32, 3)))
    assert json.loads(keys[text][0])["cpu"] == host.describe(text)
    assert json.loads(keys[text][1])["cpu"] == host.describe(text)
  assert keys[ZEN3][0] != keys[ZEN5][0] and keys[ZEN3][1] != keys[ZEN5][1]
