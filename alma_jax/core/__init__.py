"""alma_jax.core."""
