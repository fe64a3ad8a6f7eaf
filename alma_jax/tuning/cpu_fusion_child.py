"""The child process of `alma_jax.tuning.cpu_fusion`: a train step under its own XLA_FLAGS, run
on request.

`python -m alma_jax.tuning.cpu_fusion_child` reads one line of JSON on stdin, {"config",
"input_shape", "num_classes", "impls"}, builds the config's method and its real compiled
train call on synthetic data once per convolution gradient in "impls", runs each once (it
compiles), and prints one line: `cpu_fusion.READY` followed by {"steps_per_call": {impl:
train steps per call}, "xla_flags": the flags it runs with}. Then, for every line of input
naming one of the impls, it runs one call of that impl's train step, waits for it and
prints `cpu_fusion.DONE`, until its input ends. The parent times the calls of every child
in turns (`cpu_fusion.measure_in_children`).
"""

from __future__ import annotations

import json
import os
import sys

from alma_jax.tuning import cpu_tuning

cpu_tuning.apply()  # as a convolution-heavy run: the allocator is part of what is timed

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
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


def train_calls(request: dict) -> dict[str, tuple]:
  """{conv impl: (a call of the request's config's train step, its steps per call)} on
  synthetic data, each run once (compiled)."""
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
    call, per_call = autotune.step_call(steps)
    jax.block_until_ready(call())
    out[impl] = (call, per_call)
  return out


def main() -> None:
  calls = train_calls(json.loads(sys.stdin.readline()))
  print(cpu_fusion.READY + json.dumps({"steps_per_call": {k: v[1] for k, v in calls.items()},
                                       "xla_flags": os.environ.get("XLA_FLAGS", "")}),
        flush=True)
  for line in sys.stdin:
    jax.block_until_ready(calls[line.strip()][0]())
    print(cpu_fusion.DONE, flush=True)


if __name__ == "__main__":
  main()
