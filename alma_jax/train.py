"""One training stage: epochs over the stage data with best-epoch selection.

The whole data set stays on the device as uint8; a step receives only index
arrays, gathers its batch, augments and normalises it inside the jitted
function. Steps are compiled once per learner structure and reused across
stages (a partial last batch is padded and masked, never recompiled).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from alma_jax import sharding
from alma_jax import timing
from alma_jax.data import augment
from alma_jax.methods.base import Learner, Method
from alma_jax.optim import make_optimizer


class DivergenceError(RuntimeError):
  """A non-finite loss or parameter appeared during training."""


def divergence_error(t: int, epoch: int, where: str = "") -> DivergenceError:
  """The error of a stage whose loss or parameters became non-finite."""
  return DivergenceError(f"stage t={t} epoch {epoch}{where}: non-finite training loss or "
                         "parameters; rerun the same command with "
                         "--config.train.on_divergence=rollback to resume from the last checkpoint "
                         "(each diverging stage then keeps its best epoch and the run goes on)")


@dataclasses.dataclass(frozen=True)
class DeviceData:
  """The data set resident on the devices (uint8 images, int32 labels)."""

  train_x: jax.Array
  train_y: jax.Array
  test_x: jax.Array
  test_y: jax.Array
  mean: jax.Array
  std: jax.Array

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.train_x.shape[1:])


def put_dataset(mesh, ds) -> DeviceData:
  """Moves an `ImageDataset`-like object (numpy arrays) onto the mesh."""
  arrays = [np.asarray(a) for a in (ds.train_x, ds.train_y, ds.test_x, ds.test_y)]
  stats = [np.asarray(ds.mean, np.float32), np.asarray(ds.std, np.float32)]
  return DeviceData(*sharding.put_replicated(mesh, arrays + stats))


@dataclasses.dataclass(frozen=True)
class StageStats:
  epochs_run: int
  best_epoch: int
  best_val_accuracy: float
  steps_run: int
  last_train_loss: float
  train_s: float
  eval_s: float
  diverged: bool = False
  compile_s: float = 0.0  # compilation inside the stage (not part of train_s/eval_s)


def _padded_orders(rng: np.random.Generator, idx: np.ndarray, num_orders: int, batch: int,
                   steps_per_call: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Per-order shuffles of `idx`, padded to whole calls: (calls*K, D, b) arrays.

  The padding slots hold real examples (the order repeated from its start)
  with mask False: the loss ignores them, while BatchNorm computes its batch
  statistics over the whole batch of real images. (Masked BatchNorm
  statistics are avoided on purpose: on XLA:CPU, jax 0.10.2, their jitted
  gradient inside `jax.vmap` is wrong, see tests/test_ensemble.py.)
  """
  n = len(idx)
  steps = -(-n // batch)
  total_steps = -(-steps // steps_per_call) * steps_per_call
  out = np.zeros((num_orders, total_steps * batch), np.int32)
  mask = np.zeros((num_orders, total_steps * batch), bool)
  for d in range(num_orders):
    order = idx[rng.permutation(n)]
    out[d, :n] = order
    out[d, n:] = np.resize(order, total_steps * batch - n)
    mask[d, :n] = True
  shape = (num_orders, total_steps, batch)
  return (out.reshape(shape).transpose(1, 0, 2), mask.reshape(shape).transpose(1, 0, 2), steps)


@jax.jit
def tree_all_finite(tree) -> jax.Array:
  """Whether every element of every leaf is finite (one compiled reduction)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Trainer:
  """Compiled train/eval steps of one run, cached per learner structure."""

  def __init__(self, method: Method, config, data: DeviceData, mesh):
    self.method = method
    self.config = config
    self.data = data
    self.mesh = mesh
    self.tx = make_optimizer(config.optimizer)
    self.batch_size = int(config.train.batch_size)
    self.eval_batch_size = int(config.train.eval_batch_size)
    self.steps_per_call = int(config.train.get("steps_per_call", 1))
    self.augment = config.train.augment
    self._cache: dict[tuple[str, Hashable], Callable] = {}
    self._flops: dict[Hashable, dict[str, float]] = {}
    self.num_compilations = 0

  # -- compiled functions -----------------------------------------------------
  def _cached(self, kind: str, structure: Hashable, build: Callable[[], Callable]) -> Callable:
    key = (kind, structure)
    if key not in self._cache:
      self._cache[key] = build()
      self.num_compilations += 1
    return self._cache[key]

  @property
  def compiled(self) -> tuple[tuple[str, Hashable], ...]:
    """The (kind, structure) keys of the functions compiled so far."""
    return tuple(self._cache)

  def _step_fn(self, structure):
    """The pure single train step on one batch of indices (D, b)."""
    method, tx, data_aug = self.method, self.tx, self.augment

    def step(trainable, frozen, opt_state, model_state, data_x, data_y, mean, std, idx, mask, rng):
      x = augment.prepare_batch(data_x[idx], mean, std, augment=data_aug, rng=rng)
      y = data_y[idx]
      loss_fn = functools.partial(method.loss, structure)
      (loss, new_state), grads = jax.value_and_grad(loss_fn, argnums=0, has_aux=True)(
          trainable, frozen, model_state, x, y, mask, jax.random.fold_in(rng, 1))
      updates, opt_state = tx.update(grads, opt_state, trainable)
      trainable = optax.apply_updates(trainable, updates)
      return trainable, opt_state, new_state, loss

    return step

  def chunk_fn(self, structure):
    """The pure K-step function: (K, D, b) indices -> new state and K losses.

    With K > 1 the steps run in a `lax.scan`; a step whose mask is all false
    (padding up to a whole number of calls) leaves the state untouched.
    """
    step = self._step_fn(structure)

    def chunk(trainable, frozen, opt_state, model_state, data_x, data_y, mean, std, idx, mask, key,
              counter):
      rng = jax.random.fold_in(key, counter)
      if idx.shape[0] == 1:
        tr, os, ms, loss = step(trainable, frozen, opt_state, model_state, data_x, data_y,
                                mean, std, idx[0], mask[0], rng)
        return tr, os, ms, loss[None]

      def body(carry, inp):
        idx_k, mask_k, i = inp

        def run(c):
          out = step(c[0], frozen, c[1], c[2], data_x, data_y, mean, std, idx_k, mask_k,
                     jax.random.fold_in(rng, i))
          return out[:3], out[3]

        return jax.lax.cond(jnp.any(mask_k), run, lambda c: (c, jnp.float32(0.0)), carry)

      carry, losses = jax.lax.scan(body, (trainable, opt_state, model_state),
                                   (idx, mask, jnp.arange(idx.shape[0])))
      return (*carry, losses)

    return chunk

  def train_fn(self, structure):
    """`chunk_fn(structure)` jitted, its state arguments donated."""
    return self._cached("train", structure,
                        lambda: jax.jit(self.chunk_fn(structure), donate_argnums=(0, 2, 3)))

  def eval_body(self, structure):
    """The pure evaluation of one chunk: (number correct, summed loss)."""
    method = self.method

    def evaluate(params, model_state, data_x, data_y, mean, std, idx, mask):
      x = augment.prepare_batch(data_x[idx], mean, std, augment="none", rng=None)
      logp = method.predict(structure, params, model_state, x)
      y = data_y[idx]
      correct = (jnp.argmax(logp, -1) == y) & mask
      nll = -jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
      return jnp.sum(correct), jnp.sum(jnp.where(mask, nll, 0.0))

    return evaluate

  def eval_fn(self, structure):
    """`eval_body(structure)` jitted."""
    return self._cached("eval", structure, lambda: jax.jit(self.eval_body(structure)))

  def place(self, tree):
    """Replicates `tree` on the mesh (a no-op for leaves already there).

    Every state entering a compiled step goes through here, so that the
    step sees the same input shardings at every call and compiles once.
    """
    return sharding.put_replicated(self.mesh, tree)

  # -- evaluation ---------------------------------------------------------------
  def eval_chunks(self, idx: np.ndarray):
    """(indices, mask) batches of `eval_batch_size` along the last axis of `idx`,
    the last one padded; leading axes (several seeds) are kept."""
    b, n = self.eval_batch_size, idx.shape[-1]
    for s in range(0, n, b):
      pad = np.zeros(idx.shape[:-1] + (b,), np.int32)
      pad[..., :min(b, n - s)] = idx[..., s:s + b]
      mask = np.ascontiguousarray(np.broadcast_to(np.arange(b) < n - s, pad.shape))
      yield (sharding.put_batch(self.mesh, pad, pad.ndim - 1),
             sharding.put_batch(self.mesh, mask, mask.ndim - 1))

  def evaluate(self, learner: Learner, idx: np.ndarray, split: str) -> tuple[float, float]:
    """Accuracy and mean loss of `learner` on examples `idx` of `split`."""
    if len(idx) == 0:
      raise ValueError(f"cannot evaluate on an empty {split} set")
    xs, ys = (self.data.train_x, self.data.train_y) if split == "train" else (
        self.data.test_x, self.data.test_y)
    fn = self.eval_fn(learner.structure)
    learner = self.place(learner)
    correct, loss = 0, 0.0
    results = [fn(learner.params, learner.model_state, xs, ys, self.data.mean, self.data.std, i, m)
               for i, m in self.eval_chunks(idx)]
    for c, l in results:
      correct += int(c)
      loss += float(l)
    return correct / len(idx), loss / len(idx)

  def test_error(self, learner: Learner) -> float:
    n = self.data.test_x.shape[0]
    acc, _ = self.evaluate(learner, np.arange(n, dtype=np.int32), "test")
    return 1.0 - acc

  # -- FLOP accounting ----------------------------------------------------------
  def flops(self, learner: Learner) -> dict[str, float]:
    """Compiler FLOP counts for the learner's current structure.

    `train_step`: one train step (forward, backward and update) on a batch;
    `train_step_forward`: the forward pass of the training loss alone;
    `inference_per_example`: predicting one example.
    Counted by XLA's cost analysis of the lowered functions.
    """
    structure = learner.structure
    if structure in self._flops:
      return self._flops[structure]
    trainable, frozen = self.method.partition(learner)
    d = self.method.num_data_orders(structure)
    b = self.batch_size
    opt_state = jax.eval_shape(self.tx.init, trainable)
    idx = jax.ShapeDtypeStruct((d, b), jnp.int32)
    mask = jax.ShapeDtypeStruct((d, b), jnp.bool_)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    dd = self.data
    args = (trainable, frozen, opt_state, learner.model_state, dd.train_x, dd.train_y, dd.mean,
            dd.std, idx, mask, rng)
    train = _cost_flops(jax.jit(self._step_fn(structure)), args)

    method = self.method

    def fwd(trainable, frozen, model_state, x, y, mask, rng):
      return method.loss(structure, trainable, frozen, model_state, x, y, mask, rng)[0]

    x = jax.ShapeDtypeStruct((d, b) + dd.input_shape, jnp.float32)
    y = jax.ShapeDtypeStruct((d, b), jnp.int32)
    forward = _cost_flops(jax.jit(fwd), (trainable, frozen, learner.model_state, x, y, mask, rng))

    eb = self.eval_batch_size
    xe = jax.ShapeDtypeStruct((eb,) + dd.input_shape, jnp.float32)
    pred = functools.partial(method.predict, structure)
    infer = _cost_flops(jax.jit(pred), (learner.params, learner.model_state, xe)) / eb
    self._flops[structure] = {"train_step": train, "train_step_forward": forward,
                              "inference_per_example": infer}
    return self._flops[structure]

  def seconds_per_step(self, learner: Learner, repeats: int = 3) -> float:
    """Times the compiled train call on dummy indices (the learner is untouched)."""
    trainable, frozen = self.method.partition(learner)
    d = self.method.num_data_orders(learner.structure)
    k = self.steps_per_call
    idx = np.zeros((k, d, self.batch_size), np.int32)
    mask = np.ones((k, d, self.batch_size), bool)
    fn = self.train_fn(learner.structure)
    dd = self.data
    times = []
    for r in range(repeats + 1):
      args = jax.tree.map(jnp.copy, (trainable, self.tx.init(trainable), learner.model_state))
      t0 = time.monotonic()
      out = fn(args[0], frozen, args[1], args[2], dd.train_x, dd.train_y, dd.mean, dd.std,
               sharding.put_batch(self.mesh, idx, 2), sharding.put_batch(self.mesh, mask, 2),
               jax.random.key(0), np.uint32(r))
      jax.block_until_ready(out)
      if r:  # the first call compiles
        times.append(time.monotonic() - t0)
    return float(np.median(times)) / k

  # -- one stage ------------------------------------------------------------------
  def fit_stage(self, learner: Learner, train_idx: np.ndarray, val_idx: np.ndarray, key: jax.Array,
                *, t: int = 0, opt_state=None, progress: Callable[[str], None] | None = None):
    """Trains `learner` on one stage's data and returns the best-validation epoch.

    Args:
      learner: the learner before the stage (not modified).
      train_idx, val_idx: indices into the training split.
      key: PRNG key of this stage (data order, augmentation).
      t: time step, for messages.
      opt_state: optimizer state to continue from (None = fresh).
      progress: called with a one-line message at most every few seconds.

    Returns:
      (best learner, final optimizer state, StageStats).
    """
    cfg = self.config.train
    if len(train_idx) < 1 or len(val_idx) < 1:
      raise ValueError(f"stage t={t} has {len(train_idx)} training and {len(val_idx)} "
                       "validation examples; both must be >= 1")
    method = self.method
    structure = learner.structure
    trainable, frozen = self.place(method.partition(learner))
    trainable = jax.tree.map(jnp.copy, trainable)  # the step donates its inputs
    model_state = jax.tree.map(jnp.copy, self.place(learner.model_state))
    opt_state = self.place(self.tx.init(trainable) if opt_state is None else opt_state)
    fn = self.train_fn(structure)
    d = method.num_data_orders(structure)
    np_rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    dd = self.data
    best, best_acc, best_epoch, since_best = learner, -1.0, 0, 0
    steps_run, last_loss = 0, float("nan")
    timer = timing.Breakdown()

    def stats(**kw):
      spent = timer.as_dict()
      return StageStats(epoch, best_epoch, max(best_acc, 0.0), steps_run, last_loss,
                        spent["train_s"], spent["eval_s"], compile_s=spent["compile_s"], **kw)

    last_report = time.monotonic()
    epoch = 0
    for epoch in range(1, int(cfg.epochs) + 1):
      with timer("train_s"):
        idx, mask, steps = _padded_orders(np_rng, train_idx, d, self.batch_size,
                                          self.steps_per_call)
        k = self.steps_per_call
        losses = []
        for c in range(idx.shape[0] // k):
          sl = slice(c * k, (c + 1) * k)
          trainable, opt_state, model_state, loss = fn(
              trainable, frozen, opt_state, model_state, dd.train_x, dd.train_y, dd.mean, dd.std,
              sharding.put_batch(self.mesh, idx[sl], 2),
              sharding.put_batch(self.mesh, mask[sl], 2), key, np.uint32(epoch * 100003 + c))
          losses.append(loss)
        steps_run += steps
        losses = np.concatenate([np.asarray(l) for l in losses])[:steps]
        last_loss = float(np.mean(losses))
      current = Learner(params=method.combine(learner, trainable), model_state=model_state,
                        structure=structure)
      if not (np.all(np.isfinite(losses)) and bool(tree_all_finite(trainable))):
        if cfg.get("on_divergence", "raise") == "rollback":
          logging.warning("stage t=%d epoch %d: non-finite loss or parameters; rolling back to "
                          "the best epoch (%d) and ending the stage", t, epoch, best_epoch)
          return best, None, stats(diverged=True)
        raise divergence_error(t, epoch)
      with timer("eval_s"):
        acc, _ = self.evaluate(current, val_idx, "train")
      if acc > best_acc:
        best = jax.tree.map(jnp.copy, current)
        best_acc, best_epoch, since_best = acc, epoch, 0
      else:
        since_best += 1
      if progress is not None and time.monotonic() - last_report >= cfg.get("progress_every_s", 10.0):
        last_report = time.monotonic()
        progress(f"  t={t} epoch {epoch}/{cfg.epochs} loss={last_loss:.4f} val_acc={acc:.4f} "
                 f"best={best_acc:.4f}@{best_epoch}")
      if since_best >= int(cfg.patience):
        break
    return best, opt_state, stats()


def _cost_flops(jitted, args) -> float:
  """FLOPs of a jitted function on `args` from XLA's cost analysis."""
  cost = jitted.lower(*args).cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))

