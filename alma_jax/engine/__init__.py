"""alma_jax.engine."""
