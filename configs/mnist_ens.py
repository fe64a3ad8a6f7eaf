"""Ens (an ensemble of N independently trained MLPs) on MNIST: Adadelta, B=500.

Each member has its own random initialisation and its own data order and is
trained on every stage's data; the prediction is the mean of the members'
probabilities (paper section 4.1).

Run:
  python -m alma_jax.main --config=configs/mnist_ens.py --workdir=/tmp/mnist_ens
Variants (the argument after the colon):
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs (tests use it).
  :quick  the whole stream (B=500) with waiting time w=10 and at most 20 epochs
          per stage.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience=100.
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: N=5 members of H=64, B=500,
w=1, at most 100 epochs per stage with patience 25.
The paper's MNIST figures (Fig. 3 bottom, Fig. 7) sweep hidden sizes H from 4
to 64 (section 5; Appendix B.1.1 names 4, 8 and 32) and waiting times, whose
values the text does not list. The paper's other settings:
  --config.model.width=4|8|32          H
  --config.stream.wait=10              w (a divisor of B=500: 2, 5, 10, 50, ...)
  --config.stream.replay=1.0           also train on every earlier mega-batch
Options:
  --config.method.num_members=3         N (paper: 5; released code: 3)
  --config.method.strategy=vmap|loop    how members run in the compiled step
                                        (auto: vmap for the MLP)
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "ens")
  return config_lib.apply_variant(c, arg)
