"""The stream loop (Algorithm 1): wait, replay, grow, train, evaluate, log.

A run writes `config.json`, `log.jsonl` (one record per time step),
`checkpoints/` (one orbax checkpoint per training stage, see
`config.checkpoint`) and, at the end, `summary.json` into its workdir.
Running the same command again resumes from the last complete checkpoint;
every random choice is seeded by (config.seed, t), so a resumed run writes
the same records and summary as an uninterrupted one (wall-clock times
aside).

SIGINT and SIGTERM stop a run at the next safe point: a stage in progress is
abandoned (it is recomputed on resume), a log or checkpoint write in progress
is finished first; then `RunInterrupted` is raised.

Testing hook: the environment variable `ALMA_JAX_TEST_KILL_AT` (a comma
separated list such as `t=2:checkpoint,summary`) makes the process send
itself `ALMA_JAX_TEST_KILL_SIGNAL` (default SIGKILL) at the named points:
`t=N:stage` (before training stage N), `t=N:epoch` (at a progress message of
stage N), `t=N:log` (after the record of N is logged), `t=N:checkpoint`
(while the checkpoint of N is being written), `t=N:saved` (after it is
written) and `summary` (before summary.json is written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from alma_jax import checkpoint as ckpt_lib
from alma_jax import io_utils
from alma_jax import schedule
from alma_jax import sharding
from alma_jax import timing
from alma_jax import validation
from alma_jax import workdir_checks
from alma_jax import workdir_lock
from alma_jax.data import stream as stream_lib
from alma_jax.metrics import Log, Record
from alma_jax.train import Trainer, put_dataset

CONFIG_FILE, LOG_FILE, SUMMARY_FILE = "config.json", "log.jsonl", "summary.json"
# One line per training stage: t and the method's description of the architecture
# after it (members, experts per mixture layer, ...), for plots of growth.
ARCH_FILE = "architecture.jsonl"
CHECKPOINT_DIR, CORRUPT_DIR = "checkpoints", "checkpoints_unreadable"
SEED_DIR_PREFIX = "seed_"  # outputs of one seed when config.num_seeds > 1


@dataclasses.dataclass(frozen=True)
class StageContext:
  """What growth functions may look at: the stage's data and the trainer."""

  t: int
  train_idx: np.ndarray
  val_idx: np.ndarray
  trainer: Trainer


def subset_indices(config, num_train: int, seed: int) -> np.ndarray | None:
  """The training examples (sorted indices) a run with `seed` uses; None: all of them."""
  if not config.data.train_subset:
    return None
  rng = np.random.default_rng([seed, 7])
  n = min(int(config.data.train_subset), num_train)
  return np.sort(rng.choice(num_train, n, replace=False))


def load_data(config, *, subset_train: bool = True):
  """The dataset named in `config.data`, cut to the configured subsets.

  With `subset_train=False` the whole training split is kept (several seeds
  then pick their own subsets with `subset_indices`).
  """
  from alma_jax.data import images  # pylint: disable=g-import-not-at-top
  ds = images.load_image_dataset(config.data.name, data_dir=config.data.data_dir,
                                 cache_dir=config.data.cache_dir,
                                 use_cache=config.data.use_cache,
                                 download=config.data.get("download", "auto"))
  changes = {}
  sel = subset_indices(config, len(ds.train_y), config.seed) if subset_train else None
  if sel is not None:
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
  b = config.train.batch_size
  steps = sum(-(-n // b) for n in _stage_sizes(stream, config)) * config.train.epochs
  if steps < 5000:  # a short run: measuring would cost a noticeable part of it
    return
  per_step = trainer.seconds_per_step(learner)
  est = per_step * steps
  logging.info("estimated training time: at most %.0f s (%.1f h) for %d steps at %.4f s/step "
               "(growing models get slower; early stopping shortens it)", est, est / 3600, steps,
               per_step)


# -- interruption ---------------------------------------------------------------------------
class RunInterrupted(BaseException):
  """SIGINT/SIGTERM stopped the run; `exit_code` is 128 + the signal number."""

  def __init__(self, signum: int, last_checkpoint: int | None):
    self.signum = signum
    self.last_checkpoint = last_checkpoint
    self.exit_code = 128 + signum
    where = (f"the last checkpoint is t={last_checkpoint}" if last_checkpoint is not None
             else "no checkpoint was written yet")
    super().__init__(f"interrupted by {signal.Signals(signum).name}; {where}")


class _Signals:
  """SIGINT/SIGTERM handlers: raise at once, or after the current `critical()` section."""

  def __init__(self):
    self.pending: int | None = None
    self.last_checkpoint: int | None = None
    self._depth = 0
    self._old = {}

  def __enter__(self) -> "_Signals":
    if threading.current_thread() is threading.main_thread():
      for s in (signal.SIGINT, signal.SIGTERM):
        self._old[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._old.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame) -> None:
    del frame
    if self.pending is None:
      self.pending = signum
    if self._depth == 0:
      raise RunInterrupted(self.pending, self.last_checkpoint)

  @contextlib.contextmanager
  def critical(self):
    """A section (a write) that a signal does not interrupt; it acts after it."""
    self._depth += 1
    try:
      yield
    finally:
      self._depth -= 1
    if self._depth == 0 and self.pending is not None:
      raise RunInterrupted(self.pending, self.last_checkpoint)


def _kill_point(point: str, t: int | None = None) -> None:
  """The testing hook described in the module docstring."""
  spec = os.environ.get("ALMA_JAX_TEST_KILL_AT")
  if spec and (point if t is None else f"t={t}:{point}") in spec.split(","):
    os.kill(os.getpid(), getattr(signal, os.environ.get("ALMA_JAX_TEST_KILL_SIGNAL", "SIGKILL")))


# -- the workdir ------------------------------------------------------------------------------
def _has_progress(workdir: str) -> bool:
  """Whether `workdir` holds records, checkpoints or a summary of a run."""
  ckpt_dir, log = os.path.join(workdir, CHECKPOINT_DIR), os.path.join(workdir, LOG_FILE)
  return (os.path.exists(os.path.join(workdir, SUMMARY_FILE))
          or (os.path.exists(log) and os.path.getsize(log) > 0)
          or (os.path.isdir(ckpt_dir) and any(n[:1].isdigit() for n in os.listdir(ckpt_dir))))


def _clear_outputs(workdir: str) -> None:
  """Removes the run outputs from `workdir` (nothing else in it)."""
  seed_dirs = [n for n in os.listdir(workdir) if n.startswith(SEED_DIR_PREFIX)]
  for name in (CONFIG_FILE, LOG_FILE, SUMMARY_FILE, ARCH_FILE, CHECKPOINT_DIR, CORRUPT_DIR,
               *seed_dirs):
    path = os.path.join(workdir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.unlink(path)
  logging.warning("--overwrite: removed the previous run's outputs from %s", workdir)


def sync_architecture_log(workdir: str, last_t: int) -> None:
  """Keeps the lines of `ARCH_FILE` up to `last_t` (what a resumed run has done)."""
  path = os.path.join(workdir, ARCH_FILE)
  kept = [r for r in io_utils.read_jsonl(path) if r["t"] <= last_t] if os.path.exists(path) else []
  io_utils.write_jsonl_atomic(path, kept)


def _target_builder(method, tx, mesh, key, lift=lambda f: f):
  """(structure, has_opt_state) -> the abstract checkpoint state, replicated on `mesh`.

  `lift` maps a function of one key to the function of `key` that builds the
  state (`jax.vmap` for the stacked learners of several seeds).
  """
  replicated = sharding.replicated(mesh)

  def build(structure, has_opt_state):
    learner = jax.eval_shape(lift(lambda k: method.init(k, structure)), key)
    if learner.structure != structure:
      raise ckpt_lib.IncompatibleCheckpointError(
          f"method {method.name!r} rebuilds structure {learner.structure!r} from the "
          f"checkpoint's structure {structure!r}")
    tree = {"params": learner.params, "model_state": learner.model_state,
            "key": jax.eval_shape(lift(jax.random.key_data), key)}
    if has_opt_state:
      tree["opt_state"] = jax.eval_shape(
          lift(lambda k: tx.init(method.partition(method.init(k, structure))[0])), key)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                        tree)

  return build


def _config_checker(config):
  current = validation.config_dict(config)

  def check(extra):
    diffs = validation.config_diff(extra.get("config", current), current)
    if diffs:
      raise ckpt_lib.IncompatibleCheckpointError(
          f"the checkpoints were written by a different config: {'; '.join(diffs)}; pass "
          "--overwrite to discard them")

  return check


def _compiled_keys(trainer: Trainer) -> set[str]:
  return {json.dumps(ckpt_lib.structure_to_json(k)) for k in trainer.compiled}


def _should_checkpoint(config, t: int, trained: bool, last: int) -> bool:
  every = int(config.checkpoint.get("every", 1))
  return t in (0, last) or (trained and (t // config.stream.wait) % every == 0)


# -- the run ----------------------------------------------------------------------------------
def run(config, workdir: str, *, overwrite: bool = False,
        startup_s: float | None = None) -> dict[str, Any]:
  """Runs (or resumes) one ALMA stream; writes config.json, log.jsonl, summary.json.

  Args:
    config: the experiment config.
    workdir: output directory; a run found there is resumed when its config
      is the same (a different config is an error unless `overwrite`).
    overwrite: discard the outputs of a previous run in `workdir` first.
    startup_s: seconds the process spent before this call (interpreter and
      imports), reported in the summary's timing breakdown.

  Raises:
    ValueError: invalid config, data, workdir or checkpoints (nothing is
      written then), or another run holds `workdir`.
    DivergenceError: non-finite training loss (the checkpoints stay intact).
    RunInterrupted: SIGINT or SIGTERM.
  """
  validation.validate(config)
  validation.check_workdir(workdir)
  with workdir_lock.hold(workdir, primary=jax.process_index() == 0):
    if not overwrite:
      validation.check_resume(workdir, config, _has_progress(workdir))
    workdir_checks.check_outputs(workdir, config, overwrite)
    with _Signals() as signals:
      if int(config.get("num_seeds", 1)) > 1:
        from alma_jax import seeds  # pylint: disable=g-import-not-at-top
        return seeds.run_seeds(config, workdir, overwrite, signals, startup_s)
      return _run(config, workdir, overwrite, signals, startup_s)


def _run(config, workdir: str, overwrite: bool, signals: _Signals,
         startup_s: float | None) -> dict[str, Any]:
  t_start = time.monotonic()
  timer = timing.Breakdown()
  log_path = os.path.join(workdir, LOG_FILE)

  # -- data, stream, method ------------------------------------------------------------------
  with timer("data_s"):
    mesh = sharding.make_mesh(config.mesh.num_devices)
    ds = load_data(config)
    stream = stream_lib.make_stream(len(ds.train_y), config.stream.num_megabatches,
                                    config.stream.val_fraction, config.seed)
    validation.validate_data(config, len(ds.train_y), stream)
    method = validation.make_method(config, ds.train_x.shape[1:], ds.num_classes)
    data = put_dataset(mesh, ds)
  logging.info("data %s: %d train / %d test examples, B=%d mega-batches of ~%d, wait=%d, replay=%.2f",
               config.data.name, len(ds.train_y), len(ds.test_y), stream.num_megabatches,
               len(stream.train[0]) + len(stream.val[0]), config.stream.wait, config.stream.replay)
  trainer = Trainer(method, config, data, mesh)
  key = jax.random.key(config.seed)
  num_t = stream.num_megabatches

  # -- outputs: start afresh or resume ---------------------------------------------------------
  ckpt = None
  try:
    with signals.critical():
      if overwrite:
        _clear_outputs(workdir)
      snap = None
      if config.checkpoint.enabled:
        ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, CHECKPOINT_DIR),
                                     config.checkpoint.max_to_keep)
        snap = ckpt.restore_latest(_target_builder(method, trainer.tx, mesh, key),
                                   quarantine_dir=os.path.join(workdir, CORRUPT_DIR),
                                   check_extra=_config_checker(config))
      records = [] if snap is None else [Record.from_dict(r) for r in snap.records]
      if snap is not None and len(records) != snap.t + 1:
        raise ckpt_lib.CheckpointError(f"checkpoint step {snap.t} holds {len(records)} records; "
                                       f"expected {snap.t + 1}")
      io_utils.write_json_atomic(os.path.join(workdir, CONFIG_FILE), validation.config_dict(config))
      io_utils.write_jsonl_atomic(log_path, [r.to_dict() for r in records])
      sync_architecture_log(workdir, len(records) - 1)
      if (snap is None or snap.t < num_t) and os.path.exists(os.path.join(workdir, SUMMARY_FILE)):
        os.unlink(os.path.join(workdir, SUMMARY_FILE))
    return _loop(config, workdir, signals, ckpt, snap, records, stream, method, trainer, key,
                 timer, t_start, startup_s)
  finally:
    if ckpt is not None:
      ckpt.close()


def _loop(config, workdir, signals, ckpt, snap, records, stream, method, trainer, key, timer,
          t_start, startup_s) -> dict[str, Any]:
  log_path = os.path.join(workdir, LOG_FILE)
  num_t = stream.num_megabatches
  log = Log.from_records(records)
  compiled_before: set[str] = set()
  elapsed_before = 0.0
  opt_state = None
  last_error = None
  if snap is None:
    learner = method.init(jax.random.fold_in(key, 0))
    if jax.default_backend() == "cpu":
      with timer("train_s"):  # compiles the train step the first stage will use
        _log_estimate(trainer, learner, stream, config)
  else:
    learner, last_error = snap.learner, records[-1].test_error
    opt_state = snap.opt_state if config.train.keep_optimizer_state else None
    compiled_before = set(snap.extra.get("compiled", []))
    elapsed_before = float(snap.extra.get("elapsed_s", 0.0))
    timer.add(snap.extra.get("timings", {}))
    signals.last_checkpoint = snap.t
    logging.info("resuming %s after t=%d/%d (its last complete checkpoint)", workdir, snap.t, num_t)

  def elapsed():
    return elapsed_before + time.monotonic() - t_start

  for t in range(len(records), num_t + 1):
    t_step = time.monotonic()
    trained = t > 0 and schedule.is_training_time(t, config.stream.wait)
    flops = trainer.flops(learner)
    train_flops = train_fwd = 0.0

    # -- one stage -------------------------------------------------------------------------------
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
      _kill_point("stage", t)

      def progress(msg, t=t):
        logging.info(msg)
        _kill_point("epoch", t)

      learner, opt_state, stats = trainer.fit_stage(
          learner, stage.train, stage.val, jax.random.fold_in(skey, 3), t=t, opt_state=opt_state,
          progress=progress)
      if stats.diverged:
        logging.warning("stage t=%d diverged; continuing with its best epoch (%d)", t,
                        stats.best_epoch)
      train_flops = flops["train_step"] * stats.steps_run
      train_fwd = flops["train_step_forward"] * stats.steps_run
      timer.add({"train_s": stats.train_s, "eval_s": stats.eval_s})
      learner = method.after_stage(learner, jax.random.fold_in(skey, 4), ctx)
      flops = trainer.flops(learner)

    # -- evaluate, log, checkpoint -----------------------------------------------------------------
    if last_error is None or trained:  # an unchanged model is not re-evaluated
      with timer("eval_s"):
        last_error = trainer.test_error(learner)
    rec = Record(t=t, test_error=last_error, num_params=method.num_params(learner),
                 train_flops=train_flops, train_flops_forward=train_fwd,
                 inference_flops_per_example=flops["inference_per_example"], trained=trained,
                 wall_s=time.monotonic() - t_step)
    log = log.append(rec)
    with timer("io_s"), signals.critical():
      io_utils.append_record(log_path, rec.to_dict())
      if trained:
        arch = method.describe(learner)
        io_utils.append_jsonl(os.path.join(workdir, ARCH_FILE), {"t": t, **arch})
      _kill_point("log", t)
      if ckpt is not None and _should_checkpoint(config, t, trained, num_t):
        extra = {"compiled": sorted(compiled_before | _compiled_keys(trainer)),
                 "elapsed_s": elapsed(), "timings": timer.as_dict(),
                 "config": validation.config_dict(config)}
        # The optimizer state is part of the state only when stages share it.
        kept = opt_state if config.train.keep_optimizer_state else None
        ckpt.start_save(t, learner, kept, jax.random.key_data(jax.random.fold_in(key, t)),
                        [r.to_dict() for r in log.records], extra)
        _kill_point("checkpoint", t)
        ckpt.wait()
        signals.last_checkpoint = t
        _kill_point("saved", t)
    if trained:
      logging.info("t=%d/%d epochs=%d best_val_acc=%.4f test_error=%.4f %s elapsed=%.1fs", t,
                   num_t, stats.epochs_run, stats.best_val_accuracy, last_error,
                   json.dumps(arch), elapsed())

  # -- summary ---------------------------------------------------------------------------------
  summary = log.summary()
  summary["wall_s"] = elapsed()
  summary["timings"] = timer.report(summary["wall_s"], startup_s)
  summary["num_compilations"] = len(compiled_before | _compiled_keys(trainer))
  _kill_point("summary")
  with signals.critical():
    io_utils.write_json_atomic(os.path.join(workdir, SUMMARY_FILE), summary)
  logging.info("done: CER=%.4f mean_error=%.4f final_error=%.4f Mem=%d Comp=%.3e wall=%.1fs",
               summary["cer"], summary["mean_error"], summary["final_error"], summary["mem"],
               summary["comp"], summary["wall_s"])
  return summary
