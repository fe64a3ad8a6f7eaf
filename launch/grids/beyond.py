"""The grid of REPRODUCTION.md's "Beyond the paper": waiting policies, and warm starts that
keep a learner plastic.

  python launch/sweep.py --root=/tmp/beyond --grid_file=launch/grids/beyond.py --parallel=2

The MNIST protocol of the findings grid (`launch/grids/findings.py`):
`configs/mnist_sm.py:quick` (B=500 mega-batches of 120, at most 20 epochs per
stage, patience 5), SM of width H in {4, 64}, seeds 0, 1, 2. Every run records the
plasticity diagnostics (`log.plasticity`: dormant units, the effective rank of the last
hidden layer, the distance from the initial parameters), which the report draws
against t (`plasticity_mnist.png`).

* Warm starts at w in {1, 10}: fine-tune, scratch, shrink-and-perturb with
  (lambda, sigma) = (0.6, 0.8), which keeps the variance of independent
  weights (0.6^2 + 0.8^2 = 1; this MLP has no normalisation, so a shrink
  without it leaves signals too small to recover from in a stage), and the
  three plasticity-preserving policies: `redo` (re-draw the units whose score
  is at most tau = 0.025 before each stage), `continual_backprop` (re-draw the
  5% least useful units trained by at least 2 stages, before each stage) and
  `l2_init` (c = 1e-3: at H = 64, c ||theta - theta_0||^2 is a few percent of
  the cross-entropy once the weights have moved by ~ their initial norm).
* The frontier of fixed waits, w in {1, 5, 10, 25, 50, 250} (fine-tuned).
* `geometric` waits, t_k = ceil(w0 * r^k): w0 in {1, 10}, r = 2.
* `triggered` waits: margin delta = 0.15, unseen fraction rho in {0.1, 0.5},
  no minimum or maximum wait (one run per seed: each seed decides its own
  times). A mega-batch has 12 validation examples, so the new data's error
  moves in steps of 1/12 (its standard error is about 0.09 at a 10% error):
  delta = 0.15 fires on about two standard errors.

Every policy other than the fixed wait leaves `stream.wait` at 1 (the quick
variant's 10 would be refused).

The CIFAR-10 slice: SM with C = 16 at w = 1, on the reduced protocol of the CIFAR-10
findings grid (`launch/grids/findings_cifar.py`: 20,000 training images in B = 10
mega-batches, early stopping with patience 2 within 8 epochs, 2,000 test images), the six
warm starts above with their settings, seeds 0-2, each seed its own run (the VGG on a CPU).

The points are chosen to fit about 90 minutes on an idle 2-core CPU (seeds are kept,
points are trimmed). TIME_S (at the end) holds each run's measured time, which the sweep's
ETA scales to the host it runs on (`run_seconds`).

FINDINGS (`alma_jax.reports.findings`) are the claims of the literature that the grid
tests, each against fine-tuning at the same data set, width and w (B1-B6), and whether a
geometric wait beats the fixed ones (B7), with Welch's t over the seeds.
"""

_SEEDS = [0, 1, 2]
_SM = ["configs/mnist_sm.py:quick"]
_H = [4, 64]
_ON = {"log.plasticity": [True]}
# The CIFAR-10 protocol of launch/grids/findings_cifar.py, at C = 16 and w = 1.
_CIFAR = {"data.train_subset": [20000], "data.test_subset": [2000],
          "stream.num_megabatches": [10], "train.epochs": [8], "train.patience": [2],
          "train.autotune": ["rules"], "model.width": [16], "stream.wait": [1]}

GRID = [
    # Fixed waits (fine-tune): the frontier every other policy is judged against.
    {"config": _SM, "model.width": _H, "stream.wait": [1, 5, 10, 25, 50, 250], "seed": _SEEDS,
     **_ON},
    # Warm starts against fine-tuning (the fixed waits at w = 1 and 10 above).
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10], "stream.warm_start": ["scratch"],
     "seed": _SEEDS, **_ON},
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10],
     "stream.warm_start": ["shrink_perturb"], "stream.shrink": [0.6], "stream.perturb": [0.8],
     "seed": _SEEDS, **_ON},
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10], "stream.warm_start": ["redo"],
     "stream.redo_threshold": [0.025], "seed": _SEEDS, **_ON},
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10],
     "stream.warm_start": ["continual_backprop"], "stream.cbp_fraction": [0.05],
     "stream.cbp_maturity": [2], "seed": _SEEDS, **_ON},
    {"config": _SM, "model.width": _H, "stream.wait": [1, 10], "stream.warm_start": ["l2_init"],
     "train.l2_init": [1e-3], "seed": _SEEDS, **_ON},
    # The CIFAR-10 slice: the warm starts at C = 16, w = 1.
    {"config": ["configs/cifar_sm.py:quick"], **_CIFAR, "stream.warm_start": ["finetune"],
     "seed": _SEEDS, **_ON},
    {"config": ["configs/cifar_sm.py:quick"], **_CIFAR, "stream.warm_start": ["scratch"],
     "seed": _SEEDS, **_ON},
    {"config": ["configs/cifar_sm.py:quick"], **_CIFAR, "stream.warm_start": ["shrink_perturb"],
     "stream.shrink": [0.6], "stream.perturb": [0.8], "seed": _SEEDS, **_ON},
    {"config": ["configs/cifar_sm.py:quick"], **_CIFAR, "stream.warm_start": ["redo"],
     "stream.redo_threshold": [0.025], "seed": _SEEDS, **_ON},
    {"config": ["configs/cifar_sm.py:quick"], **_CIFAR, "stream.warm_start": [
        "continual_backprop"], "stream.cbp_fraction": [0.05], "stream.cbp_maturity": [2],
     "seed": _SEEDS, **_ON},
    {"config": ["configs/cifar_sm.py:quick"], **_CIFAR, "stream.warm_start": ["l2_init"],
     "train.l2_init": [1e-3], "seed": _SEEDS, **_ON},
    # Geometric waits.
    {"config": _SM, "model.width": _H, "stream.wait": [1], "stream.wait_policy": ["geometric"],
     "stream.geometric_w0": [1.0, 10.0], "stream.geometric_ratio": [2.0], "seed": _SEEDS,
     **_ON},
    # Triggered waits.
    {"config": _SM, "model.width": _H, "stream.wait": [1], "stream.wait_policy": ["triggered"],
     "stream.trigger_margin": [0.15], "stream.trigger_fraction": [0.1, 0.5], "seed": _SEEDS,
     **_ON},
]


def _warm(width, wait, policy="finetune", data="mnist"):
  return {"data.name": data, "method.name": "sm", "model.width": width, "stream.wait": wait,
          "stream.warm_start": policy, "stream.wait_policy": "fixed"}


# (width, wait, data set) of every warm-start comparison: MNIST's four, CIFAR-10's one.
_POINTS = [(h, w, "mnist") for h in _H for w in (1, 10)] + [(16, 1, "cifar10")]

FINDINGS = [
    {"id": "B1", "claim": "re-drawing dormant units (ReDo) lowers the CER of fine-tuning",
     "comparisons": [{"better": _warm(h, w, "redo", d), "worse": _warm(h, w, data=d)}
                     for h, w, d in _POINTS]},
    {"id": "B2", "claim": "continual backprop lowers the CER of fine-tuning",
     "comparisons": [{"better": _warm(h, w, "continual_backprop", d),
                      "worse": _warm(h, w, data=d)} for h, w, d in _POINTS]},
    {"id": "B3", "claim": "L2 Init lowers the CER of fine-tuning",
     "comparisons": [{"better": _warm(h, w, "l2_init", d), "worse": _warm(h, w, data=d)}
                     for h, w, d in _POINTS]},
    {"id": "B4", "claim": "shrink-and-perturb lowers the CER of fine-tuning",
     "comparisons": [{"better": _warm(h, w, "shrink_perturb", d),
                      "worse": _warm(h, w, data=d)} for h, w, d in _POINTS]},
    {"id": "B5", "claim": "fine-tuning beats training every stage from scratch (the paper's "
     "warm start)",
     "comparisons": [{"better": _warm(h, w, data=d), "worse": _warm(h, w, "scratch", d)}
                     for h, w, d in _POINTS]},
    {"id": "B6", "claim": "fine-tuning leaves more dormant units than ReDo at the end of the "
     "stream", "metric": "final_dormant_fraction",
     "comparisons": [{"better": _warm(h, w, "redo", d), "worse": _warm(h, w, data=d)}
                     for h, w, d in _POINTS]},
    {"id": "B7", "claim": "a geometric wait (w0 = 1, r = 2) has a lower CER than the fixed "
     "waits w = 1, 5 and 10",
     "comparisons": [{"better": {"data.name": "mnist", "model.width": h,
                                 "stream.wait_policy": "geometric", "stream.geometric_w0": 1.0},
                      "worse": _warm(h, w)} for h in _H for w in (1, 5, 10)]},
]

# Wall seconds of each point's run (three seeds in one run on MNIST; the mean of the runs of one
# seed for the triggered waits and on CIFAR-10) on a 2-core Intel Xeon (family 6, model 207),
# two runs at a time, at commits 49aa9a0 (MNIST) and 06eb48c (CIFAR-10) (`wall_s` of
# docs/reproduction/beyond/earlier_49aa9a0/results.csv), keyed by (data set, width, w, warm
# start, waiting policy, its w0 or unseen fraction). The sweep's ETA scales them to its host.
TIME_S = {
    ('mnist', 4, 1, 'continual_backprop', 'fixed', None): 132,
    ('mnist', 4, 1, 'finetune', 'fixed', None): 115,
    ('mnist', 4, 1, 'l2_init', 'fixed', None): 105,
    ('mnist', 4, 1, 'redo', 'fixed', None): 146,
    ('mnist', 4, 1, 'scratch', 'fixed', None): 118,
    ('mnist', 4, 1, 'shrink_perturb', 'fixed', None): 108,
    ('mnist', 4, 5, 'finetune', 'fixed', None): 46,
    ('mnist', 4, 10, 'continual_backprop', 'fixed', None): 17,
    ('mnist', 4, 10, 'finetune', 'fixed', None): 19,
    ('mnist', 4, 10, 'l2_init', 'fixed', None): 22,
    ('mnist', 4, 10, 'redo', 'fixed', None): 24,
    ('mnist', 4, 10, 'scratch', 'fixed', None): 22,
    ('mnist', 4, 10, 'shrink_perturb', 'fixed', None): 20,
    ('mnist', 4, 25, 'finetune', 'fixed', None): 16,
    ('mnist', 4, 50, 'finetune', 'fixed', None): 16,
    ('mnist', 4, 250, 'finetune', 'fixed', None): 19,
    ('mnist', 64, 1, 'continual_backprop', 'fixed', None): 172,
    ('mnist', 64, 1, 'finetune', 'fixed', None): 163,
    ('mnist', 64, 1, 'l2_init', 'fixed', None): 142,
    ('mnist', 64, 1, 'redo', 'fixed', None): 183,
    ('mnist', 64, 1, 'scratch', 'fixed', None): 196,
    ('mnist', 64, 1, 'shrink_perturb', 'fixed', None): 189,
    ('mnist', 64, 5, 'finetune', 'fixed', None): 53,
    ('mnist', 64, 10, 'continual_backprop', 'fixed', None): 32,
    ('mnist', 64, 10, 'finetune', 'fixed', None): 38,
    ('mnist', 64, 10, 'l2_init', 'fixed', None): 39,
    ('mnist', 64, 10, 'redo', 'fixed', None): 38,
    ('mnist', 64, 10, 'scratch', 'fixed', None): 44,
    ('mnist', 64, 10, 'shrink_perturb', 'fixed', None): 42,
    ('mnist', 64, 25, 'finetune', 'fixed', None): 35,
    ('mnist', 64, 50, 'finetune', 'fixed', None): 32,
    ('mnist', 64, 250, 'finetune', 'fixed', None): 37,
    ('mnist', 4, 1, 'finetune', 'geometric', 1.0): 26,
    ('mnist', 4, 1, 'finetune', 'geometric', 10.0): 25,
    ('mnist', 64, 1, 'finetune', 'geometric', 1.0): 38,
    ('mnist', 64, 1, 'finetune', 'geometric', 10.0): 35,
    ('mnist', 4, 1, 'finetune', 'triggered', 0.1): 29,
    ('mnist', 4, 1, 'finetune', 'triggered', 0.5): 15,
    ('mnist', 64, 1, 'finetune', 'triggered', 0.1): 35,
    ('mnist', 64, 1, 'finetune', 'triggered', 0.5): 19,
    ('cifar10', 16, 1, 'continual_backprop', 'fixed', None): 145,
    ('cifar10', 16, 1, 'finetune', 'fixed', None): 158,
    ('cifar10', 16, 1, 'l2_init', 'fixed', None): 146,
    ('cifar10', 16, 1, 'redo', 'fixed', None): 167,
    ('cifar10', 16, 1, 'scratch', 'fixed', None): 224,
    ('cifar10', 16, 1, 'shrink_perturb', 'fixed', None): 197,
}


def run_seconds(config) -> float | None:
  """One run's seconds by TIME_S, for the sweep's ETA; None for a point TIME_S does not name.
  `config`: the point's resolved config, a nested dict."""
  s = config["stream"]
  extra = {"geometric": s.get("geometric_w0"), "triggered": s.get("trigger_fraction")}
  return TIME_S.get((config["data"]["name"], config["model"]["width"], s["wait"],
                     s["warm_start"], s["wait_policy"], extra.get(s["wait_policy"])))
