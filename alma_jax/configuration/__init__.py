"""alma_jax.configuration."""
