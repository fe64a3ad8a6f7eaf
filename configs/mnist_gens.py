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
The default is the paper's setting (H=64, w=1, 100 epochs): 500 members at
the end of the stream.
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "gens")
  return config_lib.apply_variant(c, arg)
