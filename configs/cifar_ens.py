"""Ens (an ensemble of N independently trained VGGs) on CIFAR-10: SGD, B=100.

Each member (a reduced VGG19 with BatchNorm) has its own random
initialisation, data order and BatchNorm statistics and is trained on every
stage's data; the prediction is the mean of the members' probabilities
(paper section 4.1).

Run:
  python -m alma_jax.main --config=configs/cifar_ens.py --workdir=/tmp/cifar_ens
Variants:
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage; five networks, so about five times cifar_sm.py:quick.
The default is the paper's setting (N=5 members of C=64, B=100, w=1, 100
epochs, SGD lr 0.01, momentum 0.9, weight decay 1e-4, crop+flip).
Options:
  --config.method.num_members=3         N (paper: 5; released code: 3)
  --config.method.strategy=vmap|loop    how members run in the compiled step
                                        (auto: loop on CPU, vmap elsewhere)
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "ens")
  return config_lib.apply_variant(c, arg)
