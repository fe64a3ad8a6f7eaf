"""The language-model growth grid of REPRODUCTION.md: fixed Switch Transformers against
growing ones, the paper's Table 2 at two small scales.

  python launch/sweep.py --root=/tmp/lm_growth --grid_file=launch/grids/lm_growth.py --parallel=2

tiny_shakespeare `:quick`: GPT-2 BPE tokens in B = 4 mega-batches, w = 1, Adam steps of 8
sequences of 64 tokens, the learning rate warmed up and decayed to 0 within each stage. Two
models of the same shape (2 blocks, each a mixture of experts):

* the tiny preset of `configs/lm_sm.py:quick` (d = 64, experts' hidden size 128, the whole
  GPT-2 vocabulary) with its 80 steps per stage. Its tied embedding holds 3.2M of its 3.4M
  parameters and its output layer most of its compute: an expert is 1% of the parameters;
* the balanced model (`BALANCED`): d = 128, experts' hidden size 256, the 2,047 tokens most
  frequent in the training text and one token for the rest, 800 steps per stage (about five
  and a half passes over a mega-batch). An expert is 132k parameters against 0.4M shared,
  near the paper's large model (28M per expert against 96M shared); its output layer, a
  twelfth of the tiny one's, lets it run its ten times as many steps in about the tiny
  one's time (REPRODUCTION.md, "Growing language models").

Per model:
* SM with E = 4, 8 and 12 experts per mixture block (the paper's three SM models);
* gMoE (`configs/lm_gmoe.py`): 4 experts, then before each later stage every mixture block
  copies the k experts with the largest validation loss routed to them, k = 2, 2, 4:
  4 -> 6 -> 8 -> 12 experts, as in the paper's Table 2;
* gEns (`configs/lm_gens.py`): one more E = 4 model before each later stage, trained alone
  while the older ones stay frozen: 4@1 -> 4@4.

Three seeds per point: one run of `num_seeds=3` for SM and gEns, one run per seed for gMoE
(which experts it copies depends on the seed).

FINDINGS test the paper's section 6.2 ("Growing does not improve") on each model, on the
average perplexity over the mega-batches so far (`mean_perplexity`, the paper's Fig. 5 and
Table 2: the mean of the perplexities after each stage): more experts give a lower
perplexity (L1); a fixed model spending no more compute, all work counted, beats both
growing methods (L2), and so does one holding no more parameters (L3); a fixed model with
the intermediate number of experts beats gMoE, which ends with more (L4: capacity at the
start matters more than at the end). The ids end in t (the tiny preset) or b (the balanced
model). TIME_S (at the end) holds each run's measured time, which the sweep's ETA scales to
the host it runs on (`run_seconds`).
"""

_SEEDS = [0, 1, 2]
EXPERTS = [4, 8, 12]
BALANCED = {"data.vocab_size": 2048, "model.dim": 128, "model.ffn_dim": 256,
            "train.steps_per_epoch": 800}
# Each model's fields over the variant's (the tiny preset: none), and its `model.dim`, which
# tells the two apart in a run's config (0: the preset's sizes).
_FIELDS = {"b": {k: [v] for k, v in BALANCED.items()}, "t": {}}
_DIM = {"b": BALANCED["model.dim"], "t": 0}

GRID = [g for fields in _FIELDS.values() for g in (
    {"config": ["configs/lm_sm.py:quick"], "model.num_experts": EXPERTS, "seed": _SEEDS,
     **fields},
    {"config": ["configs/lm_gmoe.py:quick", "configs/lm_gens.py:quick"], "seed": _SEEDS,
     **fields},
)]


def _sm(model, experts):
  return {"method.name": "lm_sm", "model.num_experts": experts, "model.dim": _DIM[model]}


def _grown(model, method):
  return {"method.name": method, "model.dim": _DIM[model]}


def _findings(m: str, name: str) -> list[dict]:
  fixed = [_sm(m, e) for e in EXPERTS]
  grown = [_grown(m, "lm_gmoe"), _grown(m, "lm_gens")]
  return [
      {"id": f"L1{m}", "claim": f"{name}: a Switch Transformer with more experts has a lower "
       "mean perplexity", "metric": "mean_perplexity",
       "comparisons": [{"better": _sm(m, b), "worse": _sm(m, a)} for a, b in ((4, 8), (8, 12))]},
      {"id": f"L2{m}", "claim": f"{name}: a fixed model spending no more compute (all work "
       "counted) has a lower mean perplexity than gMoE and gEns", "metric": "mean_perplexity",
       "comparisons": [{"better": fixed, "within": "comp_paper_total", "worse": g}
                       for g in grown]},
      {"id": f"L3{m}", "claim": f"{name}: a fixed model holding no more parameters has a lower "
       "mean perplexity than gMoE and gEns", "metric": "mean_perplexity",
       "comparisons": [{"better": fixed, "within": "mem", "worse": g} for g in grown]},
      {"id": f"L4{m}", "claim": f"{name}: a fixed model with the intermediate number of experts "
       "(E = 8) beats gMoE growing from 4 to 12", "metric": "mean_perplexity",
       "comparisons": [{"better": _sm(m, 8), "worse": _grown(m, "lm_gmoe")}]},
  ]


FINDINGS = _findings("t", "tiny preset") + _findings("b", "balanced model")

# Wall seconds of one run of each point (SM and gEns: three seeds in one run; gMoE: the mean of
# its runs of one seed) on the 2-core Intel Xeon of family 6, model 167, two runs at a time
# (`wall_s` of docs/reproduction/lm_growth/results.csv). The sweep's ETA scales them to its
# host.
TIME_S = {"t lm_sm E=4": 467, "t lm_sm E=8": 467, "t lm_sm E=12": 372, "t lm_gmoe": 162,
          "t lm_gens": 774,
          "b lm_sm E=4": 299, "b lm_sm E=8": 371, "b lm_sm E=12": 414, "b lm_gmoe": 118,
          "b lm_gens": 257}


def run_seconds(config) -> float | None:
  """One run's seconds by TIME_S, for the sweep's ETA (which scales them to the host it runs
  on); None for a point TIME_S does not name. `config`: the point's resolved config, a nested
  dict."""
  name = config["method"]["name"]
  model = next((m for m, dim in _DIM.items() if config["model"]["dim"] == dim), None)
  if model is None:  # a model of neither size
    return None
  return TIME_S.get(f"{model} {name} E={config['model']['num_experts']}" if name == "lm_sm"
                    else f"{model} {name}")
