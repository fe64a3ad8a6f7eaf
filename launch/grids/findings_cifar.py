"""The CIFAR-10 grid of REPRODUCTION.md: the findings F1-F4 on a reduced protocol, 3 seeds.

  python launch/sweep.py --root=/tmp/findings_cifar --grid_file=launch/grids/findings_cifar.py \
      --parallel=1

The protocol (`configs/cifar_<method>.py:quick` with the fields of `_PROTOCOL`):
a random 40% of the CIFAR-10 training set (20,000 images) as a stream of
B = 10 mega-batches of 2,000 (10% of each its validation set), the reduced
VGG with BatchNorm of width C, SGD as in the paper (lr 0.01, momentum 0.9,
weight decay 1e-4, batch 128, crop+flip), exactly 4 epochs per stage (no
early stopping), and the test error of 2,000 test images after every stage.
The speed choices follow the rules (`train.autotune=rules`), so every run
makes the same ones on any machine and none is timed.
Seeds 0, 1, 2 for every point (stream order, subset, initialisation, data
order); each seed is its own run (separate runs are faster than vmapped
seeds for the VGG on a CPU).

  F1  waiting time, small and larger model: SM, C in {4, 16}, w in {1, 2, 5}
  F2  width: SM at w = 1, C in {4, 8, 16, 32}
  F3  Ens vs UMix vs SM at two widths: N = 3 members (the released code's
      N; the paper's 5 would take 5/3 the time), C in {4, 16}, w = 1
  F4  growing methods against fixed ones at equal compute: gEns, gMoE and
      Firefly from C = 8, w = 1, against SM C in {8, 16, 32} above

The grid expands to 15 points x 3 seeds = 45 runs. The sweep resumes: run
the command again after an interruption and it skips the finished runs.

Time on an idle 2-core CPU, estimated from one measured run of each kind
(REPRODUCTION.md, "CIFAR-10"): about 80 minutes for the 45 runs with
`--parallel=1`, caches cold (`benchmarks/README.md` for the measurement
commands).
"""

_SEEDS = [0, 1, 2]
# The reduced protocol: 40% of the training set in 10 mega-batches, 4 epochs per stage.
_PROTOCOL = {"data.train_subset": [20000], "data.test_subset": [2000],
             "stream.num_megabatches": [10], "train.epochs": [4], "train.patience": [4],
             "train.autotune": ["rules"]}
_SM = ["configs/cifar_sm.py:quick"]


def _grid(config, **fields):
  """One sub-grid: `config` files, the protocol's fields, `fields` (dots as "__"), the seeds."""
  out = {"config": config, **_PROTOCOL}
  out.update({k.replace("__", "."): v for k, v in fields.items()})
  out["seed"] = _SEEDS
  return out


GRID = [
    # F2 (width) at w = 1; the fixed models of F4.
    _grid(_SM, model__width=[4, 8, 16, 32], stream__wait=[1]),
    # F1: waiting time for a small and a larger model (w = 1 is above).
    _grid(_SM, model__width=[4, 16], stream__wait=[2, 5]),
    # F3: Ens and UMix with 3 members against SM of the same widths (above).
    _grid(["configs/cifar_ens.py:quick", "configs/cifar_umix.py:quick"], model__width=[4, 16],
          method__num_members=[3], stream__wait=[1]),
    # F4: growing methods from C = 8, against SM C = 8, 16, 32 at equal compute.
    _grid(["configs/cifar_gens.py:quick", "configs/cifar_gmoe.py:quick",
           "configs/cifar_ff.py:quick"], model__width=[8], stream__wait=[1]),
]
