"""The grid of REPRODUCTION.md's "Beyond the paper": waiting and warm-start policies.

  python launch/sweep.py --root=/tmp/beyond --grid_file=launch/grids/beyond.py --parallel=2

The MNIST protocol of the findings grid (`launch/grids/findings.py`):
`configs/mnist_sm.py:quick` (B=500 mega-batches of 120, at most 20 epochs per
stage, patience 5), SM of width H in {4, 64}, seeds 0, 1, 2.

* The frontier of fixed waits, w in {1, 5, 10, 25, 50, 250} (fine-tuned).
* `geometric` waits, t_k = ceil(w0 * r^k): w0 in {1, 10}, r in {1.5, 2}.
* `triggered` waits: margin delta in {0.05, 0.15}, unseen fraction rho in
  {0.1, 0.5}, no minimum or maximum wait (one run per seed: each seed
  decides its own times). A mega-batch has 12 validation examples, so the
  new data's error moves in steps of 1/12 (its standard error is about 0.09
  at a 10% error): delta = 0.05 fires on most differences of one example,
  0.15 on about two standard errors.
* Warm starts at w in {1, 10}: fine-tune (the fixed waits above), scratch,
  and shrink-and-perturb with (lambda, sigma) = (0.9, 0.1), close to
  fine-tuning, and (0.6, 0.8), which keeps the variance of independent
  weights (0.6^2 + 0.8^2 = 1): this MLP has no normalisation, so a shrink
  without it (0.3, 0.1) leaves signals too small to recover from in a
  stage.

Every policy other than the fixed wait leaves `stream.wait` at 1 (the quick
variant's 10 would be refused).
"""

_SEEDS = [0, 1, 2]
_SM = ["configs/mnist_sm.py:quick"]
_H = [4, 64]

GRID = [
    # Fixed waits (fine-tune): the frontier the policies are judged against.
    {"config": _SM, "model.width": _H, "stream.wait": [1, 5, 10, 25, 50, 250], "seed": _SEEDS},
    # Geometric waits.
    {"config": _SM, "model.width": _H, "stream.wait": [1], "stream.wait_policy": ["geometric"],
     "stream.geometric_w0": [1.0, 10.0], "stream.geometric_ratio": [1.5, 2.0], "seed": _SEEDS},
    # Triggered waits.
    {"config": _SM, "model.width": _H, "stream.wait": [1], "stream.wait_policy": ["triggered"],
     "stream.trigger_margin": [0.05, 0.15], "stream.trigger_fraction": [0.1, 0.5],
     "seed": _SEEDS},
    # Warm starts against fine-tuning (the fixed waits at w = 1 and 10 above).
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10], "stream.warm_start": ["scratch"],
     "seed": _SEEDS},
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10],
     "stream.warm_start": ["shrink_perturb"], "stream.shrink": [0.9], "stream.perturb": [0.1],
     "seed": _SEEDS},
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10],
     "stream.warm_start": ["shrink_perturb"], "stream.shrink": [0.6], "stream.perturb": [0.8],
     "seed": _SEEDS},
]
