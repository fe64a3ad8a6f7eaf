"""gEns (growing ensemble of MLPs) on MNIST: Adadelta, B=500.

Starts with one MLP, trained at the first stage; before every later stage
one new MLP is added and only it is trained, the older ones stay frozen. The
prediction is the mean of all members' probabilities (paper section 4.2).
See configs/cifar_gens.py for all the options.

Run:
  python -m alma_jax.main --config=configs/mnist_gens.py --workdir=/tmp/mnist_gens
Variants:
  :smoke  a few seconds: 2,000 training images, B=4 (4 members at the end), H=8,
          2 epochs.
  :quick  the whole stream (B=500) with w=10 (50 members at the end) and at most
          20 epochs per stage.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001.
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: H=64, B=500, w=1, at most 100
epochs per stage; 500 members at the end of the stream.
The paper's MNIST figures (Fig. 3 bottom, Fig. 7) sweep hidden sizes H from 4
to 64 (section 5; Appendix B.1.1 names 4, 8 and 32) and waiting times, whose
values the text does not list. The paper's other settings:
  --config.model.width=4|8|32          H
  --config.stream.wait=10              w (a divisor of B=500: 2, 5, 10, 50, ...)
  --config.stream.replay=1.0           also train on every earlier mega-batch
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "gens")
  return config_lib.apply_variant(c, arg)
