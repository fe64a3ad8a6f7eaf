"""The CIFAR-10 grid of REPRODUCTION.md: the paper's CIFAR-10 findings on a reduced protocol.

  python launch/sweep.py --root=/tmp/findings_cifar --grid_file=launch/grids/findings_cifar.py \
      --parallel=1

The protocol (`configs/cifar_<method>.py:quick` with the fields of `_PROTOCOL`):
a random 40% of the CIFAR-10 training set (20,000 images, drawn per seed) as
a stream of B = 10 mega-batches of 2,000 (10% of each its validation set),
the reduced VGG with BatchNorm of width C, SGD as in the paper (lr 0.01,
momentum 0.9, weight decay 1e-4, batch 128, crop+flip), and the paper's way
of training a stage: early stopping on validation accuracy with patience 2
within at most 8 epochs (the paper: patience 25 within 100); the test error
of 2,000 test images after every mega-batch. The speed choices follow the
rules (`train.autotune=rules`), so every run makes the same ones on any
machine and none is timed. Seeds 0, 1, 2 for every point; each seed is its
own run (separate runs are faster than vmapped seeds for the VGG on a CPU).

The paper's CIFAR-10 stream has B = 100 and names w = 2, 10 and 100; here
B = 10, so w = 2 plays the paper's intermediate wait and w = 10 = B is the
tardy learner.

  F1, F8  waiting time: SM, C in {4, 16}, w in {1, 2, 5, 10}
  F2      width: SM at w = 2, C in {4, 8, 16}
  F3      Ens vs UMix: N = 3 members (the released code's N), C in {4, 16}, w = 2
  F4      growing methods at equal compute: gEns, gMoE and Firefly from C = 4,
          w = 2, against SM C in {4, 8, 16} and each other (`comp_paper_total`:
          growth's passes over data counted)
  F5, F9  replay of every earlier mega-batch at w = 2: SM, Ens and gEns at C = 4

The grid expands to 19 points x 3 seeds = 57 runs. The sweep resumes: run the
command again after an interruption and it skips the finished runs.
`TIME_S` below holds the measured wall time of every point's seed 0 on an idle
2-core CPU, and `python launch/grids/findings_cifar.py` prints the grid's
estimate from it: 84 minutes, over the 75 it was sized for (Ens with replay
alone takes 4 minutes a seed). The sweep's ETA uses these times through
`run_seconds`, scaled to the host it runs on by the runs that ended.
"""

_SEEDS = [0, 1, 2]
B = 10
# The reduced protocol: 40% of the training set in 10 mega-batches, early stopping within 8
# epochs per stage.
_PROTOCOL = {"data.train_subset": [20000], "data.test_subset": [2000],
             "stream.num_megabatches": [B], "train.epochs": [8], "train.patience": [2],
             "train.autotune": ["rules"]}
WAITS = [1, 2, 5, B]


def _config(method):
  return [f"configs/cifar_{method}.py:quick"]


def _grid(config, **fields):
  """One sub-grid: `config` files, the protocol's fields, `fields` (dots as "__"), the seeds."""
  out = {"config": config, **_PROTOCOL}
  out.update({k.replace("__", "."): v for k, v in fields.items()})
  out["seed"] = _SEEDS
  return out


GRID = [
    # F1, F8: waiting time for a small and a larger model.
    _grid(_config("sm"), model__width=[4, 16], stream__wait=WAITS),
    # F2: the middle width (4 and 16 are above).
    _grid(_config("sm"), model__width=[8], stream__wait=[2]),
    # F3: Ens and UMix with 3 members against each other.
    _grid(_config("ens") + _config("umix"), model__width=[4, 16], method__num_members=[3],
          stream__wait=[2]),
    # F4: growing methods from C = 4.
    _grid(_config("gens") + _config("gmoe") + _config("ff"), model__width=[4],
          stream__wait=[2]),
    # F5, F9: replay for SM, Ens and gEns at C = 4 (their no-replay points are above).
    _grid(_config("sm") + _config("gens"), model__width=[4], stream__wait=[2],
          stream__replay=[1.0]),
    _grid(_config("ens"), model__width=[4], method__num_members=[3], stream__wait=[2],
          stream__replay=[1.0]),
]


def _c(method, width=4, wait=2, replay=0.0):
  return {"data.name": "cifar10", "method.name": method, "model.width": width,
          "stream.wait": wait, "stream.replay": replay}


_FIXED_SM = [_c("sm", c) for c in (4, 8, 16)]

FINDINGS = [
    {"id": "F1", "claim": "an intermediate wait has a lower CER than the greediest (w = 1) and "
     "the tardy learner (w = B), for a small and a larger model",
     "comparisons": [{"better": [_c("sm", c, w) for w in (2, 5)], "worse": _c("sm", c, extreme)}
                     for c in (4, 16) for extreme in (1, B)]},
    {"id": "F2a", "claim": "bigger models have a lower CER (w = 2)",
     "comparisons": [{"better": _c("sm", b), "worse": _c("sm", a)} for a, b in ((4, 8), (8, 16))]},
    {"id": "F2b", "claim": "bigger models have a lower final error (w = 2)",
     "metric": "final_error",
     "comparisons": [{"better": _c("sm", b), "worse": _c("sm", a)} for a, b in ((4, 8), (8, 16))]},
    {"id": "F3", "claim": "UMix has an edge over Ens for small models, Ens for larger ones",
     "comparisons": [{"better": _c("umix", 4), "worse": _c("ens", 4)},
                     {"better": _c("ens", 16), "worse": _c("umix", 16)}]},
    {"id": "F4a", "claim": "a fixed SM spending no more compute (all work counted) beats gMoE "
     "and FF",
     "comparisons": [{"better": _FIXED_SM, "within": "comp_paper_total", "worse": _c(m)}
                     for m in ("gmoe", "ff")]},
    {"id": "F4b", "claim": "gEns beats gMoE and FF at no more compute",
     "comparisons": [{"better": [_c("gens")], "within": "comp_paper_total", "worse": _c(m)}
                     for m in ("gmoe", "ff")]},
    {"id": "F4c", "claim": "Ens beats gEns at no more memory",
     "comparisons": [{"better": [_c("ens", 4), _c("ens", 16)], "within": "mem",
                      "worse": _c("gens")}]},
    {"id": "F5", "claim": "replay gives no better trade-off: a model without replay spending no "
     "more compute does at least as well",
     "comparisons": [{"better": _FIXED_SM + [_c("sm", c, w) for c in (4, 16) for w in WAITS],
                      "within": "comp_paper_total", "pick": "best", "worse": _c("sm", 4, 2, 1.0)}]},
    {"id": "F8", "claim": "the tardy learner (w = B) has the best final error",
     "metric": "final_error",
     "comparisons": [{"better": _c("sm", c, B), "worse": _c("sm", c, w)}
                     for c in (4, 16) for w in (1, 2, 5)]},
    {"id": "F9", "claim": "replaying every earlier mega-batch lowers CER for every method "
     "(SM, Ens, gEns at C = 4, w = 2)",
     "comparisons": [{"better": _c(m, replay=1.0), "worse": _c(m)} for m in ("sm", "ens", "gens")]},
]

# Wall seconds of one run of each point (seed 0, one after another, from the end of one run to the
# end of the next: start-up, data, compiling and the run) on an idle 2-core AMD EPYC (family 26)
# at commit 21a8d2a (REPRODUCTION.md, "CIFAR-10"); the estimate below is three seeds of each.
TIME_S = {
    'sm C=4 w=1': 30,
    'sm C=4 w=2': 26,
    'sm C=4 w=5': 36,
    'sm C=4 w=10': 37,
    'sm C=16 w=1': 52,
    'sm C=16 w=2': 53,
    'sm C=16 w=5': 69,
    'sm C=16 w=10': 58,
    'sm C=8 w=2': 42,
    'ens C=4 w=2': 107,
    'ens C=16 w=2': 159,
    'umix C=4 w=2': 95,
    'umix C=16 w=2': 125,
    'gens C=4 w=2': 66,
    'gmoe C=4 w=2': 221,
    'ff C=4 w=2': 58,
    'sm C=4 w=2 replay': 90,
    'gens C=4 w=2 replay': 118,
    'ens C=4 w=2 replay': 247,
}


def run_seconds(config) -> float | None:
  """One run's seconds by TIME_S, for the sweep's ETA (which scales them to the host it runs
  on); None for a point TIME_S does not name. `config`: the point's resolved config, a nested
  dict."""
  label = f"{config['method']['name']} C={config['model']['width']} w={config['stream']['wait']}"
  return TIME_S.get(label + (" replay" if config["stream"]["replay"] else ""))


def estimate() -> str:
  """The grid's time from TIME_S: each point's seconds times its seeds, in all."""
  if not TIME_S:
    return "no measured times yet (TIME_S is empty)"
  lines = [f"{label}: {len(_SEEDS)} x {s} s" for label, s in TIME_S.items()]
  total = len(_SEEDS) * sum(TIME_S.values())
  return "\n".join(lines + [f"total: {total / 60:.0f} min with --parallel=1"])


if __name__ == "__main__":
  print(estimate())
