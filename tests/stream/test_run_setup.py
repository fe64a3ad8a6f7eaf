"""The run's set-up (alma_jax/stream/run_setup.py): a model too large for the machine's memory is
refused from its shapes, before anything is allocated or compiled."""

import jax
import pytest

from alma_jax import methods
from alma_jax.errors import ConfigError
from alma_jax.stream import run
from alma_jax.stream import run_setup
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist


def _method(width):
  config = validation.complete(helpers.small_config(width=width))
  return methods.make(config, *validation.KNOWN_SHAPES["mnist"])


def test_parameters_over_the_memory_are_refused_with_an_estimate():
  keys = jax.random.split(jax.random.key(0), 2)
  method = _method(16)
  run_setup.check_parameter_memory(method, keys, limit=2**30, what="1 GiB")
  with pytest.raises(ConfigError, match=r"^config\.model \(name='mlp', width=16\): the parameters "
                                        r"alone would need 101\.6 KiB \(13,002 per learner x 2 "
                                        r"seed\(s\)\), more than 1 KiB \(1\.0 KiB\)"):
    run_setup.check_parameter_memory(method, keys, limit=1024, what="1 KiB")


def test_a_billion_wide_model_is_refused_against_this_machines_memory():
  keys = jax.random.split(jax.random.key(0), 1)
  with pytest.raises(ConfigError, match=r"width=1000000000\): the parameters alone would need "
                                        r"[\d,.]+ TiB \([\d,]+ per learner x 1 seed\(s\)\), "
                                        r"more than "):
    run_setup.check_parameter_memory(_method(10**9), keys)


@requires_mnist
def test_a_run_of_a_model_too_large_stops_with_one_error(tmp_path):
  with pytest.raises(ConfigError, match=r"width=1000000000\): the parameters alone would need"):
    run.run(helpers.smoke(model__width=10**9), str(tmp_path / "wd"))
