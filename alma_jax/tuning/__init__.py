"""alma_jax.tuning."""
