"""P1: CIFAR-10, SM, VGG C=16, B=10, w=1, no replay, exactly 2 epochs per stage.

A reference protocol for timing whole runs (benchmarks/end_to_end.py):
  python -m alma_jax.main --config=configs/bench/p1_cifar_sm.py --workdir=/tmp/p1
Batch 128, crop+flip, SGD as in the paper; no early stopping within the 2
epochs (patience = epochs); the test error is evaluated after every stage.
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "sm")
  return config_lib.protocol(c, arg, num_megabatches=10, width=16, epochs=2)
