"""The child process of `alma_jax.tuning.cpu_fusion`: times a train step under its own XLA_FLAGS.

`python -m alma_jax.tuning.cpu_fusion_child` reads {"config", "input_shape", "num_classes",
"impls"} (JSON) on stdin, builds the config's method and its real compiled train call on
synthetic data of the input shape once per convolution gradient in "impls", times a few
steps of each (`autotune.time_train_step`), and prints one line: `cpu_fusion.RESULT`
followed by {"seconds": {impl: seconds per step}, "xla_flags": the flags it ran with}.
"""

from __future__ import annotations

import json
import os
import sys

from alma_jax.tuning import cpu_tuning

cpu_tuning.apply()  # as a convolution-heavy run: the allocator is part of what is timed

import ml_collections  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from alma_jax import methods  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax import tasks  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.engine import optim  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.engine import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.engine.steps import Steps  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.tasks import images as image_task  # pylint: disable=wrong-import-position
from alma_jax.tuning import autotune  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.tuning import cpu_fusion  # pylint: disable=g-import-not-at-top,wrong-import-position


def seconds_per_step(request: dict) -> dict[str, float]:
  """{conv impl: seconds per train step} of the request's config on synthetic data."""
  shape, batch = tuple(request["input_shape"]), request["config"]["train"]["batch_size"]
  data = image_task.DeviceData(
      x=np.zeros((2 * batch,) + shape, np.uint8), y=np.zeros((2 * batch,), np.int32),
      mean=np.zeros(shape[-1:], np.float32), std=np.ones(shape[-1:], np.float32),
      num_train=batch)
  out = {}
  for impl in request["impls"]:
    config = ml_collections.ConfigDict(request["config"])
    config.model.conv_impl = impl
    config = autotune.with_choices(config, {t.path: t.rule(config)
                                            for t in autotune.pending(config)})
    steps = Steps.from_config(config, methods.make(config, shape, request["num_classes"]),
                              tasks.for_config(config), optim.from_config(config), data,
                              sharding.mesh_from_config(config))
    out[impl] = autotune.time_train_step(steps)
  return out


def main() -> None:
  seconds = seconds_per_step(json.loads(sys.stdin.read()))
  print(cpu_fusion.RESULT + json.dumps({"seconds": seconds,
                                        "xla_flags": os.environ.get("XLA_FLAGS", "")}),
        flush=True)


if __name__ == "__main__":
  main()
