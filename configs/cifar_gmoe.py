"""gMoE (growing tree-gated mixture of experts) on CIFAR-10: reduced VGG19, SGD, B=100.

The four VGG blocks after the first are mixtures (the first block and the
classifier are shared); a block's gate is a 4x4 average pool of its input,
flattened, then a linear map per tree node. Before a training stage (every
grow_every-th one but the first; by default about 10 growths over the
stream) each mixture splits the expert with the largest cumulative loss on
the new stage's validation data.

Run:
  python -m alma_jax.main --config=configs/cifar_gmoe.py --workdir=/tmp/cifar_gmoe
Variants:
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage; minutes on a 2-core CPU.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001,
          optimizer.kwargs.nesterov=True, method.grow_every=1 (a split before
          every stage but the first).
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: C=64, B=100, w=1, at most 100
epochs per stage, SGD lr 0.01, momentum 0.9, weight decay 1e-4, crop+flip,
soft gating; meant for a GPU (how many experts a block reaches depends on
config.method.grow_every).
The paper's CIFAR-10 figures sweep widths C from 4 to 64 (section 5; Appendix
B.1.2 names 4, 8 and 32 channels) and waiting times (section 6.1 and Fig. 3
name w = 2, 10 and 100; Fig. 4 is w=10 with and without replay); w=1 is not
among the waiting times the text names. The paper's other settings:
  --config.model.width=4|8|32          C
  --config.stream.wait=2|10|100        w (a divisor of B=100)
  --config.stream.replay=1.0           also train on every earlier mega-batch
The released code trained gMoE with Nesterov momentum and PyTorch's
initialisation (both set by :paper): --config.optimizer.kwargs.nesterov=True
--config.model.init=torch.
The early version's ablations (its section 5.2) grow every 2 stages from 2
experts:
  --config.method.initial_experts=2 --config.method.grow_every=2
  --config.method.tree=False                        flat gating
  --config.method.grow=False                        fixed MoE (2 experts per block)
Hard gating at test time still runs every VGG expert (see alma_jax/methods/gmoe.py).
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "gmoe")
  return config_lib.apply_variant(c, arg)
