"""gEns for language modelling: one more Switch Transformer (E=4) before every later stage.

The first stage trains one model; before each later stage a copy of the last
one is added and trained alone, the older ones stay frozen (paper Table 2:
4@1 -> 4@4). Same stream, optimizer and variants as configs/lm_sm.py.

Run:
  python -m alma_jax.main --config=configs/lm_gens.py:quick --workdir=/tmp/lm_gens
Variants: :smoke, :quick, :base, :large (see configs/lm_sm.py).
Options:
  --config.method.new_member=fresh        a new random model instead of a copy
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("tiny_shakespeare", "lm_gens")
  return config_lib.apply_variant(c, arg)
