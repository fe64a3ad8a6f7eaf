"""Entry point: `python -m alma_jax.main --config=configs/mnist_sm.py --workdir=DIR`.

Fields of the config are overridden on the command line, e.g.
`--config.stream.wait=5 --config.model.width=16`.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, log.jsonl, summary.json.")
_DISTRIBUTED = flags.DEFINE_bool("jax_distributed", False,
                                 "Call jax.distributed.initialize() (multi-host runs); also "
                                 "enabled by ALMA_JAX_DISTRIBUTED=1.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax  # pylint: disable=g-import-not-at-top
  if _DISTRIBUTED.value or os.environ.get("ALMA_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
  logging.info("JAX %s, backend %s, devices: %s", jax.__version__, jax.default_backend(), jax.devices())
  from alma_jax import run  # pylint: disable=g-import-not-at-top
  run.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
