"""Several seeds of one config trained together as one vmapped program.

With `config.num_seeds = S > 1` a run trains the seeds `config.seed`, ...,
`config.seed + S - 1` of the same config at once: the learners of all seeds
are stacked on a leading seed axis and every train and evaluation step is
`jax.vmap`ped over that axis. Small models (the MLP) leave most of a
processor idle, so S seeds in one program cost far less than S runs
(`benchmarks/seeds.py` measures it).

Each seed keeps everything a separate run with that seed would have: its own
stream partition and training subset, initialisation, data order,
augmentation, early stopping and best epoch, all derived from its seed as in
`alma_jax.run`; results agree with separate runs up to the order of
floating-point sums. A seed that stopped early stops counting steps (its
best epoch is kept) while the others go on.

Outputs in the workdir:
  seed_<seed>/   the `config.json` (with `seed=<seed>`, `num_seeds=1`),
                 `log.jsonl` and `summary.json` of that seed, as a separate
                 run writes them;
  config.json    the config as given;
  architecture.jsonl  the architecture after each stage (the same for all seeds);
  summary.json   each summary metric's mean over seeds and its standard
                 deviation (`<metric>_std`), the per-seed summaries, and the
                 time breakdown of the whole program;
  checkpoints/   the stacked state, so the run resumes like a single one.

Only methods whose architecture grows the same way for every seed can share
a program: sm, ens, umix and gens (gMoE's splits depend on each seed's data).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from alma_jax import checkpoint as ckpt_lib
from alma_jax import io_utils
from alma_jax import run as run_lib
from alma_jax import schedule
from alma_jax import sharding
from alma_jax import timing
from alma_jax import validation
from alma_jax.data import stream as stream_lib
from alma_jax.methods import ensemble
from alma_jax.methods.base import Learner
from alma_jax.metrics import Log, Record
from alma_jax.train import Trainer, _padded_orders, divergence_error, put_dataset, tree_all_finite

SUPPORTED_METHODS = ("ens", "gens", "sm", "umix")


def check_config(config) -> int:
  """Validates `config.num_seeds` (and that the method can share a program); returns it."""
  n = validation._int(config, "num_seeds", 1, default=1)  # pylint: disable=protected-access
  if n > 1 and config.method.name not in SUPPORTED_METHODS:
    raise validation.ConfigError(
        f"config.num_seeds={n} needs a method whose growth is the same for every seed; "
        f"config.method.name={config.method.name!r} is not one; valid names: "
        f"{list(SUPPORTED_METHODS)} (or config.num_seeds=1)")
  return n


def seeds_of(config) -> list[int]:
  return [int(config.seed) + i for i in range(int(config.get("num_seeds", 1)))]


def seed_config(config, seed: int):
  """The config of a separate run of `seed` (what its seed directory records)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.seed = seed
    c.num_seeds = 1
  return c


def unstack(tree, i: int):
  """Seed `i` of a stacked tree (a `Learner` stays a `Learner`)."""
  return jax.tree.map(lambda a: a[i], tree)


def _stack_keys(keys: list[jax.Array]) -> jax.Array:
  return jax.random.wrap_key_data(jnp.stack([jax.random.key_data(k) for k in keys]))


def _select(take: np.ndarray, new, old):
  """Per seed: `new` where `take[s]`, else `old` (trees with a leading seed axis)."""
  take = jnp.asarray(take)
  return jax.tree.map(lambda a, b: jnp.where(take.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                      new, old)


@dataclasses.dataclass(frozen=True)
class SeedStageStats:
  """Per-seed facts of one stage (arrays of length S)."""

  epochs_run: np.ndarray
  best_epoch: np.ndarray
  best_val_accuracy: np.ndarray
  steps_run: np.ndarray
  diverged: np.ndarray
  train_s: float
  eval_s: float


class SeedTrainer:
  """The train and eval steps of a `Trainer`, vmapped over a leading seed axis."""

  def __init__(self, trainer: Trainer, num_seeds: int):
    self.trainer = trainer
    self.num_seeds = num_seeds

  def train_fn(self, structure) -> Callable:
    tr = self.trainer
    axes = (0, 0, 0, 0, None, None, None, None, 0, 0, 0, None)
    return tr._cached("seeds_train", structure, lambda: jax.jit(  # pylint: disable=protected-access
        jax.vmap(tr.chunk_fn(structure), in_axes=axes), donate_argnums=(0, 2, 3)))

  def eval_fn(self, structure, shared: bool) -> Callable:
    """Vmapped evaluation; `shared`: all seeds see the same examples (one index vector)."""
    tr = self.trainer
    ex = None if shared else 0
    axes = (0, 0, None, None, None, None, ex, ex)
    return tr._cached(f"seeds_eval_{'shared' if shared else 'own'}", structure,  # pylint: disable=protected-access
                      lambda: jax.jit(jax.vmap(tr.eval_body(structure), in_axes=axes)))

  def evaluate(self, learner: Learner, idx: np.ndarray, split: str) -> np.ndarray:
    """Per-seed accuracy of the stacked `learner` on examples `idx` of `split`.

    `idx` is (S, n), the examples of each seed, or (n,), the same examples
    for all seeds (the test set), which are then gathered once per batch.
    """
    tr, d = self.trainer, self.trainer.data
    xs, ys = (d.train_x, d.train_y) if split == "train" else (d.test_x, d.test_y)
    shared = idx.ndim == 1
    fn = self.eval_fn(learner.structure, shared)
    learner = tr.place(learner)
    results = [fn(learner.params, learner.model_state, xs, ys, d.mean, d.std, i, m)[0]
               for i, m in tr.eval_chunks(idx)]
    return np.sum([np.asarray(c) for c in results], axis=0) / idx.shape[-1]

  def fit_stage(self, learner: Learner, train_idx: np.ndarray, val_idx: np.ndarray,
                keys: jax.Array, *, t: int, seeds: list[int], opt_state=None,
                progress: Callable[[str], None] | None = None):
    """`Trainer.fit_stage` for every seed at once; `train_idx` (S, n), `val_idx` (S, m)."""
    tr, method, cfg = self.trainer, self.trainer.method, self.trainer.config.train
    num = self.num_seeds
    structure = learner.structure
    trainable, frozen = tr.place(jax.vmap(method.partition)(learner))
    trainable = jax.tree.map(jnp.copy, trainable)  # the step donates its inputs
    model_state = jax.tree.map(jnp.copy, tr.place(learner.model_state))
    opt_state = tr.place(jax.vmap(tr.tx.init)(trainable) if opt_state is None else opt_state)
    fn = self.train_fn(structure)
    d, k = method.num_data_orders(structure), tr.steps_per_call
    rngs = [np.random.default_rng(np.asarray(jax.random.key_data(keys[i])).ravel().tolist())
            for i in range(num)]
    dd = tr.data
    best = learner
    best_acc, best_epoch = np.full(num, -1.0), np.zeros(num, int)
    since_best, epochs_run, steps_run = np.zeros(num, int), np.zeros(num, int), np.zeros(num, int)
    active, diverged = np.ones(num, bool), np.zeros(num, bool)
    timer = timing.Breakdown()
    last_report = time.monotonic()
    for epoch in range(1, int(cfg.epochs) + 1):
      with timer("train_s"):
        orders = [_padded_orders(rngs[i], train_idx[i], d, tr.batch_size, k) for i in range(num)]
        idx, mask = np.stack([o[0] for o in orders]), np.stack([o[1] for o in orders])
        steps = orders[0][2]
        losses = []
        for c in range(idx.shape[1] // k):
          sl = slice(c * k, (c + 1) * k)
          trainable, opt_state, model_state, loss = fn(
              trainable, frozen, opt_state, model_state, dd.train_x, dd.train_y, dd.mean, dd.std,
              sharding.put_batch(tr.mesh, idx[:, sl], 3),
              sharding.put_batch(tr.mesh, mask[:, sl], 3), keys, np.uint32(epoch * 100003 + c))
          losses.append(loss)
        losses = np.concatenate([np.asarray(l) for l in losses], axis=1)[:, :steps]
        steps_run += steps * active
        epochs_run[active] = epoch
      current = Learner(params=jax.vmap(method.combine)(learner, trainable),
                        model_state=model_state, structure=structure)
      finite = np.all(np.isfinite(losses), axis=1) & np.asarray(jax.vmap(tree_all_finite)(trainable))
      bad = active & ~finite
      if bad.any():
        which = [seeds[i] for i in np.flatnonzero(bad)]
        if cfg.get("on_divergence", "raise") != "rollback":
          raise divergence_error(t, epoch, f" (seeds {which})")
        logging.warning("stage t=%d epoch %d: non-finite loss or parameters for seeds %s; they "
                        "roll back to their best epoch and end the stage", t, epoch, which)
        diverged |= bad
        active &= ~bad
      with timer("eval_s"):
        acc = self.evaluate(current, val_idx, "train")
      improved = active & (acc > best_acc)
      best = _select(improved, current, best)
      best_acc = np.where(improved, acc, best_acc)
      best_epoch = np.where(improved, epoch, best_epoch)
      since_best = np.where(improved, 0, since_best + active)
      active &= since_best < int(cfg.patience)
      if progress is not None and time.monotonic() - last_report >= cfg.get("progress_every_s", 10.0):
        last_report = time.monotonic()
        progress(f"  t={t} epoch {epoch}/{cfg.epochs} loss={np.mean(losses):.4f} "
                 f"val_acc={np.mean(acc):.4f} (mean of {num} seeds, {int(active.sum())} training)")
      if not active.any():
        break
    spent = timer.as_dict()
    return best, opt_state, SeedStageStats(epochs_run, best_epoch, np.maximum(best_acc, 0.0),
                                           steps_run, diverged, spent["train_s"], spent["eval_s"])


# -- the run ------------------------------------------------------------------------------------
def _seed_dir(workdir: str, seed: int) -> str:
  return os.path.join(workdir, f"{run_lib.SEED_DIR_PREFIX}{seed}")


def mean_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
  """Each numeric metric's mean over seeds and its standard deviation (`<key>_std`)."""
  out = {}
  for key in summaries[0]:
    values = np.asarray([s[key] for s in summaries], np.float64)
    out[key] = float(np.mean(values))
    out[f"{key}_std"] = float(np.std(values))
  return out


def run_seeds(config, workdir: str, overwrite: bool, signals, startup_s: float | None):
  """`alma_jax.run.run` for `config.num_seeds` > 1 (called from there)."""
  t_start = time.monotonic()
  timer = timing.Breakdown()
  seeds = seeds_of(config)
  num = len(seeds)
  s = config.stream

  # -- data, streams, method ----------------------------------------------------------------------
  with timer("data_s"):
    mesh = sharding.make_mesh(config.mesh.num_devices)
    ds = run_lib.load_data(config, subset_train=False)
    subsets = [run_lib.subset_indices(config, len(ds.train_y), sd) for sd in seeds]
    n_train = len(ds.train_y) if subsets[0] is None else len(subsets[0])
    streams = [stream_lib.make_stream(n_train, s.num_megabatches, s.val_fraction, sd)
               for sd in seeds]
    validation.validate_data(config, n_train, streams[0])
    method = validation.make_method(config, ds.train_x.shape[1:], ds.num_classes)
    data = put_dataset(mesh, ds)
  if jax.default_backend() == "cpu" and config.model.name in ensemble.LOOP_ON_CPU:
    logging.warning("config.num_seeds=%d with config.model.name=%r on CPU: vmapped convolutions "
                    "run as grouped convolutions, many times slower than separate runs "
                    "(benchmarks/ensemble_strategy.py); separate runs are faster here", num,
                    config.model.name)
  trainer = Trainer(method, config, data, mesh)
  st = SeedTrainer(trainer, num)
  keys = _stack_keys([jax.random.key(sd) for sd in seeds])
  fold = lambda ks, i: jax.vmap(lambda kk: jax.random.fold_in(kk, i))(ks)

  def to_train_split(i: int, idx: np.ndarray) -> np.ndarray:
    return idx if subsets[i] is None else subsets[i][idx].astype(np.int32)

  # -- outputs: start afresh or resume ----------------------------------------------------------------
  ckpt = None
  try:
    with signals.critical():
      if overwrite:
        run_lib._clear_outputs(workdir)  # pylint: disable=protected-access
      snap = None
      if config.checkpoint.enabled:
        ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, run_lib.CHECKPOINT_DIR),
                                     config.checkpoint.max_to_keep)
        snap = ckpt.restore_latest(
            run_lib._target_builder(method, trainer.tx, mesh, keys, lift=jax.vmap),  # pylint: disable=protected-access
            quarantine_dir=os.path.join(workdir, run_lib.CORRUPT_DIR),
            check_extra=run_lib._config_checker(config))  # pylint: disable=protected-access
      records = [[] for _ in seeds]
      if snap is not None:
        if len(snap.records) != snap.t + 1:
          raise ckpt_lib.CheckpointError(f"checkpoint step {snap.t} holds {len(snap.records)} "
                                         f"time steps; expected {snap.t + 1}")
        records = [[Record.from_dict(r["seeds"][i]) for r in snap.records] for i in range(num)]
      io_utils.write_json_atomic(os.path.join(workdir, run_lib.CONFIG_FILE),
                                 validation.config_dict(config))
      for i, sd in enumerate(seeds):
        os.makedirs(_seed_dir(workdir, sd), exist_ok=True)
        io_utils.write_json_atomic(os.path.join(_seed_dir(workdir, sd), run_lib.CONFIG_FILE),
                                   validation.config_dict(seed_config(config, sd)))
        io_utils.write_jsonl_atomic(os.path.join(_seed_dir(workdir, sd), run_lib.LOG_FILE),
                                    [r.to_dict() for r in records[i]])
      run_lib.sync_architecture_log(workdir, len(records[0]) - 1)
      if snap is None or snap.t < s.num_megabatches:
        for path in [workdir] + [_seed_dir(workdir, sd) for sd in seeds]:
          if os.path.exists(os.path.join(path, run_lib.SUMMARY_FILE)):
            os.unlink(os.path.join(path, run_lib.SUMMARY_FILE))

    # -- the stream ---------------------------------------------------------------------------------
    logs = [Log.from_records(r) for r in records]
    compiled_before: set[str] = set()
    elapsed_before, opt_state, errors = 0.0, None, None
    if snap is None:
      learner = jax.vmap(method.init)(fold(keys, 0))
    else:
      learner = snap.learner
      errors = np.asarray([r[-1].test_error for r in records])
      opt_state = snap.opt_state if config.train.keep_optimizer_state else None
      compiled_before = set(snap.extra.get("compiled", []))
      elapsed_before = float(snap.extra.get("elapsed_s", 0.0))
      timer.add(snap.extra.get("timings", {}))
      signals.last_checkpoint = snap.t
      logging.info("resuming %s after t=%d/%d (its last complete checkpoint)", workdir, snap.t,
                   s.num_megabatches)
    elapsed = lambda: elapsed_before + time.monotonic() - t_start
    test_idx = np.arange(len(ds.test_y), dtype=np.int32)

    for t in range(len(records[0]), s.num_megabatches + 1):
      t_step = time.monotonic()
      trained = t > 0 and schedule.is_training_time(t, s.wait)
      steps = np.zeros(num)
      if trained:
        stages = [schedule.stage_data(streams[i], t, s.wait, s.replay, sd)
                  for i, sd in enumerate(seeds)]
        train_idx = np.stack([to_train_split(i, g.train) for i, g in enumerate(stages)])
        val_idx = np.stack([to_train_split(i, g.val) for i, g in enumerate(stages)])
        skeys = fold(keys, t)
        ctx = run_lib.StageContext(t=t, train_idx=train_idx, val_idx=val_idx, trainer=trainer)
        if s.init_from_scratch:
          learner = jax.vmap(method.reinit)(learner, fold(skeys, 1))
          opt_state = None
        learner = jax.vmap(lambda l, kk: method.before_stage(l, kk, ctx))(learner, fold(skeys, 2))
        if not config.train.keep_optimizer_state:
          opt_state = None
        run_lib._kill_point("stage", t)  # pylint: disable=protected-access
        learner, opt_state, stats = st.fit_stage(
            learner, train_idx, val_idx, fold(skeys, 3), t=t, seeds=seeds, opt_state=opt_state,
            progress=logging.info)
        steps = stats.steps_run
        timer.add({"train_s": stats.train_s, "eval_s": stats.eval_s})
        learner = jax.vmap(lambda l, kk: method.after_stage(l, kk, ctx))(learner, fold(skeys, 4))
      flops = trainer.flops(unstack(learner, 0))
      if errors is None or trained:  # an unchanged model is not re-evaluated
        with timer("eval_s"):
          errors = 1.0 - st.evaluate(learner, test_idx, "test")
      num_params = method.num_params(unstack(learner, 0))
      wall = time.monotonic() - t_step
      recs = [Record(t=t, test_error=float(errors[i]), num_params=num_params,
                     train_flops=flops["train_step"] * float(steps[i]),
                     train_flops_forward=flops["train_step_forward"] * float(steps[i]),
                     inference_flops_per_example=flops["inference_per_example"], trained=trained,
                     wall_s=wall) for i in range(num)]
      logs = [log.append(r) for log, r in zip(logs, recs)]
      with timer("io_s"), signals.critical():
        for sd, r in zip(seeds, recs):
          io_utils.append_record(os.path.join(_seed_dir(workdir, sd), run_lib.LOG_FILE), r.to_dict())
        if trained:
          arch = method.describe(unstack(learner, 0))
          io_utils.append_jsonl(os.path.join(workdir, run_lib.ARCH_FILE), {"t": t, **arch})
        run_lib._kill_point("log", t)  # pylint: disable=protected-access
        if ckpt is not None and run_lib._should_checkpoint(config, t, trained, s.num_megabatches):  # pylint: disable=protected-access
          extra = {"compiled": sorted(compiled_before | run_lib._compiled_keys(trainer)),  # pylint: disable=protected-access
                   "elapsed_s": elapsed(), "timings": timer.as_dict(),
                   "config": validation.config_dict(config)}
          kept = opt_state if config.train.keep_optimizer_state else None
          per_t = [{"t": j, "seeds": [log.records[j].to_dict() for log in logs]}
                   for j in range(t + 1)]
          ckpt.start_save(t, learner, kept, jax.random.key_data(fold(keys, t)), per_t, extra)
          run_lib._kill_point("checkpoint", t)  # pylint: disable=protected-access
          ckpt.wait()
          signals.last_checkpoint = t
          run_lib._kill_point("saved", t)  # pylint: disable=protected-access
      if trained:
        logging.info("t=%d/%d seeds=%d epochs=%s test_error=%.4f±%.4f %s elapsed=%.1fs", t,
                     s.num_megabatches, num, stats.epochs_run.tolist(), float(np.mean(errors)),
                     float(np.std(errors)), json.dumps(arch),
                     elapsed())

    # -- summaries ------------------------------------------------------------------------------------
    wall_s = elapsed()
    per_seed = [dict(log.summary(), wall_s=wall_s) for log in logs]
    timings = timer.report(wall_s, startup_s)
    top = dict(mean_summary(per_seed), seeds=seeds, num_seeds=num, per_seed=per_seed,
               wall_s=wall_s, timings=timings,
               num_compilations=len(compiled_before | run_lib._compiled_keys(trainer)))  # pylint: disable=protected-access
    top.pop("wall_s_std")
    run_lib._kill_point("summary")  # pylint: disable=protected-access
    with signals.critical():
      for sd, summary in zip(seeds, per_seed):
        io_utils.write_json_atomic(os.path.join(_seed_dir(workdir, sd), run_lib.SUMMARY_FILE),
                                   summary)
      io_utils.write_json_atomic(os.path.join(workdir, run_lib.SUMMARY_FILE), top)
    logging.info("done: %d seeds, CER=%.4f±%.4f final_error=%.4f±%.4f wall=%.1fs", num,
                 top["cer"], top["cer_std"], top["final_error"], top["final_error_std"], wall_s)
    return top
  finally:
    if ckpt is not None:
      ckpt.close()
