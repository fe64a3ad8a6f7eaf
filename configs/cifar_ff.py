"""FF (Firefly) on CIFAR-10: a reduced VGG19 with BatchNorm that grows wider, SGD, B=100.

Before every stage but the first, FF fits candidate neurons on the stage's data (a split of
every neuron into two halves w +- eps v, and K new neurons per layer), scores each by the
derivative of the loss with respect to its size, and adds the best n_grow = growth_rate x the
initial total width (paper B.1: 0.25, i.e. 64 neurons per growth at C=16) across the 16 conv
layers; see alma_jax/methods/firefly.py. architecture.jsonl lists the widths after each stage.

Run:
  python -m alma_jax.main --config=configs/cifar_ff.py --workdir=/tmp/cifar_ff
Variants:
  :smoke  about a minute on a 2-core CPU, most of it compiling: 800 training / 500 test
          images, B=4, C=4, 2 epochs, K=4 candidates, one growth (before stage 3).
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per stage, as
          cifar_sm.py:quick; K=16 new-neuron candidates per layer fitted and scored on 1024
          examples, and a growth every 3rd stage (before stages 4, 7 and 10), so that it runs
          in tens of minutes on a 2-core CPU (the candidate network is 3x wider than the
          learner and every growth compiles new programs).
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001,
          optimizer.kwargs.nesterov=True, method.epsilon=1 (the released
          unscaled splits).
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is the paper's setting (C=64, B=100, w=1, 100 epochs, patience 25, SGD lr 0.01,
momentum 0.9, weight decay 1e-4, crop+flip) with the released code's Firefly settings:
meant for a GPU.

Options (override any with --config.method.<field>=<value>):
  growth_rate    neurons added per growth / initial total width (0.25; released config: 0.6).
  grow_every     grow before every this many-th stage (1).
  num_new        K, new-neuron candidates per layer (released code: 70).
  epsilon        split halves w +- eps v, new outgoing weights eps b (0.01; 0 keeps the
                 function exactly; the released code's splits are unscaled, eps = 1).
  split_init, new_in_init, new_out_init   initial candidate scales (0.1, 0.1, 0.01).
  split_penalty, new_penalty, fit_lr      the fit: 1e-2 |v|^2 + 1e-4 |a|^2, RMSprop lr 1e-3.
  fit_examples   fit and score on at most this many of the stage's examples (0: all).
train.eval_batch_size is 128: the candidate fit takes one RMSprop step per batch of its pass,
as the released code did per training batch. train.keep_optimizer_state must stay False.
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "ff")
  c = config_lib.apply_variant(c, arg)
  c.train.eval_batch_size = 128
  variants = config_lib.variant_names(arg)
  if "smoke" in variants:
    c.method.num_new = 4
    c.method.grow_every = 2
  elif "quick" in variants:
    c.method.num_new = 16
    c.method.fit_examples = 1024
    c.method.grow_every = 3
  return c
