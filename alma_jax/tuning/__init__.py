"""Speed tuning: the run's speed choices, entered through `alma_jax.tuning.tune`.

`cpu_tuning.py` (glibc's allocator, by rule, before JAX starts its backend), `cpu_fusion.py`
and `cpu_fusion_child.py` (XLA:CPU fusion flags timed in a child process),
`gpu_autotune.py` (XLA:GPU's autotuning level, by rule) and
`autotune.py` (fields left to be chosen, measured once per machine) are what
`tune.process_flags` and `tune.run_choices` put together.
"""
