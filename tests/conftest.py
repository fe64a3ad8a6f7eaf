"""Test setup: 8 CPU devices (to exercise sharding), shared data, a private cache."""

import os
import tempfile

# The suite's time goes to compiling small programs on a CPU, where XLA's optimisation passes
# cost more than they save; set before JAX is imported, and inherited by the runs the tests
# start as subprocesses. Export JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test optimised programs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # pylint: disable=g-import-not-at-top

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


