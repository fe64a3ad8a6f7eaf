"""alma_jax.reports."""
