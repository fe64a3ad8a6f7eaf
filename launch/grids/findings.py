"""The MNIST and language-model grid of REPRODUCTION.md: the paper's findings on reduced protocols.

  python launch/sweep.py --root=/tmp/findings --grid_file=launch/grids/findings.py --parallel=2

MNIST `:quick` (the whole stream, B=500 mega-batches, w=10 unless a grid says
otherwise, at most 20 epochs per stage, patience 5) and tiny_shakespeare
`lm_ens.py:quick` (Ens 4@2: two Switch Transformers of 4 experts, the model of
the paper's Table 1); three seeds per point (one `num_seeds=3` run each, or
one run per seed where growth depends on the seed).

FINDINGS names, next to the points, what each finding compares; the report
(`alma_jax.reports.findings`) computes every verdict from the sweep's
`results.csv`. TIME_S (at the end) holds each run's measured time, which the
sweep's ETA scales to the host it runs on (`run_seconds`).
"""

from alma_jax.reports import grid_files

_SEEDS = [0, 1, 2]
_SM = ["configs/mnist_sm.py:quick"]
_LM = ["configs/lm_ens.py:quick"]
WAITS = [1, 10, 25, 50, 250, 500]  # 500 = B: the tardy learner

GRID = [
    # F2 (bigger models), F3 (Ens vs UMix), the fixed models of F4.
    {"config": _SM, "method.name": ["sm"], "model.width": [4, 16, 64, 256], "seed": _SEEDS},
    {"config": _SM, "method.name": ["ens", "umix"], "model.width": [4, 64], "seed": _SEEDS},
    # F1: waiting time for a small and a larger model, no replay (w = 10 is above).
    {"config": _SM, "method.name": ["sm"], "model.width": [4, 64],
     "stream.wait": [w for w in WAITS if w != 10], "seed": _SEEDS},
    # F5: replay of every earlier mega-batch, against the same models at w = 50 above.
    {"config": _SM, "method.name": ["sm"], "model.width": [4, 64], "stream.wait": [50],
     "stream.replay": [1.0], "seed": _SEEDS},
    # F4: growing methods against the fixed models; F7: tree-gated vs flat gMoE.
    {"config": ["configs/mnist_gens.py:quick", "configs/mnist_ff.py:quick"], "seed": _SEEDS},
    {"config": ["configs/mnist_gmoe.py:quick"], "method.tree": [True, False], "seed": _SEEDS},
    # F6: Ens 4@2 language models, sequential vs i.i.d. at equal data and compute, on streams
    # of k = 4 and k = 3 mega-batches (the paper's Table 1).
    {"config": _LM, "stream.num_megabatches": [4, 3], "stream.iid": [False, True],
     "seed": _SEEDS},
]


def _sm(width, wait=10, replay=0.0):
  return {"data.name": "mnist", "method.name": "sm", "model.width": width, "stream.wait": wait,
          "stream.replay": replay}


def _mnist(method, width=64, **fields):
  return {"data.name": "mnist", "method.name": method, "model.width": width, **fields}


def _lm(k, iid):
  return {"data.name": "tiny_shakespeare", "method.name": "lm_ens",
          "stream.num_megabatches": k, "stream.iid": iid}


_FIXED_SM = [_sm(h) for h in (4, 16, 64, 256)]
_GMOE_TREE = _mnist("gmoe", **{"method.tree": True})

FINDINGS = [
    {"id": "F1a", "claim": "small models (H = 4): an intermediate wait has a lower CER than the "
     "greediest (w = 1) and the tardy learner (w = B)",
     "comparisons": [{"better": [_sm(4, w) for w in (10, 25, 50)], "worse": _sm(4, w)}
                     for w in (1, 500)]},
    {"id": "F1b", "claim": "larger models (H = 64) prefer small waits: CER falls as w shrinks",
     "comparisons": [{"better": _sm(64, 1), "worse": _sm(64, 10)},
                     {"better": _sm(64, 10), "worse": _sm(64, 50)}]},
    {"id": "F2a", "claim": "bigger models have a lower CER (w = 10)",
     "comparisons": [{"better": _sm(b), "worse": _sm(a)} for a, b in ((4, 16), (16, 64),
                                                                       (64, 256))]},
    {"id": "F2b", "claim": "bigger models have a lower final error (w = 10)", "metric":
     "final_error",
     "comparisons": [{"better": _sm(b), "worse": _sm(a)} for a, b in ((4, 16), (16, 64),
                                                                       (64, 256))]},
    {"id": "F3", "claim": "UMix has an edge over Ens for small models, Ens for larger ones",
     "comparisons": [{"better": _mnist("umix", 4), "worse": _mnist("ens", 4)},
                     {"better": _mnist("ens", 64), "worse": _mnist("umix", 64)}]},
    {"id": "F4a", "claim": "a fixed SM spending no more compute (all work counted) beats gMoE "
     "and FF",
     "comparisons": [{"better": _FIXED_SM, "within": "comp_paper_total", "worse": w}
                     for w in (_GMOE_TREE, _mnist("ff"))]},
    {"id": "F4b", "claim": "gEns beats gMoE and FF at no more compute",
     "comparisons": [{"better": [_mnist("gens")], "within": "comp_paper_total", "worse": w}
                     for w in (_GMOE_TREE, _mnist("ff"))]},
    {"id": "F4c", "claim": "Ens beats gEns at no more memory",
     "comparisons": [{"better": [_mnist("ens", 4), _mnist("ens", 64)], "within": "mem",
                      "worse": _mnist("gens")}]},
    {"id": "F5a", "claim": "replaying every earlier mega-batch lowers CER (w = 50)",
     "comparisons": [{"better": _sm(h, 50, 1.0), "worse": _sm(h, 50)} for h in (4, 64)]},
    {"id": "F5b", "claim": "replay gives no better trade-off: a model without replay spending "
     "no more compute does at least as well",
     "comparisons": [{"better": _FIXED_SM + [_sm(h, w) for h in (4, 64) for w in WAITS],
                      "within": "comp_paper_total", "pick": "best", "worse": _sm(h, 50, 1.0)}
                     for h in (4, 64)]},
    {"id": "F6", "claim": "language models (Ens 4@2): learning sequentially ends at a higher "
     "perplexity than learning i.i.d. on the same data with the same compute",
     "metric": "final_perplexity",
     "comparisons": [{"better": _lm(k, True), "worse": _lm(k, False)} for k in (4, 3)]},
    {"id": "F7", "claim": "tree gating beats flat gating (gMoE; the early version's ablation, "
     "here on MNIST with splits about every 5 stages)",
     "comparisons": [{"better": _GMOE_TREE, "worse": _mnist("gmoe", **{"method.tree": False}),
                      "metric": m} for m in ("cer_percent", "final_error")]},
]

# Wall seconds of each point's run (three seeds in one run; gMoE and Firefly: the mean of their
# runs of one seed) on a 2-core AMD EPYC (family 25), two runs at a time, at commit f516e8f,
# with the compilation cache of an earlier run of the grid on the host (`wall_s` of
# docs/reproduction/mnist/results.csv). The sweep's ETA scales them to its host.
TIME_S = [
    (_sm(4), 15), (_sm(16), 16), (_sm(64), 24), (_sm(256), 58),
    (_mnist("ens", 4), 37), (_mnist("ens", 64), 97),
    (_mnist("umix", 4), 15), (_mnist("umix", 64), 65),
    (_sm(4, 1), 58), (_sm(4, 25), 9), (_sm(4, 50), 8), (_sm(4, 250), 10), (_sm(4, 500), 11),
    (_sm(64, 1), 90), (_sm(64, 25), 19), (_sm(64, 50), 18), (_sm(64, 250), 17),
    (_sm(64, 500), 21),
    (_sm(4, 50, 1.0), 51), (_sm(64, 50, 1.0), 100),
    (_mnist("gens"), 217), (_mnist("ff"), 135),
    (_GMOE_TREE, 35), (_mnist("gmoe", **{"method.tree": False}), 35),
    (_lm(4, False), 755), (_lm(3, False), 580), (_lm(4, True), 593), (_lm(3, True), 479),
]


def run_seconds(config) -> float | None:
  """One run's seconds by TIME_S, for the sweep's ETA; None for a point TIME_S does not name.
  `config`: the point's resolved config, a nested dict."""
  return grid_files.seconds_by_fields(TIME_S, config)
