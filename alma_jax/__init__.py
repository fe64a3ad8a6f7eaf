"""alma_jax: Anytime Learning at Macroscale in JAX/Flax."""

__version__ = "0.1.0"
