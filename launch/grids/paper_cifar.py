"""The paper's CIFAR-10 grid (section 5, Appendix B.1.2, Figs. 2-4), for accelerators.

  python launch/sweep.py --root=/data/paper_cifar --grid_file=launch/grids/paper_cifar.py
  # or a SLURM array script, one GPU per run (launch/slurm.py; --submit runs sbatch):
  python launch/sweep.py --root=/data/paper_cifar --grid_file=launch/grids/paper_cifar.py \
      --slurm=paper_cifar.sbatch --slurm_option=--time=12:00:00

The paper's setting (the configs' defaults, no variant): the whole training
set as B = 100 mega-batches, 10% of each its validation set, the reduced
VGG with BatchNorm, at most 100 epochs per stage with patience 25, SGD lr
0.01, momentum 0.9, weight decay 1e-4, batch 128, crop+flip. Every method
(SM, Ens and UMix with N = 5, gEns, gMoE, Firefly) at widths C in {4, 8,
16, 32, 64} and waiting times w in {2, 10, 100} (the ones the paper names),
and with replay of every earlier mega-batch at w = 10 (Fig. 4), seeds 0, 1, 2:
6 x 5 x (3 + 1) = 120 points, 360 runs.

Estimated GPU-hours (`python launch/grids/paper_cifar.py` prints the table):
about 750 on one H100 per run (SM 45, Ens and UMix 226 each, gEns 45,
gMoE 113, Firefly 90), an upper bound. The arithmetic, from one
reference measurement: P1 (`configs/bench/p1_cifar_sm.py`: SM, C = 16,
B = 10, 2 epochs per stage over the whole training set, 90,000 training
images) trained in 3.7 s on one H100 (reported in benchmarks/README.md; not
re-measured here), i.e. 24,000 training images per second. A run here trains
on 45,000 images x 100 epochs = 4.5M images (early stopping only shortens
it), replay at w = 10 on 5.5 times as many (stage k trains on k of the 10
stages' data); evaluation and compilation add an assumed 50%. Time scales
with the training compute: the width as (C / 16)^2 from C = 16 up and as 1
below (an accelerator is launch-bound there; an upper bound for C >= 32 if
C = 16 is launch-bound too), and the method as its trained networks: Ens and
UMix 5, gEns 1 (one new member per stage; its growing evaluation is in the
50%), gMoE 2.5 and Firefly 2 (their average size over the stream).
"""

_SEEDS = [0, 1, 2]
_CONFIGS = [f"configs/cifar_{m}.py" for m in ("sm", "ens", "umix", "gens", "gmoe", "ff")]
_WIDTHS = [4, 8, 16, 32, 64]

GRID = [
    # Waiting time x width x method, no replay (Figs. 2 and 3).
    {"config": _CONFIGS, "model.width": _WIDTHS, "stream.wait": [2, 10, 100], "seed": _SEEDS},
    # Replay of every earlier mega-batch at w = 10 (Fig. 4).
    {"config": _CONFIGS, "model.width": _WIDTHS, "stream.wait": [10], "stream.replay": [1.0],
     "seed": _SEEDS},
]

# -- the estimate -----------------------------------------------------------------------------------
P1_TRAIN_IMAGES_PER_S = 90_000 / 3.7  # P1 on one H100 (benchmarks/README.md)
IMAGES_PER_RUN = 45_000 * 100  # training images x epochs, no early stopping
REPLAY_FACTOR = sum(range(1, 11)) / 10  # w = 10: stage k trains on k stages' data (5.5)
OVERHEAD = 1.5  # evaluation, compilation, start-up (assumed)
METHOD_FACTOR = {"sm": 1.0, "ens": 5.0, "umix": 5.0, "gens": 1.0, "gmoe": 2.5, "ff": 2.0}


def width_factor(c: int) -> float:
  return max(1.0, (c / 16) ** 2)


def gpu_hours() -> dict[str, float]:
  """Estimated H100-hours of each method's runs (all widths, waits, replay and seeds)."""
  base_s = IMAGES_PER_RUN / P1_TRAIN_IMAGES_PER_S * OVERHEAD
  per_seed_and_width = 3 + REPLAY_FACTOR  # three waits, and replay at w = 10
  return {m: base_s * f * sum(width_factor(c) for c in _WIDTHS) * per_seed_and_width
          * len(_SEEDS) / 3600 for m, f in METHOD_FACTOR.items()}


if __name__ == "__main__":
  hours = gpu_hours()
  for method, h in hours.items():
    print(f"{method:5s} {h:8.1f} GPU-hours")
  print(f"total {sum(hours.values()):8.1f} GPU-hours (one H100 per run; an upper bound)")
