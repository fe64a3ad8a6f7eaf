"""P4: MNIST, gMoE grown after every stage, otherwise as P3.

  python -m alma_jax.main --config=configs/bench/p4_mnist_gmoe.py --workdir=/tmp/p4
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "gmoe")
  return config_lib.protocol(c, arg, num_megabatches=10, width=64, epochs=5)
