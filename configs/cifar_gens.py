"""gEns (growing ensemble) on CIFAR-10: reduced VGG19 with BatchNorm, SGD, B=100.

Start here. gEns (paper section 4.2) is an ensemble that grows with the data:
  * it starts with `initial_members` networks (1), all trained at the first
    stage, as SM would be;
  * before every later stage it appends `grow_by` new networks (k=1) and
    trains only them on the stage's data, each with its own data order; the
    older members stay frozen (their weights and BatchNorm statistics never
    change again);
  * it predicts the mean of all members' probabilities.
So the training cost per stage stays that of k networks, while the memory
and the inference cost grow by k networks per stage: with w=1 and B=100 it
ends with 100 members. The log's num_params counts all members, train_flops
the steps of the trained members only, inference FLOPs all members.

Run:
  python -m alma_jax.main --config=configs/cifar_gens.py --workdir=/tmp/cifar_gens
Variants (the argument after the colon):
  :smoke  seconds: 800 training / 500 test images, B=4, C=4, 2 epochs.
  :quick  the whole training set in B=10 mega-batches, C=16, 3 epochs per
          stage: 10 members at the end, one trained per stage.
  :paper  the paper's values (or, where it is silent, the released code's) of the
          fields whose defaults are neither: model.init=torch, train.patience_delta=0.001.
          :quick,paper (or paper,quick) keeps quick's reductions.
The default is ONE setting, not the paper's sweep: C=64, B=100, w=1, at most 100
epochs per stage with patience 25, SGD lr 0.01, momentum 0.9, weight decay
1e-4, crop+flip; meant for a GPU.
The paper's CIFAR-10 figures sweep widths C from 4 to 64 (section 5; Appendix
B.1.2 names 4, 8 and 32 channels) and waiting times (section 6.1 and Fig. 3
name w = 2, 10 and 100; Fig. 4 is w=10 with and without replay); w=1 is not
among the waiting times the text names. The paper's other settings:
  --config.model.width=4|8|32          C
  --config.stream.wait=2|10|100        w (a divisor of B=100)
  --config.stream.replay=1.0           also train on every earlier mega-batch

Options (override any with --config.method.<field>=<value>):
  initial_members  networks at the start, trained at the first stage (1).
  grow_by          k: networks added and trained at every later stage (paper: 1).
  new_member       "copy" (default): a copy of the last member, which then keeps training
                   (the released code; the paper's section 6.1 remark on replay
                   fits it); "fresh": a new randomly initialised network (the
                   paper's section 4.2 does not say which).
  strategy         how the members run inside the compiled step: "vmap" (one
                   batched computation), "loop" (one network after the other in
                   the same compiled function) or "auto" (loop for the VGG on CPU,
                   where vmapped convolutions are slow; vmap otherwise; see
                   benchmarks/ensemble_strategy.py).
Related fields: --config.stream.wait=W trains (and grows) every W mega-batches;
--config.stream.replay=R also trains the new member on a fraction R of past
data; --config.stream.init_from_scratch=True makes new members fresh even with
new_member="copy". config.train.keep_optimizer_state must stay False (each
stage trains different networks).
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("cifar10", "gens")
  return config_lib.apply_variant(c, arg)
