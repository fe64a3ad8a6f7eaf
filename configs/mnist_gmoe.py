"""gMoE (growing tree-gated mixture of experts) on MNIST: the paper's MLP, Adadelta, B=500.

Both hidden layers of the MLP are mixtures; after every training stage each
layer splits the expert with the largest cumulative validation loss (paper
Appendix A).

Run:
  python -m alma_jax.main --config=configs/mnist_gmoe.py --workdir=/tmp/mnist_gmoe
Variants (the argument after the colon):
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs (tests use it).
  :quick  the whole stream (B=500) with waiting time w=10 and at most 20 epochs
          per stage (50 stages, so up to 51 experts per layer); minutes on a CPU.
The default is the paper's setting (H=64, w=1, 100 epochs, patience 25, soft
gating, one initial expert): 500 stages, so up to 501 experts per layer (soft
gating runs them all); meant for a GPU. Ablations on the command line:
  --config.method.gating=hard          hard gating (straight-through estimator)
  --config.method.split_by=usage       the released code's split criterion
  --config.method.initial_experts=2    the released code's initial mixture
  --config.method.grow=False --config.method.initial_experts=4   fixed MoE
  --config.method.tree=False           flat gating (not function-preserving)
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "gmoe")
  return config_lib.apply_variant(c, arg)
