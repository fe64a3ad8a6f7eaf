"""SM (single model) on CIFAR-10: reduced VGG19 with BatchNorm, SGD, B=100.

Run:
  python -m alma_jax.main --config=configs/cifar_sm.py --workdir=/tmp/cifar_sm
Variants:
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage; minutes on a 2-core CPU.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001.
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: B=100, w=1, C=64, at most
100 epochs per stage with patience 25 (the released code's), SGD lr 0.01,
momentum 0.9, weight decay 1e-4, crop+flip: days on a CPU, meant for a GPU.
The paper's CIFAR-10 figures sweep widths C from 4 to 64 (section 5; Appendix
B.1.2 names 4, 8 and 32 channels) and waiting times (section 6.1 and Fig. 3
name w = 2, 10 and 100; Fig. 4 is w=10 with and without replay); w=1 is not
among the waiting times the text names. The paper's other settings:
  --config.model.width=4|8|32          C
  --config.stream.wait=2|10|100        w (a divisor of B=100)
  --config.stream.replay=1.0           also train on every earlier mega-batch
The released code's choices (both set by :paper): --config.model.init=torch
(PyTorch's default initialisation), --config.train.patience_delta=0.001.
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "sm")
  return config_lib.apply_variant(c, arg)
