"""SM (single model) on MNIST: the paper's MLP, Adadelta, B=500 mega-batches.

Run:
  python -m alma_jax.main --config=configs/mnist_sm.py --workdir=/tmp/mnist_sm
Variants (the argument after the colon):
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs (tests use it).
  :quick  the whole stream (B=500) with waiting time w=10 and at most 20 epochs
          per stage; about a minute on a 2-core CPU.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001.
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: B=500, w=1, H=64, at most 100
epochs per stage with patience 25 (the released code's), Adadelta lr 1: 500
stages, hours on a CPU.
The paper's MNIST figures (Fig. 3 bottom, Fig. 7) sweep hidden sizes H from 4
to 64 (section 5; Appendix B.1.1 names 4, 8 and 32) and waiting times, whose
values the text does not list. The paper's other settings:
  --config.model.width=4|8|32          H
  --config.stream.wait=10              w (a divisor of B=500: 2, 5, 10, 50, ...)
  --config.stream.replay=1.0           also train on every earlier mega-batch
The released code's choices (both set by :paper): --config.model.init=torch
(PyTorch's default initialisation), --config.train.patience_delta=0.001.
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "sm")
  return config_lib.apply_variant(c, arg)
