"""SM (single model) on CIFAR-10 with a ResNet-18 for 32x32 inputs: SGD, B=100.

The backbone is `alma_jax/models/resnet.py` (a 3x3 stem, 4 stages of 2
BasicBlocks with C, 2C, 4C, 8C channels, global average pooling, a linear
classifier) in place of the paper's reduced VGG19; everything else is
configs/cifar_sm.py.

Run:
  python -m alma_jax.main --config=configs/cifar_sm_resnet.py --workdir=/tmp/cifar_sm_resnet
Variants:
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage; minutes on a 2-core CPU.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001 (the
          ResNet stays).
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting: B=100, w=1, C=64 (the usual ResNet-18, 11.2M
parameters), at most 100 epochs per stage with patience 25, SGD lr 0.01,
momentum 0.9, weight decay 1e-4, crop+flip: meant for a GPU.
Options:
  --config.model.width=4|8|16|32        C, the channels of the first stage
  --config.stream.wait=2|10|100         w (a divisor of B=100)
  --config.method.name=ens|umix|gens    the other methods on the same backbone (not gmoe
                                        or ff: the ResNet declares no mixture points and
                                        no growable width layout)
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "sm")
  c.model.name = "resnet"
  return config_lib.apply_variant(c, arg)
