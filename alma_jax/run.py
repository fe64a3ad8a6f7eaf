"""The stream loop (Algorithm 1): wait, replay, grow, train, evaluate, log."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from alma_jax import io_utils
from alma_jax import methods
from alma_jax import schedule
from alma_jax import sharding
from alma_jax.data import stream as stream_lib
from alma_jax.metrics import Log, Record
from alma_jax.train import Trainer, put_dataset


@dataclasses.dataclass(frozen=True)
class StageContext:
  """What growth functions may look at: the stage's data and the trainer."""

  t: int
  train_idx: np.ndarray
  val_idx: np.ndarray
  trainer: Trainer


def load_data(config):
  """The dataset named in `config.data`, cut to the configured subsets."""
  from alma_jax.data import images  # pylint: disable=g-import-not-at-top
  ds = images.load_image_dataset(config.data.name, data_dir=config.data.data_dir,
                                 cache_dir=config.data.cache_dir,
                                 use_cache=config.data.use_cache)
  rng = np.random.default_rng([config.seed, 7])
  changes = {}
  if config.data.train_subset:
    n = min(int(config.data.train_subset), len(ds.train_y))
    sel = np.sort(rng.choice(len(ds.train_y), n, replace=False))
    changes.update(train_x=np.asarray(ds.train_x[sel]), train_y=np.asarray(ds.train_y[sel]))
  if config.data.test_subset:
    n = min(int(config.data.test_subset), len(ds.test_y))
    changes.update(test_x=np.asarray(ds.test_x[:n]), test_y=np.asarray(ds.test_y[:n]))
  return dataclasses.replace(ds, **changes) if changes else ds


def _stage_sizes(stream, config) -> list[int]:
  s = config.stream
  sizes = []
  for t in schedule.training_times(stream.num_megabatches, s.wait):
    new = sum(len(stream.train[i - 1]) for i in range(t - s.wait + 1, t + 1))
    past = sum(len(stream.train[i - 1]) for i in range(1, t - s.wait + 1))
    sizes.append(new + int(round(s.replay * past)))
  return sizes


def _log_estimate(trainer: Trainer, learner, stream, config) -> None:
  """Logs an upper bound on the training time (all epochs, no early stop)."""
  per_step = trainer.seconds_per_step(learner)
  b = config.train.batch_size
  steps = sum(-(-n // b) for n in _stage_sizes(stream, config)) * config.train.epochs
  est = per_step * steps
  logging.info("estimated training time: at most %.0f s (%.1f h) for %d steps at %.4f s/step "
               "(growing models get slower; early stopping shortens it)", est, est / 3600, steps,
               per_step)


def run(config, workdir: str) -> dict[str, Any]:
  """Runs one ALMA stream as configured; writes config.json, log.jsonl, summary.json."""
  t_start = time.monotonic()
  timings = {"data_s": 0.0, "train_s": 0.0, "eval_s": 0.0, "io_s": 0.0}
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, "log.jsonl")
  io_utils.write_json_atomic(os.path.join(workdir, "config.json"), json.loads(config.to_json()))
  if os.path.exists(log_path):
    os.unlink(log_path)

  # -- data and stream ---------------------------------------------------------
  t0 = time.monotonic()
  mesh = sharding.make_mesh(config.mesh.num_devices)
  ds = load_data(config)
  stream = stream_lib.make_stream(len(ds.train_y), config.stream.num_megabatches,
                                  config.stream.val_fraction, config.seed)
  schedule.check_wait(stream.num_megabatches, config.stream.wait)
  data = put_dataset(mesh, ds)
  timings["data_s"] = time.monotonic() - t0
  logging.info("data %s: %d train / %d test examples, B=%d mega-batches of ~%d, wait=%d, replay=%.2f",
               config.data.name, len(ds.train_y), len(ds.test_y), stream.num_megabatches,
               len(stream.train[0]) + len(stream.val[0]), config.stream.wait, config.stream.replay)

  # -- learner -------------------------------------------------------------------
  method = methods.get(config.method.name)(config, data.input_shape, ds.num_classes)
  trainer = Trainer(method, config, data, mesh)
  key = jax.random.key(config.seed)
  learner = method.init(jax.random.fold_in(key, 0))
  if jax.default_backend() == "cpu":
    _log_estimate(trainer, learner, stream, config)

  log = Log()
  opt_state = None
  last_error = None
  for t in range(0, stream.num_megabatches + 1):
    t_step = time.monotonic()
    trained = t > 0 and schedule.is_training_time(t, config.stream.wait)
    flops = trainer.flops(learner)
    train_flops = train_fwd = 0.0
    if trained:
      stage = schedule.stage_data(stream, t, config.stream.wait, config.stream.replay, config.seed)
      skey = jax.random.fold_in(key, t)
      ctx = StageContext(t=t, train_idx=stage.train, val_idx=stage.val, trainer=trainer)
      if config.stream.init_from_scratch:
        learner = method.reinit(learner, jax.random.fold_in(skey, 1))
        opt_state = None
      learner = method.before_stage(learner, jax.random.fold_in(skey, 2), ctx)
      if not config.train.keep_optimizer_state:
        opt_state = None
      flops = trainer.flops(learner)
      learner, opt_state, stats = trainer.fit_stage(
          learner, stage.train, stage.val, jax.random.fold_in(skey, 3), t=t, opt_state=opt_state,
          progress=logging.info)
      train_flops = flops["train_step"] * stats.steps_run
      train_fwd = flops["train_step_forward"] * stats.steps_run
      timings["train_s"] += stats.train_s
      timings["eval_s"] += stats.eval_s
      learner = method.after_stage(learner, jax.random.fold_in(skey, 4), ctx)
      flops = trainer.flops(learner)
    if last_error is None or trained:  # an unchanged model is not re-evaluated
      t1 = time.monotonic()
      last_error = trainer.test_error(learner)
      timings["eval_s"] += time.monotonic() - t1
    rec = Record(t=t, test_error=last_error, num_params=method.num_params(learner),
                 train_flops=train_flops, train_flops_forward=train_fwd,
                 inference_flops_per_example=flops["inference_per_example"], trained=trained,
                 wall_s=time.monotonic() - t_step)
    log = log.append(rec)
    t1 = time.monotonic()
    io_utils.append_jsonl(log_path, rec.to_dict())
    timings["io_s"] += time.monotonic() - t1
    if trained:
      logging.info("t=%d/%d epochs=%d best_val_acc=%.4f test_error=%.4f %s elapsed=%.1fs", t,
                   stream.num_megabatches, stats.epochs_run, stats.best_val_accuracy, last_error,
                   json.dumps(method.describe(learner)), time.monotonic() - t_start)

  summary = log.summary()
  summary["wall_s"] = time.monotonic() - t_start
  summary["timings"] = timings
  summary["num_compilations"] = trainer.num_compilations
  io_utils.write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  logging.info("done: CER=%.4f mean_error=%.4f final_error=%.4f Mem=%d Comp=%.3e wall=%.1fs",
               summary["cer"], summary["mean_error"], summary["final_error"], summary["mem"],
               summary["comp"], summary["wall_s"])
  return summary
