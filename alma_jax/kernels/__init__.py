"""Native XLA:CPU kernels of the package (`native`), compiled on first use."""
