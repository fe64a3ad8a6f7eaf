"""The compiled programs of a run: train chunks, evaluation and scoring passes.

This module is the only place where steps are `jax.jit`ted, and `Steps` holds
the one compile cache of a run (so `Steps.num_compilations` is the number of
programs the run compiled). Data enters a program as pytrees: the train
state (`TrainState`), the resident data (`tasks.images.DeviceData`), a batch
of indices (`Batch`) and PRNG keys.

Every train and evaluation program runs a population of S learners stacked
on a leading axis: S > 1 (several seeds) through `jax.vmap`, S = 1 through a
squeeze of that axis, so an ordinary run compiles the unbatched step.

Every program is `jax.jit` with explicit `in_shardings` and `out_shardings`
on the run's mesh (`alma_jax.sharding.Layout`: batches on `data`, members and
experts on `model`, the population axis as `config.mesh.rules` says), computed
for the shapes of the structure it is compiled for, so a structure that growth
changes gets its own shardings. A program places its arguments with those
shardings before each call (a no-op for arrays already placed so, such as the
state a train call returns); the train state is donated.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from alma_jax import accounting
from alma_jax import autotune
from alma_jax import population
from alma_jax import sharding
from alma_jax import timing
from alma_jax.methods.base import Learner, Method

PyTree = Any
# A train call's PRNG counter is epoch * CALLS_BOUND + call: distinct for
# every call of a stage as long as an epoch has fewer calls than this.
CALLS_BOUND = 100003


@struct.dataclass
class TrainState:
  """What a train step updates: trainable params, optimizer and model state (and frozen params)."""

  trainable: PyTree
  frozen: PyTree
  model_state: PyTree
  opt_state: PyTree


@struct.dataclass
class Batch:
  """Indices into the resident data and which of them are real examples (mask)."""

  idx: jax.Array
  mask: jax.Array


def over_population(fn: Callable, in_axes: Sequence[int | None], num: int) -> Callable:
  """`fn` of one learner -> `fn` of a stacked population of `num` learners.

  `in_axes[i]` is 0 for arguments stacked on the population axis and None for
  shared ones. With num > 1 this is `jax.vmap`; with num = 1 the axis is
  squeezed and restored, so the program is the unbatched one.
  """
  if num > 1:
    return jax.vmap(fn, in_axes=tuple(in_axes))

  def squeezed(*args):
    args = [a if ax is None else jax.tree.map(lambda v: v[0], a) for a, ax in zip(args, in_axes)]
    return jax.tree.map(lambda v: v[None], fn(*args))

  return squeezed


def call_counter(epoch: int, call: int) -> np.uint32:
  return np.uint32(epoch * CALLS_BOUND + call)


class _Program:
  """A jitted step with the shardings of its arguments, which it places before each call."""

  def __init__(self, fn: Callable, in_shardings: tuple, out_shardings, donate: tuple,
               name: str = "program"):
    self.in_shardings = in_shardings

    def program(*args):
      return fn(*args)

    # The name marks the compilations of steps in `jax.monitoring` (`alma_jax.timing`).
    program.__name__ = program.__qualname__ = timing.STEP_PREFIX + name
    self.jitted = jax.jit(program, in_shardings=in_shardings, out_shardings=out_shardings,
                          donate_argnums=donate)

  def __call__(self, *args):
    return self.jitted(*sharding.put(args, self.in_shardings))


# The logical axes of the batches (`alma_jax.sharding`): a train batch is (S, K, D, b), with
# one data order per trained ensemble member; an evaluation batch (S, b) or shared (b,).
TRAIN_BATCH_AXES = ("population", None, "member", "batch")
EVAL_BATCH_AXES = ("population", "batch")


class Steps:
  """The compiled steps of one run, cached per (kind, learner structure, population)."""

  def __init__(self, method: Method, task, tx: optax.GradientTransformation, data, mesh, *,
               batch_size: int, eval_batch_size: int, steps_per_call: int = 1, rules=None):
    self.method, self.task, self.tx, self.mesh = method, task, tx, mesh
    self.layout = sharding.Layout(mesh, rules)
    self.leaf_axes = sharding.leaf_axes_by_pattern(method.LEAF_AXES)
    self.data = sharding.put(data, self.layout.replicated)
    self.batch_size = int(batch_size)
    self.eval_batch_size = int(eval_batch_size)
    self.steps_per_call = int(steps_per_call)
    self._cache: dict[tuple, Callable] = {}
    # One small program per shapes (not one per optimizer-state leaf); not a step.
    self._opt_init = jax.jit(jax.vmap(tx.init))
    self._pass_costs: dict[tuple, float] = {}
    self.pass_flops = 0.0  # FLOPs of the passes over data (`reduce`, `scan`) so far

  @classmethod
  def from_config(cls, config, method: Method, task, tx, data, mesh) -> "Steps":
    t = config.train
    rules = config.mesh.get("rules")
    return cls(method, task, tx, data, mesh, batch_size=t.batch_size,
               eval_batch_size=t.eval_batch_size,
               steps_per_call=t.get("steps_per_call", 1) or autotune.steps_per_call_rule(),
               rules=None if rules is None else dict(rules.items()))

  # -- the compile cache ---------------------------------------------------------------------
  def _compiled(self, key: tuple, build: Callable[[], Callable],
                shardings: Callable[[], tuple], donate=()) -> Callable:
    """The jitted `build()` for `key`, built once; the run's only `jax.jit` of a step.

    `shardings()` gives its (in_shardings, out_shardings), whole trees.
    """
    if key not in self._cache:
      name = "".join(c if c.isalnum() else "_" for c in str(key[0]))
      self._cache[key] = _Program(build(), *shardings(), donate, name)
    return self._cache[key]

  @property
  def compiled(self) -> tuple[tuple, ...]:
    """The keys (kind, structure, population) of the programs compiled so far."""
    return tuple(self._cache)

  @property
  def num_compilations(self) -> int:
    return len(self._cache)

  # -- shardings ---------------------------------------------------------------------------------
  def shardings(self, tree, *, stacked: bool = True, name: str = ""):
    """The shardings of a learner's params or model state, a train state or an optimizer
    state: the population axis first (when `stacked`), then the method's `LEAF_AXES`."""
    return self.layout.tree(tree, self.leaf_axes, ("population",) if stacked else (), name)

  def place(self, tree, *, stacked: bool = True):
    """Places a learner (or any tree of `shardings`) with its shardings."""
    return sharding.put(tree, self.shardings(tree, stacked=stacked))

  def replicated(self, tree):
    """A replicated sharding for every leaf of `tree`."""
    return jax.tree.map(lambda _: self.layout.replicated, tree)

  def batch_shardings(self, batch: Batch, axes: Sequence[str | None]) -> Batch:
    s = self.layout.sharding(batch.idx.shape, axes, "batch")
    return Batch(s, s)

  def put_batch(self, array: np.ndarray):
    """Places an index or mask array: a train batch (S, K, D, b), else an evaluation batch."""
    axes = TRAIN_BATCH_AXES if array.ndim == 4 else EVAL_BATCH_AXES[-array.ndim:]
    return sharding.put(array, self.layout.sharding(array.shape, axes, "batch"))

  # -- training ---------------------------------------------------------------------------------
  def step_body(self, structure) -> Callable:
    """One train step of one learner: (state, data, idx (D, b), mask, rng) -> (state, loss)."""
    method, task, tx = self.method, self.task, self.tx
    loss_fn = functools.partial(method.loss, structure)

    def step(state: TrainState, data, idx, mask, rng):
      x, y = task.inputs(data, idx, rng)
      (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          state.trainable, state.frozen, state.model_state, x, y, mask, jax.random.fold_in(rng, 1))
      updates, opt_state = tx.update(grads, state.opt_state, state.trainable)
      return TrainState(optax.apply_updates(state.trainable, updates), state.frozen, model_state,
                        opt_state), loss.astype(jnp.float32)  # reported, in any precision

    return step

  def chunk_body(self, structure) -> Callable:
    """K train steps of one learner: (state, data, Batch (K, D, b), key, counter) ->
    (state, K losses, whether the trainable params are all finite).

    With K > 1 the steps run in a `lax.scan`; a step whose mask is all false
    (padding up to a whole number of calls) leaves the state untouched.
    """
    step = self.step_body(structure)

    def chunk(state: TrainState, data, batch: Batch, key, counter):
      rng = jax.random.fold_in(key, counter)
      if batch.idx.shape[0] == 1:
        state, loss = step(state, data, batch.idx[0], batch.mask[0], rng)
        losses = loss[None]
      else:
        def body(st, inp):
          idx, mask, i = inp
          run = lambda s: step(s, data, idx, mask, jax.random.fold_in(rng, i))
          return jax.lax.cond(jnp.any(mask), run, lambda s: (s, jnp.float32(0.0)), st)

        state, losses = jax.lax.scan(body, state, (batch.idx, batch.mask,
                                                   jnp.arange(batch.idx.shape[0])))
      return state, losses, all_finite(state.trainable)

    return chunk

  def train_call(self, structure, state: TrainState, batch: Batch, keys, counter):
    """Runs one compiled train chunk; returns (state, losses (S, K), finite (S,)).

    The state is donated: rebind it to the returned one.
    """
    num, structure = int(keys.shape[0]), self.method.program_structure(structure)

    def shardings():
      state_sh, rep = self.shardings(state), self.layout.replicated
      ins = (state_sh, self.replicated(self.data), self.batch_shardings(batch, TRAIN_BATCH_AXES),
             rep, rep)
      return ins, (state_sh, rep, rep)

    fn = self._compiled(("train", structure, num), lambda: over_population(
        self.chunk_body(structure), (0, None, 0, 0, None), num), shardings, donate=(0,))
    return fn(state, self.data, batch, keys, counter)

  def init_state(self, learner: Learner, opt_state=None) -> TrainState:
    """The train state of a stacked `learner`, placed with its shardings (copies: the train
    step donates it)."""
    trainable, frozen = jax.vmap(self.method.partition)(learner)
    if opt_state is None:
      opt_state = self._opt_init(trainable)
    state = TrainState(trainable, frozen, learner.model_state, opt_state)
    return sharding.put(state, self.shardings(state), copy=True)

  # -- evaluation ------------------------------------------------------------------------------
  def eval_body(self, structure) -> Callable:
    """(params, model_state, data, Batch) of one learner -> (number correct, summed NLL,
    number correct of each selection unit (U,), the method's `eval_aux` of the batch); an
    example counts 1 - its error."""
    method, task = self.method, self.task

    def evaluate(params, model_state, data, batch: Batch):
      x, y = task.inputs(data, batch.idx)
      logp, unit_logp, aux = method.evaluate_batch(structure, params, model_state, x, y,
                                                   batch.mask, task)
      errors, nll = task.per_example(logp, y)
      unit_errors, _ = jax.vmap(lambda lp: task.per_example(lp, y))(unit_logp)
      # Accuracy: 1 - error of each example (images: 0 or 1; text: the token error rate).
      return (jnp.sum(jnp.where(batch.mask, 1.0 - errors, 0.0)),
              jnp.sum(jnp.where(batch.mask, nll, 0.0)),
              jnp.sum(jnp.where(batch.mask, 1.0 - unit_errors, 0.0), axis=-1), aux)

    return evaluate

  def eval_fn(self, learner: Learner, shared: bool, batch: Batch) -> Callable:
    """Compiled evaluation of a stacked `learner`; `shared`: one index batch for every learner."""
    structure = self.method.program_structure(learner.structure)
    num = int(jax.tree.leaves(learner.params)[0].shape[0])
    axes = (0, 0, None, None if shared else 0)

    def shardings():
      ins = (self.shardings(learner.params, name="params"),
             self.shardings(learner.model_state, name="model_state"), self.replicated(self.data),
             self.batch_shardings(batch, EVAL_BATCH_AXES[-batch.idx.ndim:]))
      return ins, self.layout.replicated

    return self._compiled(("eval_shared" if shared else "eval", structure, num),
                          lambda: over_population(self.eval_body(structure), axes, num), shardings)

  def eval_batches(self, idx: np.ndarray):
    """`Batch`es (host arrays) of `eval_batch_size` along the last axis of `idx` (the last one
    padded); a compiled program places them."""
    b, n = self.eval_batch_size, idx.shape[-1]
    for s in range(0, n, b):
      pad = np.zeros(idx.shape[:-1] + (b,), np.int32)
      pad[..., :min(b, n - s)] = idx[..., s:s + b]
      mask = np.ascontiguousarray(np.broadcast_to(np.arange(b) < n - s, pad.shape))
      yield Batch(pad, mask)

  def evaluate_units(self, learner: Learner, split: str, idx: np.ndarray):
    """Per-member (accuracy, mean NLL, accuracy of each selection unit (S, U)) of a stacked
    `learner` on examples `idx` of `split`.

    `idx` is (S, n), each member's own examples, or (n,), the same examples
    for every member (gathered once per batch when S > 1).
    """
    num = int(jax.tree.leaves(learner.params)[0].shape[0])
    if idx.shape[-1] == 0:
      raise ValueError(f"cannot evaluate on an empty {split} set")
    idx = self.task.global_index(self.data, split, idx)
    shared = idx.ndim == 1 and num > 1
    if idx.ndim == 1 and not shared:
      idx = np.broadcast_to(idx, (num, idx.shape[0]))
    learner = self.place(learner)  # once, not at every batch
    results, fn = [], None
    for b in self.eval_batches(idx):
      fn = fn or self.eval_fn(learner, shared, b)
      results.append(fn(learner.params, learner.model_state, self.data, b))
    n = idx.shape[-1]
    correct, nll, units = (np.sum([np.asarray(r[i], np.float64) for r in results], axis=0)
                           for i in range(3))
    return correct / n, nll / n, units / n

  def eval_aux(self, learner: Learner, idx: np.ndarray) -> PyTree:
    """The method's `eval_aux` summed over examples `idx` of the training split (unaugmented)
    for one (unstacked) learner, in float64 on the host: computed by the evaluation program
    of a population of one (the run's own when it has one seed), so it compiles nothing of
    its own. Its FLOPs count as a pass over data (`pass_flops`)."""
    fn = self.method.eval_aux
    build = self._pass_body(fn)  # what the FLOPs are counted of
    idx = self.task.global_index(self.data, "train", np.asarray(idx, np.int32))
    stacked = self.place(population.stack([learner]))
    total, compiled = None, None
    for b in self.eval_batches(idx[None]):
      compiled = compiled or self.eval_fn(stacked, False, b)
      out = compiled(stacked.params, stacked.model_state, self.data, b)[3]
      self._count_pass("reduce", fn, learner, build, Batch(b.idx[0], b.mask[0]))
      out = jax.tree.map(lambda a: np.asarray(a[0], np.float64), out)
      total = out if total is None else jax.tree.map(np.add, total, out)
    return total

  def evaluate(self, learner: Learner, split: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-member (accuracy, mean NLL) of a stacked `learner`; see `evaluate_units`."""
    acc, nll, _ = self.evaluate_units(learner, split, idx)
    return acc, nll

  # -- passes over data for growth (scoring, fitting candidates) ------------------------------
  def _pass_fn(self, kind: str, fn: Callable, learner: Learner, build: Callable, batch: Batch,
               carry=()) -> Callable:
    """The compiled pass `kind` of `fn` over batches for one (unstacked) learner; a `scan`'s
    carry is replicated."""
    name = f"{kind} {getattr(fn, '__qualname__', repr(fn))}"

    def shardings():
      ins = (self.shardings(learner.params, stacked=False, name="params"),
             self.shardings(learner.model_state, stacked=False, name="model_state"),
             self.replicated(self.data), self.batch_shardings(batch, ("batch",)))
      return ins + ((self.replicated(carry),) if kind == "scan" else ()), self.layout.replicated

    return self._compiled((name, self.method.program_structure(learner.structure), 1), build,
                          shardings)

  def _count_pass(self, kind: str, fn: Callable, learner: Learner, build: Callable,
                  batch: Batch, carry=()) -> None:
    """Adds the FLOPs of one batch of a pass over the learner's active parts (counted once
    per function and structure)."""
    key = (kind, fn, learner.structure)
    if key not in self._pass_costs:
      view = self.method.active_view(learner)
      args = (view.params, view.model_state, self.data, batch) + ((carry,) if kind == "scan"
                                                                   else ())
      self._pass_costs[key] = accounting.count(
          build(self.method.program_structure(view.structure)), *args).flops
    self.pass_flops += self._pass_costs[key]

  def _train_batches(self, idx: np.ndarray):
    idx = self.task.global_index(self.data, "train", np.asarray(idx, np.int32))
    return self.eval_batches(idx)

  def _pass_body(self, fn: Callable) -> Callable:
    """structure -> (params, model_state, data, Batch) -> `fn(structure, params, model_state,
    x, y, mask, task)` of the batch's examples."""
    task = self.task

    def build(structure):
      def body(params, model_state, data, batch: Batch):
        x, y = task.inputs(data, batch.idx)
        return fn(structure, params, model_state, x, y, batch.mask, task)
      return body

    return build

  def reduce(self, fn: Callable, learner: Learner, idx: np.ndarray) -> PyTree:
    """Sums `fn(structure, params, model_state, x, y, mask, task)` over batches of training
    examples `idx` (unaugmented) for one (unstacked) learner, in float64 on the host."""
    build = self._pass_body(fn)
    learner, total = self.place(learner, stacked=False), None
    program = self.method.program_structure(learner.structure)
    for b in self._train_batches(idx):
      compiled = self._pass_fn("reduce", fn, learner, lambda: build(program), b)
      args = (learner.params, learner.model_state, self.data, b)
      self._count_pass("reduce", fn, learner, build, b)
      out = jax.tree.map(lambda a: np.asarray(a, np.float64), compiled(*args))
      total = out if total is None else jax.tree.map(np.add, total, out)
    return total

  def scan(self, fn: Callable, carry: PyTree, learner: Learner, idx: np.ndarray) -> PyTree:
    """Threads `carry = fn(structure, params, model_state, x, y, mask, carry, task)` through
    batches of training examples `idx` (unaugmented, in order) for one (unstacked) learner,
    one compiled call per batch; e.g. a few optimisation steps of growth candidates."""
    task = self.task

    def build(structure):
      def body(params, model_state, data, batch: Batch, carry):
        x, y = task.inputs(data, batch.idx)
        return fn(structure, params, model_state, x, y, batch.mask, carry, task)
      return body

    learner = self.place(learner, stacked=False)
    program = self.method.program_structure(learner.structure)
    for b in self._train_batches(idx):
      compiled = self._pass_fn("scan", fn, learner, lambda: build(program), b, carry)
      args = (learner.params, learner.model_state, self.data, b, carry)
      self._count_pass("scan", fn, learner, build, b, carry)
      carry = compiled(*args)
    return carry

  # -- accounting ------------------------------------------------------------------------------
  def flops(self, learner: Learner) -> dict[str, float]:
    """FLOP and multiply-add counts for one (unstacked) learner's structure.

    `train_step`: one train step (forward, backward and update) on a batch;
    `train_step_forward`: the forward pass of the training loss alone;
    `train_macs_per_example`: the forward multiply-adds of the training loss
    per training example (what the paper's "training FLOPs" count);
    `inference_per_example`: predicting one example.
    Counted from the traced computations (`alma_jax.accounting`), the same on
    every backend, for the learner's active parts (`Method.active_view`):
    padding slots that the compiled programs also compute are not counted.
    """
    method = self.method
    learner = method.active_view(learner)  # may be shapes alone
    structure = method.program_structure(learner.structure)
    trainable, frozen = jax.eval_shape(method.partition, learner)
    d, b = method.num_data_orders(structure), self.batch_size
    spec = jax.ShapeDtypeStruct
    state = TrainState(trainable, frozen, learner.model_state,
                       jax.eval_shape(self.tx.init, trainable))
    rng = jax.eval_shape(lambda: jax.random.key(0))
    idx, mask = spec((d, b), jnp.int32), spec((d, b), jnp.bool_)
    train = accounting.count(self.step_body(structure), state, self.data, idx, mask, rng)
    if train.flops <= 0:
      raise ValueError(f"counting the FLOPs of {method.name!r}'s train step found no arithmetic; "
                       "its loss must use differentiable array operations")
    x, y = jax.eval_shape(self.task.inputs, self.data, idx)

    def forward(trainable, frozen, model_state, x, y, mask, rng):
      return method.loss(structure, trainable, frozen, model_state, x, y, mask, rng)[0]

    fwd = accounting.count(forward, trainable, frozen, learner.model_state, x, y, mask, rng)
    eb = self.eval_batch_size
    xe = spec((eb,) + tuple(x.shape[2:]), x.dtype)
    infer = accounting.count(functools.partial(method.predict, structure), learner.params,
                             learner.model_state, xe)
    return {"train_step": train.flops, "train_step_forward": fwd.flops,
            "train_macs_per_example": fwd.macs / b, "inference_per_example": infer.flops / eb}

  def seconds_per_step(self, learner: Learner, repeats: int = 3) -> float:
    """Times the compiled train call of a stacked `learner` on dummy indices (it is untouched):
    the median of `repeats` calls after the one that compiles, per step."""
    num = int(jax.tree.leaves(learner.params)[0].shape[0])
    d, k = self.method.num_data_orders(learner.structure), self.steps_per_call
    idx = np.zeros((num, k, d, self.batch_size), np.int32)
    batch = Batch(self.put_batch(idx), self.put_batch(np.ones(idx.shape, bool)))
    keys = jax.random.split(jax.random.key(0), num)
    state, times = self.init_state(learner), []
    for r in range(repeats + 1):
      t0 = time.monotonic()
      state, losses, _ = self.train_call(learner.structure, state, batch, keys, np.uint32(r))
      jax.block_until_ready(losses)
      if r:  # the first call compiles
        times.append(time.monotonic() - t0)
    return float(np.median(times)) / k


def all_finite(tree) -> jax.Array:
  """Whether every element of every leaf of `tree` is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
