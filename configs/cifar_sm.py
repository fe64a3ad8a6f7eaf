"""SM (single model) on CIFAR-10: reduced VGG19 with BatchNorm, SGD, B=100.

Run:
  python -m alma_jax.main --config=configs/cifar_sm.py --workdir=/tmp/cifar_sm
Variants:
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage; minutes on a 2-core CPU.
The default is the paper's setting (C=64, B=100, w=1, 100 epochs, SGD lr 0.01,
momentum 0.9, weight decay 1e-4, crop+flip): days on a CPU, meant for a GPU.
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "sm")
  return config_lib.apply_variant(c, arg)
