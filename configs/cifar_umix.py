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
The default is the paper's setting (N=5 members of C=64, B=100, w=1).
Options: --config.method.num_members=N, --config.method.strategy=vmap|loop.
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "umix")
  return config_lib.apply_variant(c, arg)
