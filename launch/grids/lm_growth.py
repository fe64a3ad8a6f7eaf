"""The language-model growth grid of REPRODUCTION.md: fixed Switch Transformers against
growing ones, the paper's Table 2 at the tiny model's scale.

  python launch/sweep.py --root=/tmp/lm_growth --grid_file=launch/grids/lm_growth.py --parallel=2

tiny_shakespeare `:quick` (GPT-2 BPE tokens in B = 4 mega-batches, w = 1, 80 Adam steps of
8 sequences of 64 tokens per stage, the learning rate warmed up and decayed to 0 within each
stage), the tiny Switch Transformer of `configs/lm_sm.py:quick`:

* SM with E = 4, 8 and 12 experts per mixture block (the paper's three SM models);
* gMoE (`configs/lm_gmoe.py`): 4 experts, then before each later stage every mixture block
  copies the k experts with the largest validation loss routed to them, k = 2, 2, 4:
  4 -> 6 -> 8 -> 12 experts, as in the paper's Table 2;
* gEns (`configs/lm_gens.py`): one more E = 4 model before each later stage, trained alone
  while the older ones stay frozen: 4@1 -> 4@4.

Three seeds per point: one run of `num_seeds=3` for SM and gEns, one run per seed for gMoE
(which experts it copies depends on the seed).

FINDINGS test the paper's section 6.2 ("Growing does not improve") on the average
perplexity over the mega-batches so far (`mean_perplexity`, the paper's Fig. 5 and Table 2;
the mean of the perplexities after each stage): more experts give a lower perplexity (L1);
a fixed model spending no more compute, all work counted, beats both growing methods (L2),
and so does one holding no more parameters (L3); a fixed model with the intermediate number
of experts beats gMoE, which ends with more (L4: capacity at the start matters more than at
the end). TIME_S (at the end) holds each run's measured time, which the sweep's ETA scales
to the host it runs on (`run_seconds`).
"""

_SEEDS = [0, 1, 2]
EXPERTS = [4, 8, 12]

GRID = [
    {"config": ["configs/lm_sm.py:quick"], "model.num_experts": EXPERTS, "seed": _SEEDS},
    {"config": ["configs/lm_gmoe.py:quick", "configs/lm_gens.py:quick"], "seed": _SEEDS},
]


def _sm(experts):
  return {"method.name": "lm_sm", "model.num_experts": experts}


def _grown(method):
  return {"method.name": method}


_FIXED = [_sm(e) for e in EXPERTS]
_GROWN = [_grown("lm_gmoe"), _grown("lm_gens")]

FINDINGS = [
    {"id": "L1", "claim": "a Switch Transformer with more experts has a lower mean perplexity",
     "metric": "mean_perplexity",
     "comparisons": [{"better": _sm(b), "worse": _sm(a)} for a, b in ((4, 8), (8, 12))]},
    {"id": "L2", "claim": "a fixed model spending no more compute (all work counted) has a "
     "lower mean perplexity than gMoE and gEns", "metric": "mean_perplexity",
     "comparisons": [{"better": _FIXED, "within": "comp_paper_total", "worse": g}
                     for g in _GROWN]},
    {"id": "L3", "claim": "a fixed model holding no more parameters has a lower mean perplexity "
     "than gMoE and gEns", "metric": "mean_perplexity",
     "comparisons": [{"better": _FIXED, "within": "mem", "worse": g} for g in _GROWN]},
    {"id": "L4", "claim": "a fixed model with the intermediate number of experts (E = 8) beats "
     "gMoE growing from 4 to 12", "metric": "mean_perplexity",
     "comparisons": [{"better": _sm(8), "worse": _grown("lm_gmoe")}]},
]

# Wall seconds of one run of each point (SM and gEns: three seeds in one run; gMoE: one seed).
TIME_S = {}


def run_seconds(config) -> float | None:
  """One run's seconds by TIME_S, for the sweep's ETA (which scales them to the host it runs
  on); None for a point TIME_S does not name. `config`: the point's resolved config, a nested
  dict."""
  name = config["method"]["name"]
  return TIME_S.get(f"{name} E={config['model']['num_experts']}" if name == "lm_sm" else name)
