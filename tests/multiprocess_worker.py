"""One process of the two-process test (tests/test_multiprocess.py).

Trains one stage of a two-member ensemble (float64) on a mesh of 2 data x 2
model over the 4 CPU devices of both processes, then writes the parameters
this process holds (assembled from its own shards; NaN where it holds none)
and its test metrics to OUT/params_<process id>.npz.

  python -m tests.multiprocess_worker PORT PROCESS_ID OUT
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

from alma_jax.engine import population
from alma_jax.engine import train
from tests import helpers

DATA = helpers.synthetic_dataset(n_train=160, n_test=64)


def train_stage(num_devices: int, model: int):
  """(stacked best learner, test accuracy, test NLL) of the stage on a mesh (in float64)."""
  c = helpers.small_config(method="ens", width=4, batch_size=32, eval_batch_size=32)
  c.method.num_members = 2
  method, steps = helpers.make_steps(c, DATA, num_devices, model)
  best, _, _ = train.fit_one(steps, helpers.random_learner(method), np.arange(128, dtype=np.int32),
                             np.arange(128, 160, dtype=np.int32), jax.random.key(1))
  best = steps.place(population.stack([best]))
  acc, nll = steps.evaluate(best, "test", np.arange(64, dtype=np.int32))
  return best, acc, nll


def held(x: jax.Array) -> np.ndarray:
  """The values of `x` that this process's devices hold (NaN elsewhere)."""
  out = np.full(x.shape, np.nan)
  for shard in x.addressable_shards:
    out[shard.index] = np.asarray(shard.data)
  return out


def main(port: str, process_id: str, out: str) -> None:
  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_enable_x64", True)
  jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(process_id), initialization_timeout=120)
  best, acc, nll = train_stage(0, 2)
  leaves = {jax.tree_util.keystr(p): held(x)
            for p, x in jax.tree_util.tree_flatten_with_path(best.params)[0]}
  np.savez(os.path.join(out, f"params_{process_id}.npz"), acc=acc, nll=nll, **leaves)
  mesh = dict(best.params["head"]["kernel"].sharding.mesh.shape)
  print(f"process {jax.process_index()} of {jax.process_count()}: mesh {mesh}, test accuracy "
        f"{float(acc[0]):.4f}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
