"""Ens E@N for language modelling: N=2 Switch Transformers of E=4 experts (paper Table 1: 4@2).

Each member has its own initialisation and data order; the prediction is the
mean of the members' probabilities. Same stream, optimizer and variants as
configs/lm_sm.py.

Run:
  python -m alma_jax.main --config=configs/lm_ens.py:quick --workdir=/tmp/lm_ens
  python -m alma_jax.main --config=configs/lm_ens.py:quick,iid --workdir=/tmp/lm_ens_iid
Variants: :smoke, :quick, :base, :large, iid (see configs/lm_sm.py).
Options:
  --config.method.num_members=4           N (paper: 2 and 4)
  --config.model.num_experts=4            E
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("tiny_shakespeare", "lm_ens")
  c.method.num_members = 2
  return config_lib.apply_variant(c, arg)
