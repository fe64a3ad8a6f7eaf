"""UMix (uniform mixture: the mean of N MLPs' logits) on MNIST: Adadelta, B=500.

One model whose output is the average of its N members' logits, trained on
the cross-entropy of that average (one data order), so training and test use
the same model (paper section 4.1).

Run:
  python -m alma_jax.main --config=configs/mnist_umix.py --workdir=/tmp/mnist_umix
Variants:
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs.
  :quick  the whole stream (B=500) with w=10 and at most 20 epochs per stage.
The default is the paper's setting (N=5 members of H=64, w=1, 100 epochs).
Options: --config.method.num_members=N, --config.method.strategy=vmap|loop.
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "umix")
  return config_lib.apply_variant(c, arg)
