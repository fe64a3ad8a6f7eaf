"""gMoE for language models: a Switch Transformer that copies its losing experts.

Starts with 4 experts per block; before every later stage each block copies
the k experts with the largest validation loss routed to them (their weights
and router columns: `alma_jax.models.switch.copy_experts`), k = 2, 2, 4 as in
the paper's Table 2: 4 -> 6 -> 8 -> 12 over B=4 mega-batches (section 5:
top-k, k = 2 to 4). Same stream, optimizer and variants as configs/lm_sm.py.

Run:
  python -m alma_jax.main --config=configs/lm_gmoe.py:quick --workdir=/tmp/lm_gmoe
Variants: :smoke, :quick, :base, :large (see configs/lm_sm.py).
Options:
  --config.method.grow_schedule=2,2,4     k of the first growths (then grow_by)
  --config.method.grow_schedule= --config.method.grow_by=2   k = 2 at every growth
  --config.method.max_experts=12          stop growing there
  --config.method.router_noise=1e-3       perturb the copies' router columns
  --config.method.slots=exact             no padding expert slots (one compiled step per
                                          growth instead of one per power of two)
  --config.method.slots=planned           the 12 planned experts' slots from the start (one
                                          compiled step; the default, auto: planned for a
                                          short run on a GPU or TPU, pow2 elsewhere)
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("tiny_shakespeare", "lm_gmoe")
  return config_lib.apply_variant(c, arg)
