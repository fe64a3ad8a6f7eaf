"""glibc's allocator settings of a run's process (alma_jax/tuning/cpu_tuning.py)."""

import json
import os
import subprocess
import sys

import pytest

from alma_jax.configuration import config_lib
from alma_jax.errors import ConfigError
from alma_jax.stream import validation
from alma_jax.tuning import cpu_tuning
from tests import helpers


@pytest.mark.parametrize("setting, conv_heavy, accelerator, expected", [
    ("auto", True, False, "tuned"),  # a convolution-heavy backbone on a CPU
    ("auto", False, False, "glibc"),  # an MLP or a transformer on a CPU: faster compiles
    ("auto", True, True, "glibc"),  # an accelerator: the settings are for XLA:CPU's buffers
    ("tuned", False, True, "tuned"),
    ("glibc", True, False, "glibc"),
])
def test_the_rule_and_the_config(monkeypatch, setting, conv_heavy, accelerator, expected):
  monkeypatch.delenv(cpu_tuning.ENV, raising=False)
  value, how = cpu_tuning.choose(setting, conv_heavy=conv_heavy, accelerator=accelerator)
  assert value == expected
  assert ("set in the config" in how) == (setting != "auto")


def test_the_environment_turns_it_off_whatever_the_config(monkeypatch):
  monkeypatch.setenv(cpu_tuning.ENV, "0")
  assert cpu_tuning.choose("tuned", conv_heavy=True, accelerator=False) == (
      "glibc", f"({cpu_tuning.ENV}=0 in the environment)")


def test_an_unknown_setting_is_refused_naming_the_field_and_the_allowed_values():
  with pytest.raises(ValueError, match=r"config\.train\.cpu_allocator='fast'; allowed: auto, "
                                       r"tuned, glibc"):
    cpu_tuning.choose("fast", conv_heavy=True, accelerator=False)
  c = helpers.smoke()
  with c.unlocked():
    c.train.cpu_allocator = "fast"
  with pytest.raises(ConfigError, match=r"config\.train\.cpu_allocator='fast' is unknown"):
    validation.validate(c)
  assert config_lib.base_config("mnist").train.cpu_allocator == "auto"


_PROCESS_FLAGS = """
import json, sys
from absl import logging
logging.set_verbosity(logging.INFO)
from alma_jax.stream import config_resolve
from alma_jax.tuning import cpu_tuning, tune
c = config_resolve.resolve(sys.argv[1], ["--config.train.cpu_fusion=none", *sys.argv[2:]])
tune.process_flags(c, None, shapes=None, multiprocess=False)
print(json.dumps(cpu_tuning.is_applied()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tuning is Linux-only")
@pytest.mark.parametrize("config, extra, expected", [
    ("configs/bench/p1_cifar_sm.py", [], "tuned"),  # the VGG
    ("configs/bench/p3_mnist_sm.py", [], "glibc"),  # the MLP
    ("configs/bench/p3_mnist_sm.py", ["--config.train.cpu_allocator=tuned"], "tuned"),
])
def test_the_process_flags_tune_the_allocator_by_the_backbone(config, extra, expected):
  # Its own process: the settings last for the process that makes them.
  env = {k: v for k, v in os.environ.items() if k != cpu_tuning.ENV}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", _PROCESS_FLAGS, config, *extra],
                        cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == (expected == "tuned")
  assert f"train.cpu_allocator: {expected!r}" in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tuning is Linux-only")
@pytest.mark.parametrize("backbones, setting, expected", [
    ("vgg", "auto", True), ("mlp", "auto", False), ("vgg,mlp", "auto", False),
    ("mlp", "tuned", True), ("vgg", "glibc", False),
])
def test_a_benchmark_tunes_as_runs_of_its_backbones_would(backbones, setting, expected):
  code = ("import sys; from alma_jax.tuning import cpu_tuning, tune; "
          "print(tune.allocator_for(sys.argv[1].split(','), sys.argv[2]), "
          "cpu_tuning.is_applied())")
  env = {k: v for k, v in os.environ.items() if k != cpu_tuning.ENV}
  proc = subprocess.run([sys.executable, "-c", code, backbones, setting], cwd=helpers.ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == [str(expected)] * 2
