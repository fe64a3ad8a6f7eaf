"""How a GPU computes the Threefry hash of a run's draws (alma_jax/tuning/gpu_threefry.py).

JAX lowers a program for a platform it does not run on (`lowering_platforms`), so the
programs a GPU would compile are checked here on the CPU.
"""

import re

import chex
import jax
import pytest

from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.errors import ConfigError
from alma_jax.stream import validation
from alma_jax.tuning import gpu_threefry
from alma_jax.tuning import tune

KERNEL_CALL = "cu_threefry2x32_ffi"  # jaxlib's CUDA kernel of the hash, as a custom call


@pytest.fixture(autouse=True)
def _restore_the_setting():
  before = gpu_threefry.applied()
  yield
  gpu_threefry.apply(before)


def _init_program(setting: str, platform: str) -> tuple[str, int]:
  """(the StableHLO of MNIST SM's initialisation for `platform`, lowered with
  `train.gpu_threefry=setting`; the number of its random parameters' elements)."""
  gpu_threefry.apply(setting)
  method = methods.make(config_lib.base_config("mnist", "sm"), (28, 28, 1), 10)
  key = jax.random.key(0)
  params, _ = method.init_backbone(key)
  drawn = sum(leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(params)
              if "kernel" in jax.tree_util.keystr(path))  # the biases start at zero
  text = method._init_fn.trace(key).lower(lowering_platforms=(platform,)).as_text()  # pylint: disable=protected-access
  return text, drawn


def test_a_gpu_initialisation_calls_the_kernel_and_a_cpu_one_is_unchanged():
  assert config_lib.base_config("mnist").train.gpu_threefry == "kernel"
  (kernel, drawn), (xla, _) = _init_program("kernel", "cuda"), _init_program("xla", "cuda")
  # Two hashes, each a call of the kernel: one over the counters of every parameter drawn
  # (hashed together), one over a single counter (the fold-ins of the members' keys).
  calls = re.findall(rf"custom_call @{KERNEL_CALL}\(.*-> \(tensor<(\d+)xui32>", kernel)
  assert sorted(int(n) for n in calls) == [1, drawn]
  assert KERNEL_CALL not in xla
  # XLA's lowering writes out the hash's rounds: its rotations (a shift each way) are gone
  # from the kernel's program.
  assert xla.count("stablehlo.shift_left") >= 20 > kernel.count("stablehlo.shift_left")
  # On a CPU JAX lowers the hash the same way whatever the setting: the same program.
  assert _init_program("kernel", "cpu") == _init_program("xla", "cpu")


@pytest.mark.parametrize("setting", gpu_threefry.CHOICES)
def test_the_process_flags_apply_the_config_s_setting(monkeypatch, setting):
  monkeypatch.setattr(tune.cpu_fusion, "accelerator_expected", lambda: False)
  gpu_threefry.apply("xla" if setting == "kernel" else "kernel")
  c = config_lib.base_config("mnist", "sm")
  with c.unlocked():
    c.train.gpu_threefry = setting
  tune.process_flags(c, None, shapes=((28, 28, 1), 10), multiprocess=False)
  assert gpu_threefry.applied() == setting


def test_an_unknown_setting_is_refused_naming_the_field_and_the_allowed_values(monkeypatch):
  monkeypatch.setattr(tune.cpu_fusion, "accelerator_expected", lambda: False)
  c = config_lib.base_config("mnist", "sm")
  with c.unlocked():
    c.train.gpu_threefry = "fast"
  before = gpu_threefry.applied()
  tune.process_flags(c, None, shapes=((28, 28, 1), 10), multiprocess=False)  # left to validation
  assert gpu_threefry.applied() == before
  with pytest.raises(ConfigError, match=r"config\.train\.gpu_threefry='fast' is unknown; "
                                        r"valid values: \['kernel', 'xla'\]"):
    validation.validate(c)
  with pytest.raises(ValueError, match=r"config\.train\.gpu_threefry='fast' is unknown; "
                                       r"valid values: kernel, xla"):
    gpu_threefry.apply("fast")



def test_the_initial_parameters_are_the_same_to_the_bit_under_both_settings():
  # On a GPU this compares jaxlib's kernel with XLA's compiled rounds; on a CPU, where JAX
  # lowers the hash one way, that the setting leaves the CPU's draws alone.
  params = {}
  for setting in gpu_threefry.CHOICES:
    gpu_threefry.apply(setting)
    method = methods.make(config_lib.base_config("mnist", "sm"), (28, 28, 1), 10)
    params[setting] = method.init_backbone(jax.random.key(3))[0]
  chex.assert_trees_all_equal(params["kernel"], params["xla"])
