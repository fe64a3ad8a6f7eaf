"""vmap over stacked members vs. a Python loop over them, per backbone and backend.

Times the real compiled train step of Ens (`alma_jax.engine.steps.Steps.train_call`
for a population of one learner: gather, augmentation, forward, backward and
optimizer update on a batch of 128 per member) for N members under
`config.method.strategy` = "vmap" and "loop", and one SM step for
reference. Reports the median of `--repeats` calls after a compiling and a
warm-up call (the settings interleaved, so that load from other processes
hits all of them alike), and the rule `strategy="auto"` applies on this
backend (`alma_jax.methods.ensemble.choose_strategy`).

Measured on a 2-core CPU (XLA:CPU, N=5): the MLP (H=64) runs about as fast
either way (vmap/loop 0.8-1.4 across runs on a loaded machine), the VGG
(C=16) about 25x slower with vmap, whose vmapped convolutions become grouped
convolutions; hence "auto" = loop for the VGG on CPU.

  python benchmarks/ensemble_strategy.py                    # mlp H=64, vgg C=16, N=5
  python benchmarks/ensemble_strategy.py --vgg_width=32 --repeats=9 --out=strategy.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from alma_jax.outputs import io_utils  # pylint: disable=wrong-import-position
from alma_jax.tuning import tune  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position,g-import-not-at-top
import numpy as np  # pylint: disable=wrong-import-position,g-import-not-at-top

from alma_jax import methods  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax import models  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.configuration import config_lib  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.engine import optim  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.engine import population  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.engine import sharding  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.engine.steps import Batch, Steps  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.methods import ensemble  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.stream import validation  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.tasks import images as image_task  # pylint: disable=wrong-import-position,g-import-not-at-top
from alma_jax.tuning import autotune  # pylint: disable=wrong-import-position,g-import-not-at-top

DATASETS = {"mlp": ("mnist", (28, 28, 1)), "vgg": ("cifar10", (32, 32, 3))}


def make_steps(model: str, width: int, method: str, members: int, strategy: str):
  """(method, Steps) of one setting on 1024 synthetic training images."""
  dataset, shape = DATASETS[model]
  c = config_lib.base_config(dataset, method)
  c.model.width = width
  if method != "sm":
    c.method.num_members = members
    c.method.strategy = strategy
  c.mesh.num_devices = 1
  c = autotune.by_rules(validation.complete(c))  # the rules decide what is left open
  mesh = sharding.make_mesh(1)
  rng = np.random.default_rng(0)
  x = rng.integers(0, 255, (1024,) + shape).astype(np.uint8)
  y = rng.integers(0, 10, 1024).astype(np.int32)
  ds = types.SimpleNamespace(train_x=x, train_y=y, test_x=x[:128], test_y=y[:128],
                             mean=np.full((shape[-1],), 0.4, np.float32),
                             std=np.full((shape[-1],), 0.25, np.float32))
  m = methods.make(c, shape, 10)
  return m, Steps.from_config(c, m, image_task.ImageTask.from_config(c),
                              optim.make_optimizer(c.optimizer), image_task.device_data(ds), mesh)


def stepper(model: str, width: int, method: str, members: int, strategy: str):
  """A function that runs one compiled train step and returns its seconds.

  The first call compiles; every call gets a fresh copy of the train state
  (the call donates it), made before the clock starts. A call of K =
  `config.train.steps_per_call` steps counts 1/K of its time per step.
  """
  m, steps = make_steps(model, width, method, members, strategy)
  learner = population.stack([m.init(jax.random.key(0))])  # a population of one
  d, k = m.num_data_orders(learner.structure), steps.steps_per_call
  shape = (1, k, d, steps.batch_size)
  batch = Batch(np.zeros(shape, np.int32), np.ones(shape, bool))
  keys = population.stack_keys([jax.random.key(0)])
  calls = [0]

  def step() -> float:
    state = jax.block_until_ready(steps.init_state(learner))
    t0 = time.perf_counter()
    out = steps.train_call(learner.structure, state, batch, keys, np.uint32(calls[0]))
    jax.block_until_ready(out)
    calls[0] += 1
    return (time.perf_counter() - t0) / k

  return step


def time_settings(settings: dict, repeats: int) -> dict:
  """Median seconds per step of each setting, the settings interleaved round by round.

  Interleaving spreads the noise of other processes on a shared machine over
  all settings alike. Two untimed calls (compilation, warm-up) come first.
  """
  steps = {name: stepper(*args) for name, args in settings.items()}
  for step in steps.values():
    step(), step()
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      times[name].append(step())
  return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--members", type=int, default=5)
  p.add_argument("--mlp_width", type=int, default=64)
  p.add_argument("--vgg_width", type=int, default=16)
  p.add_argument("--models", default="mlp,vgg")
  p.add_argument("--repeats", type=int, default=7, help="timed calls per setting (median)")
  p.add_argument("--out", default="", help="also write the results as JSON here")
  args = p.parse_args(argv)
  io_utils.check_output_file(p, "--out", args.out)  # before measuring
  tune.allocator_for(args.models.split(","))  # as runs of these backbones, before JAX starts
  backend = jax.default_backend()
  print(f"backend={backend} devices={jax.devices()[0].device_kind} cpus={os.cpu_count()} "
        f"N={args.members} batch=128 repeats={args.repeats} (median ms per train step)")
  header = f"{'model':<10}{'sm x1':>10}{'vmap':>10}{'loop':>10}{'vmap/loop':>11}{'best':>6}{'auto':>6}"
  print(header)
  rows = []
  for model in args.models.split(","):
    width = args.mlp_width if model == "mlp" else args.vgg_width
    t = time_settings({"sm": (model, width, "sm", 1, "auto"),
                       **{s: (model, width, "ens", args.members, s) for s in ("vmap", "loop")}},
                      args.repeats)
    sm = t.pop("sm")
    best = min(t, key=t.get)
    auto = ensemble.choose_strategy("auto", model, backend)
    row = {"model": model, "width": width, "members": args.members, "backend": backend,
           "sm_ms": 1e3 * sm, "vmap_ms": 1e3 * t["vmap"], "loop_ms": 1e3 * t["loop"],
           "vmap_over_loop": t["vmap"] / t["loop"], "best": best, "auto": auto}
    rows.append(row)
    print(f"{model + str(width):<10}{row['sm_ms']:>10.1f}{row['vmap_ms']:>10.1f}"
          f"{row['loop_ms']:>10.1f}{row['vmap_over_loop']:>11.2f}{best:>6}{auto:>6}", flush=True)
  loop = models.names(lambda s: s.conv_heavy) if backend == "cpu" else []
  print(f"auto rule on {backend}: loop for {loop}, vmap otherwise")
  mismatch = [r["model"] for r in rows if r["best"] != r["auto"] and
              max(r["vmap_ms"], r["loop_ms"]) > 1.1 * min(r["vmap_ms"], r["loop_ms"])]
  if mismatch:
    print(f"WARNING: auto picks the slower strategy (by > 10%) for {mismatch} on {backend}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
