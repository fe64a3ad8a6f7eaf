"""Ten seeds for the MNIST comparisons that three seeds left undecided (REPRODUCTION.md).

  python launch/sweep.py --root=/tmp/ten_seeds --grid_file=launch/grids/ten_seeds.py --parallel=2

The protocol of the findings grid (`launch/grids/findings.py`): `configs/mnist_sm.py:quick`
and `configs/mnist_gmoe.py:quick` (B=500 mega-batches of 120, at most 20 epochs per stage,
patience 5), seeds 0-9 (SM's ten seeds in one `num_seeds=10` run per point; gMoE one run per
seed, its growth depends on the seed). Its points are those of the comparisons that the
findings grid (F1a, F2b, F7) and the beyond grid (`launch/grids/beyond.py`: B1, B7) ran with
three seeds and could not decide (|t| <= 3), at the same settings, so that seeds 0-2 here repeat
those runs:

* F1a: SM with H = 4 at w = 1 against w in {10, 25, 50};
* F2b: the final error of SM with H = 64 against H = 256 (w = 10);
* F7: gMoE with tree gating against flat gating;
* B1: ReDo (tau = 0.025) against fine-tuning, H = 4, w = 1;
* B7: the geometric wait (w0 = 1, r = 2) against the fixed waits 1, 5 and 10, H = 4.

The verdicts follow the rule of the other grids (Welch's t over the seeds, clear when
|t| > 3). TIME_S (at the end) holds each run's measured time, which the sweep's ETA scales to
the host it runs on (`run_seconds`).
"""

from alma_jax.reports import grid_files

_SEEDS = list(range(10))
_SM = ["configs/mnist_sm.py:quick"]

GRID = [
    # F1a and B7's fixed waits (H = 4); F2b's widths at the config's own w = 10.
    {"config": _SM, "model.width": [4], "stream.wait": [1, 5, 10, 25, 50], "seed": _SEEDS},
    {"config": _SM, "model.width": [64, 256], "seed": _SEEDS},
    # B1: ReDo against fine-tuning (the fixed wait w = 1 above).
    {"config": _SM, "model.width": [4], "stream.wait": [1], "stream.warm_start": ["redo"],
     "stream.redo_threshold": [0.025], "seed": _SEEDS},
    # B7: the geometric wait.
    {"config": _SM, "model.width": [4], "stream.wait": [1], "stream.wait_policy": ["geometric"],
     "stream.geometric_w0": [1.0], "stream.geometric_ratio": [2.0], "seed": _SEEDS},
    # F7: tree-gated against flat gMoE.
    {"config": ["configs/mnist_gmoe.py:quick"], "method.tree": [True, False], "seed": _SEEDS},
]


def _sm(width, wait=10, warm_start="finetune", wait_policy="fixed"):
  return {"data.name": "mnist", "method.name": "sm", "model.width": width, "stream.wait": wait,
          "stream.warm_start": warm_start, "stream.wait_policy": wait_policy}


def _gmoe(tree):
  return {"data.name": "mnist", "method.name": "gmoe", "method.tree": tree}


_GEOMETRIC = _sm(4, 1, wait_policy="geometric")

FINDINGS = [
    {"id": "F1a", "claim": "small models (H = 4): an intermediate wait has a lower CER than the "
     "greediest learner (w = 1)",
     "comparisons": [{"better": [_sm(4, w) for w in (10, 25, 50)], "worse": _sm(4, 1)}]},
    {"id": "F2b", "claim": "a bigger model has a lower final error (H = 256 against 64, w = 10)",
     "metric": "final_error", "comparisons": [{"better": _sm(256), "worse": _sm(64)}]},
    {"id": "F7", "claim": "tree gating beats flat gating (gMoE on MNIST)",
     "comparisons": [{"better": _gmoe(True), "worse": _gmoe(False), "metric": m}
                     for m in ("cer_percent", "final_error")]},
    {"id": "B1", "claim": "re-drawing dormant units (ReDo) lowers the CER of fine-tuning "
     "(H = 4, w = 1)",
     "comparisons": [{"better": _sm(4, 1, "redo"), "worse": _sm(4, 1)}]},
    {"id": "B7", "claim": "a geometric wait (w0 = 1, r = 2) has a lower CER than the fixed "
     "waits w = 1, 5 and 10 (H = 4)",
     "comparisons": [{"better": _GEOMETRIC, "worse": _sm(4, w)} for w in (1, 5, 10)]},
]

# Wall seconds of each point's run (SM: ten seeds in one run; gMoE: the mean of its runs of one
# seed) on a 2-core AMD EPYC (family 25, model 1; AVX2), two runs at a time, at commit
# e3ad328, from an empty cache folder (`wall_s` of docs/reproduction/ten_seeds/results.csv).
# The sweep's ETA scales them to its host.
TIME_S = [
    (_sm(4, 1), 203), (_sm(4, 5), 85), (_sm(4), 45), (_sm(4, 25), 32), (_sm(4, 50), 33),
    (_sm(64), 120), (_sm(256), 298), (_sm(4, 1, "redo"), 227), (_GEOMETRIC, 43),
    (_gmoe(True), 51), (_gmoe(False), 50),
]


def run_seconds(config) -> float | None:
  """One run's seconds by TIME_S, for the sweep's ETA; None for a point TIME_S does not name.
  `config`: the point's resolved config, a nested dict."""
  return grid_files.seconds_by_fields(TIME_S, config)
