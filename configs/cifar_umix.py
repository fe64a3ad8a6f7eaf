"""UMix (uniform mixture: the mean of N VGGs' logits) on CIFAR-10: SGD, B=100.

One model whose output is the average of its N members' logits, trained on
the cross-entropy of that average (one data order; every member keeps its
own BatchNorm statistics), the same model at train and test time (paper
section 4.1).

Run:
  python -m alma_jax.main --config=configs/cifar_umix.py --workdir=/tmp/cifar_umix
Variants:
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage; five networks, so about five times cifar_sm.py:quick.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience=100.
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: N=5 members of C=64, B=100,
w=1, at most 100 epochs per stage.
The paper's CIFAR-10 figures sweep widths C from 4 to 64 (section 5; Appendix
B.1.2 names 4, 8 and 32 channels) and waiting times (section 6.1 and Fig. 3
name w = 2, 10 and 100; Fig. 4 is w=10 with and without replay); w=1 is not
among the waiting times the text names. The paper's other settings:
  --config.model.width=4|8|32          C
  --config.stream.wait=2|10|100        w (a divisor of B=100)
  --config.stream.replay=1.0           also train on every earlier mega-batch
Options: --config.method.num_members=N, --config.method.strategy=vmap|loop.
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "umix")
  return config_lib.apply_variant(c, arg)
