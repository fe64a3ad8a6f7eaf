"""P2: CIFAR-10, Ens with 5 members, otherwise as P1.

  python -m alma_jax.main --config=configs/bench/p2_cifar_ens.py --workdir=/tmp/p2
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "ens")
  return config_lib.protocol(c, arg, num_megabatches=10, width=16, epochs=2)
