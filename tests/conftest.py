"""Test setup: 8 CPU devices (to exercise sharding), shared data, a private cache."""

import os
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHARED = os.path.join(os.path.dirname(_ROOT), "shared", "tensorflow_datasets")
if "TFDS_DATA_DIR" not in os.environ and os.path.isdir(_SHARED):
  os.environ["TFDS_DATA_DIR"] = _SHARED
_BPE = os.path.join(os.path.dirname(_ROOT), "shared", "gpt2_bpe")
if "ALMA_JAX_BPE_DIR" not in os.environ and os.path.isdir(_BPE):
  os.environ["ALMA_JAX_BPE_DIR"] = _BPE
os.environ.setdefault("ALMA_JAX_CACHE_DIR", tempfile.mkdtemp(prefix="alma_jax_test_cache_"))

import pytest  # pylint: disable=g-import-not-at-top


def data_available(name: str) -> bool:
  d = os.environ.get("TFDS_DATA_DIR", "")
  return bool(d) and os.path.isdir(os.path.join(d, name))


requires_mnist = pytest.mark.skipif(not data_available("mnist"),
                                    reason="prepared MNIST not found under $TFDS_DATA_DIR")
requires_cifar10 = pytest.mark.skipif(not data_available("cifar10"),
                                      reason="prepared CIFAR-10 not found under $TFDS_DATA_DIR")


@pytest.fixture(scope="module")
def fast_compilation():
  """For modules whose time goes to compiling on a CPU, where XLA's optimisations only slow
  them down (`pytestmark = pytest.mark.usefixtures("fast_compilation")`)."""
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)
