"""gMoE for language models: a Switch Transformer that copies its losing experts.

Starts with 4 experts per block; before every later stage each block copies
the 2 experts with the largest validation loss routed to them (their weights
and router columns: `alma_jax.methods.lm.copy_experts`), 4 -> 6 -> 8 -> 10
over B=4 mega-batches (paper section 5: top-k, k = 2 to 4; Table 2 grows
4 -> 6 -> 8 -> 12). Same stream, optimizer and variants as configs/lm_sm.py.

Run:
  python -m alma_jax.main --config=configs/lm_gmoe.py:quick --workdir=/tmp/lm_gmoe
Variants: :smoke, :quick, :base, :large (see configs/lm_sm.py).
Options:
  --config.method.grow_by=4               k experts copied per growth
  --config.method.max_experts=12          stop growing there
  --config.method.router_noise=1e-3       perturb the copies' router columns
"""

from alma_jax import config_lib


def get_config(arg=None):
  c = config_lib.base_config("tiny_shakespeare", "lm_gmoe")
  return config_lib.apply_lm_variant(c, arg)
