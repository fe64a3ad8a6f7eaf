"""P3: MNIST, SM, MLP H=64, B=10, w=1, no replay, exactly 5 epochs per stage.

  python -m alma_jax.main --config=configs/bench/p3_mnist_sm.py --workdir=/tmp/p3
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "sm")
  return config_lib.protocol(c, arg, num_megabatches=10, width=64, epochs=5)
