"""Growth of tree-gated mixtures of experts: which expert to split (paper Appendix A).

The split itself is the pure edit `alma_jax.surgery.split_expert`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def expert_scores(weights: jnp.ndarray, losses: jnp.ndarray, mask: jnp.ndarray,
                  split_by: str) -> jnp.ndarray:
  """Per-expert growth scores of a batch: (b, E) routing weights -> (E,).

  Args:
    weights: routing weight of each example through each expert (soft: the
      leaf probability; hard: 1 for the chosen expert, 0 otherwise).
    losses: per-example loss (b,).
    mask: which examples count (b,).
    split_by: "loss" (cumulative loss routed through the expert, weighted by
      the routing weight: the paper) or "usage" (cumulative routing weight:
      the released code).
  """
  m = mask.astype(weights.dtype)
  if split_by == "loss":
    m = m * losses.astype(weights.dtype)
  elif split_by != "usage":
    raise ValueError(f"config.method.split_by={split_by!r} is unknown; valid values: "
                     "['loss', 'usage']")
  return jnp.einsum("be,b->e", weights, m)


def losing_expert(scores) -> int:
  """The expert to split: the arg-max of the cumulative scores (first one on ties)."""
  scores = np.asarray(scores)
  if scores.ndim != 1 or scores.size == 0:
    raise ValueError(f"expected a non-empty vector of expert scores, got shape {scores.shape}")
  return int(np.argmax(scores))
