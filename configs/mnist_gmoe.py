"""gMoE (growing tree-gated mixture of experts) on MNIST: the paper's MLP, Adadelta, B=500.

Both hidden layers of the MLP are mixtures. Before a training stage (every
grow_every-th one but the first; by default about 10 growths over the
stream) each layer splits the expert with the largest cumulative loss on the
new stage's validation data (paper Appendix A), so a split is trained before
it counts.

Run:
  python -m alma_jax.main --config=configs/mnist_gmoe.py --workdir=/tmp/mnist_gmoe
Variants (the argument after the colon):
  :smoke  a few seconds: 2,000 training images, B=4, H=8, 2 epochs (tests use it).
  :quick  the whole stream (B=500) with waiting time w=10 and at most 20 epochs
          per stage (50 stages, a split every grow_every of them); minutes on a CPU.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001,
          method.grow_every=1 (a split before every stage but the first).
          :quick,paper (or paper,quick) keeps quick's reductions: 49 splits
          per layer over its 50 stages, much slower than :quick.
The default is ONE setting, not the paper's sweep: H=64, B=500, w=1, at most 100
epochs per stage with patience 25, soft gating, one initial expert; meant for
a GPU (soft gating runs every expert; how many a layer reaches depends on
config.method.grow_every).
The paper's MNIST figures (Fig. 3 bottom, Fig. 7) sweep hidden sizes H from 4
to 64 (section 5; Appendix B.1.1 names 4, 8 and 32) and waiting times, whose
values the text does not list. The paper's other settings:
  --config.model.width=4|8|32          H
  --config.stream.wait=10              w (a divisor of B=500: 2, 5, 10, 50, ...)
  --config.stream.replay=1.0           also train on every earlier mega-batch
Ablations on the command line:
  --config.method.gating=hard          hard gating (straight-through estimator)
  --config.method.split_by=usage       the released code's split criterion
  --config.method.initial_experts=2    the released code's initial mixture
  --config.method.grow=False --config.method.initial_experts=4   fixed MoE
  --config.method.tree=False           flat gating (not function-preserving)
Speed (the same growth; records differ in float round-off):
  --config.method.slots=planned        every layer's planned experts in slots from the
                                       start: one compiled structure (the default, auto:
                                       planned for a short run on a GPU or TPU, pow2
                                       elsewhere)
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("mnist", "gmoe")
  return config_lib.apply_variant(c, arg)
