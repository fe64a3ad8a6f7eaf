"""alma_jax.runtime."""
