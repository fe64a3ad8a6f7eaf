"""alma_jax.stream."""
