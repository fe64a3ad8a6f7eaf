"""FF (Firefly) on MNIST: an MLP whose two hidden layers grow wider, Adadelta, B=500.

The same method as configs/cifar_ff.py (see it and alma_jax/methods/firefly.py for the
options) with one width per hidden layer: before every stage but the first, n_grow =
growth_rate x the initial total width neurons (0.25 x 2H) are added by splitting neurons or
adding new ones, the best-scored of the candidates fitted on the stage's data.

Run:
  python -m alma_jax.main --config=configs/mnist_ff.py --workdir=/tmp/mnist_ff
Variants:
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs.
  :quick  the whole stream (B=500) with w=10 and at most 20 epochs per stage, every layer
          in at least 256 channel slots (method.min_slots: fewer structures to compile).
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001,
          method.epsilon=1 (the released unscaled splits).
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is the paper's setting (H=64, w=1, 100 epochs) with K=70 new-neuron candidates.
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "ff")
  c = config_lib.apply_variant(c, arg)
  c.train.eval_batch_size = 128
  return c
