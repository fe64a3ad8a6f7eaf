"""XLA's GPU autotuning level of a run's process (alma_jax/tuning/gpu_autotune.py)."""

import importlib.util
import os

import pytest

from alma_jax.configuration import config_lib
from alma_jax.errors import ConfigError
from alma_jax.stream import validation
from alma_jax.tuning import gpu_autotune
from alma_jax.tuning import tune
from tests import helpers


def _config(name: str, **fields):
  """`get_config` of a config file ("path[:variant]", relative to the project) with `fields`."""
  path, _, variant = name.partition(":")
  spec = importlib.util.spec_from_file_location("config_file", os.path.join(helpers.ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(variant or None)
  with c.unlocked():
    for path, value in fields.items():
      section, field = path.split(".")
      c[section][field] = value
  return c


def test_planned_steps_of_p1_are_counted_by_hand():
  # 10 mega-batches of 50,000 / 10 images, no replay, 2 epochs of ceil(5,000 / 128) = 40 steps.
  c = _config("configs/bench/p1_cifar_sm.py")
  assert config_lib.planned_steps(c) == 10 * 2 * 40
  assert gpu_autotune.choose(c, accelerator=True) == (
      "0", "by rule (800 planned train steps < 8,000: no autotuning)")


def test_planned_steps_with_replay_and_a_wait():
  # B = 4 mega-batches of 250 examples, trained at t = 2, 4 (w = 2) on the new 500 examples
  # plus half of the 500 older ones at t = 4: ceil(500 / 100) + ceil(750 / 100) steps per epoch.
  c = _config("configs/mnist_sm.py", **{"data.train_subset": 1000, "stream.num_megabatches": 4,
                                        "stream.wait": 2, "stream.replay": 0.5,
                                        "train.batch_size": 100, "train.epochs": 3})
  assert config_lib.planned_steps(c) == 3 * (5 + 8)


def test_a_long_text_run_keeps_xla_s_autotuning():
  c = _config("configs/lm_sm.py")  # base: 4 stages of 120,000 steps
  assert config_lib.planned_steps(c) == 4 * 120000
  level, how = gpu_autotune.choose(c, accelerator=True)
  assert level == gpu_autotune.XLA_DEFAULT and "480,000 planned train steps >= 8,000" in how
  quick = _config("configs/lm_sm.py:quick")
  assert gpu_autotune.choose(quick, accelerator=True)[0] == "0"  # 4 x 80 steps


def test_a_data_set_of_unknown_size_counts_as_long(monkeypatch):
  monkeypatch.delitem(config_lib.TRAIN_SIZES, "cifar10")
  c = _config("configs/bench/p1_cifar_sm.py")
  assert config_lib.planned_steps(c) is None
  assert gpu_autotune.choose(c, accelerator=True)[0] == gpu_autotune.XLA_DEFAULT


def test_the_config_the_environment_and_the_backend_decide_in_that_order(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  c = _config("configs/bench/p1_cifar_sm.py", **{"train.gpu_autotune": "2"})
  assert gpu_autotune.choose(c, accelerator=True) == ("2", "set in the config")
  assert gpu_autotune.choose(c, accelerator=False)[0] is None  # a CPU: XLA_FLAGS left alone
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=3 --other=1")
  assert gpu_autotune.choose(c, accelerator=True)[0] == "3"
  assert gpu_autotune.flags_with("0", os.environ["XLA_FLAGS"]) == (
      "--other=1 --xla_gpu_autotune_level=0")


@pytest.mark.parametrize("accelerator", [True, False])
def test_the_process_flags_set_and_record_the_level_only_on_an_accelerator(monkeypatch,
                                                                          accelerator):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  monkeypatch.setattr(tune.cpu_fusion, "accelerator_expected", lambda: accelerator)
  c = _config("configs/bench/p3_mnist_sm.py")
  tune.process_flags(c, None, shapes=((28, 28, 1), 10), multiprocess=False)
  if accelerator:
    assert os.environ["XLA_FLAGS"].split() == ["--xla_cpu_enable_fast_math=false",
                                               "--xla_gpu_autotune_level=0"]
    assert tune._gpu_level == ["0"]  # pylint: disable=protected-access
  else:
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    assert not tune._gpu_level  # pylint: disable=protected-access
  tune._gpu_level.clear()  # pylint: disable=protected-access


def test_an_unknown_level_is_refused_naming_the_field_and_the_allowed_values():
  c = _config("configs/mnist_sm.py:smoke", **{"train.gpu_autotune": "5"})
  with pytest.raises(ConfigError, match=r"config\.train\.gpu_autotune='5' is unknown; valid "
                                        r"values: \['0', '1', '2', '3', '4', 'auto'\]"):
    validation.validate(c)
  assert config_lib.base_config("mnist").train.gpu_autotune == "auto"
