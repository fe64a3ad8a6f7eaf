"""alma_jax.outputs."""
