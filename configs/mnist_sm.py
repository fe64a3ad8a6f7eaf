"""SM (single model) on MNIST: the paper's MLP, Adadelta, B=500 mega-batches.

Run:
  python -m alma_jax.main --config=configs/mnist_sm.py --workdir=/tmp/mnist_sm
Variants (the argument after the colon):
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs (tests use it).
  :quick  the whole stream (B=500) with waiting time w=10 and at most 20 epochs
          per stage; about a minute on a 2-core CPU.
The default is the paper's setting (H=64, w=1, 100 epochs, patience 25): 500
stages of up to 100 epochs, hours on a CPU.
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "sm")
  return config_lib.apply_variant(c, arg)
