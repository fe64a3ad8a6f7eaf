"""The compiled programs of a run and their one cache: train chunks, evaluation, passes,
whole stages.

This module holds every `jax.jit` of the training core. `Programs` holds the
one compile cache of a run (so `Programs.num_compilations` is the number of
step programs the run compiled); `utility` makes the few small programs that
move data rather than learn (stacking a population, a fresh optimizer
state), which are shared by every run and not counted as steps. Data enters
a program as pytrees: the train state (`TrainState`), the resident data
(`tasks.images.DeviceData`), a batch of indices (`Batch`) and PRNG keys.

Every train and evaluation program runs a population of S learners stacked
on a leading axis: S > 1 (several seeds) through `jax.vmap`, S = 1 through a
squeeze of that axis, so an ordinary run compiles the unbatched step.

Every program is `jax.jit` with explicit `in_shardings` and `out_shardings`
on the run's mesh (`alma_jax.engine.sharding.Layout`: batches on `data`, members and
experts on `model`, the population axis as `config.mesh.rules` says), computed
for the shapes of the structure it is compiled for, so a structure that growth
changes gets its own shardings. A program places its device arguments with
those shardings before each call (a no-op for arrays already placed so, such as
the state a train call returns) and hands host values (a batch's indices, a
call's counter) to its own dispatch, which transfers them (`sharding.put_args`);
the train state is donated.
"""

from __future__ import annotations

import functools
import types
import time
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from alma_jax.engine import epoch as epoch_lib
from alma_jax.engine import precision
from alma_jax.engine import sharding
from alma_jax.engine import timing
from alma_jax.methods.base import Method
from alma_jax.models import inference
from alma_jax.models import slots
from alma_jax.runtime import executables
from alma_jax.state import Learner, TrainState

PyTree = Any
# A train step's PRNG counter is epoch * STEPS_BOUND + (its step in the epoch): distinct
# for every step of a stage as long as an epoch has fewer steps than this, and the same
# whatever number of steps a compiled call runs (`train.steps_per_call`).
STEPS_BOUND = 100003
UTILITY_PREFIX = "alma_utility_"  # names the utility programs (not steps) in `jax.monitoring`
# The logical axes of the batches (`alma_jax.engine.sharding`): a train batch is (S, K, D, b), with
# one data order per trained ensemble member; an evaluation batch (S, b) or shared (b,).
TRAIN_BATCH_AXES = ("population", None, "member", "batch")
EVAL_BATCH_AXES = ("population", "batch")
# `train.step_fusion` and `train.eval_fusion`: XLA:CPU options of the programs that train
# (train step, whole stage, scan passes) and of those that only evaluate (evaluation, reduce
# passes), on top of the process's flags (`train.cpu_fusion`). On a CPU, XLA's default fusion
# (jax 0.10.2) hands an MLP's gathered dots to YNNPACK, which makes its evaluation several
# times slower than XLA's own loops, and its MLIR fusion emitters compile an MLP's programs for
# about twice as long as its older elemental IR emitters; what runs fastest depends on the model
# and the machine.
_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
_ELEMENTAL = {"xla_cpu_use_fusion_emitters": False}
FUSIONS = {"same": None,  # the process's flags
           "no_ynn": _NO_YNN,  # no YNNPACK fusions
           "onednn": {"xla_cpu_use_onednn": True},  # oneDNN's convolutions and dots
           "elemental": _ELEMENTAL,  # the older emitters
           "elemental_no_ynn": {**_ELEMENTAL, **_NO_YNN}}
FUSION_CHOICES = ("auto",) + tuple(FUSIONS)  # auto: `alma_jax.tuning.autotune`
_EVALUATING = ("eval", "eval_shared", "reduce")  # program kinds that take the eval options
# Program kinds that run about once per structure (a pass that growth or a probe runs over
# data): compiled for a short compile on a CPU (`executables.once_options`).
_ONCE = ("reduce", "scan")
PROGRAM_NAMES = {"train": "the train step", "eval": "the evaluation",
                 "eval_shared": "the evaluation", "stage": "the whole training stage"}


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


def accepts(fusion: str) -> bool:
  """Whether this process's XLA:CPU accepts the options of `FUSIONS[fusion]` (a jaxlib may drop
  one, e.g. the older emitters), found by compiling a one-operation program with them."""
  return executables.accepts(FUSIONS[fusion])


def step_counter(epoch: int, step: int) -> np.uint32:
  """The PRNG counter of step `step` of epoch `epoch` (a call passes its first step's)."""
  return np.uint32(epoch * STEPS_BOUND + step)


def all_finite(tree) -> jax.Array:
  """Whether every element of every leaf of `tree` is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _short(value, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def utility(fn: Callable, name: str, key: Any = ()) -> Callable:
  """`jax.jit(fn)` for a small program that moves data (not a step of the run's count); kept
  across processes (`executables`) by the code location of `fn` and `key` (what else its
  closure was built for), and compiled for a short compile (`executables.once_options`: its
  work is small)."""
  def program(*args):
    return fn(*args)

  program.__name__ = program.__qualname__ = UTILITY_PREFIX + name
  return executables.jit(program, UTILITY_PREFIX + name, key, origin=fn, once=True)


class CompileListener(Protocol):
  """Told about each program before and after its first call, which compiles it
  (`alma_jax.engine.meter.Meter`)."""

  def compiling(self, what: str, why: str) -> None:
    """`what` is about to compile, for the reason `why`."""

  def compiled(self, what: str, seconds: float) -> None:
    """`what` compiled and ran once in `seconds`."""


class Program:
  """A jitted step with the shardings of its arguments, which it places before each call.

  Its first call compiles it; a `listener` hears of it before and after.
  """

  def __init__(self, fn: Callable, in_shardings: tuple, out_shardings, donate: tuple,
               name: str = "program", *, what: str = "", why: str = "",
               listener: CompileListener | None = None, options: dict | None = None,
               key: Any, once: bool = False):
    self.in_shardings = in_shardings
    self.what, self.why, self.listener = what or name, why, listener

    def program(*args):
      return fn(*args)

    # The name marks the compilations of steps in `jax.monitoring` (`alma_jax.engine.timing`).
    program.__name__ = program.__qualname__ = timing.STEP_PREFIX + name
    # Kept across processes (`executables`) under `key`, what `fn` was built for; `once`: a
    # program that runs about once per structure, compiled for a short compile
    # (`executables.once_options`).
    kept = executables.jit(program, timing.STEP_PREFIX + name, key, once=once,
                           in_shardings=in_shardings, out_shardings=out_shardings,
                           donate_argnums=donate, compiler_options=options)
    self.jitted = kept.jitted  # as traced inside another program
    self.top_jitted = kept.top_jitted  # () -> the jit of its calls
    self._run = kept

  def __call__(self, *args):
    if self.listener is None:
      return self._call(args)
    listener, self.listener = self.listener, None  # the first call only
    listener.compiling(self.what, self.why)
    t0 = time.monotonic()
    out = self._call(args)
    listener.compiled(self.what, time.monotonic() - t0)
    return out

  def _call(self, args):
    args = sharding.put_args(args, self.in_shardings)
    # The host values `put_args` left (indices, masks, counters) go in through the dispatch:
    # the one host-to-device transfer a call makes on purpose.
    with jax.transfer_guard_host_to_device("allow"):
      return self._run(*args)


class Programs:
  """The compiled programs of one run, cached per (kind, program structure, population)."""

  def __init__(self, method: Method, task, tx: optax.GradientTransformation, data, mesh, *,
               batch_size: int, eval_batch_size: int, steps_per_call: int = 1, rules=None,
               compute_dtype: str = "float32", step_fusion: str = "same",
               eval_fusion: str = "same", l2_init: float = 0.0):
    self.method, self.task, self.tx, self.mesh = method, task, tx, mesh
    self.l2_init = float(l2_init)  # the coefficient of ||trainable - anchor||^2 in the loss
    self.compute_dtype = compute_dtype  # of the train and evaluation programs (`precision`)
    self.layout = sharding.Layout(mesh, rules)
    self.leaf_axes = sharding.leaf_axes_by_pattern(method.LEAF_AXES)
    self.data = sharding.put(data, self.layout.replicated)
    self.batch_size = int(batch_size)
    self.eval_batch_size = int(eval_batch_size)
    for name, value in (("step_fusion", step_fusion), ("eval_fusion", eval_fusion)):
      if value not in FUSIONS:
        raise ValueError(f"train.{name}={value!r} is not one of {list(FUSIONS)}")
    # XLA's CPU options mean nothing to another backend's compiler.
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    self.step_options = FUSIONS[step_fusion] if on_cpu else None
    self.eval_options = FUSIONS[eval_fusion] if on_cpu else None
    self.steps_per_call = int(steps_per_call)
    self._cache: dict[tuple, Program] = {}
    self._utilities: dict[tuple, Callable] = {}  # small programs of this run that are not steps
    self.listener: CompileListener | None = None  # hears of each compilation of a step
    def start(learner: Learner, opt_state, anchor: Learner | None) -> TrainState:
      trainable, frozen = jax.vmap(method.partition)(learner)
      opt_state = (jax.vmap(tx.init)(trainable) if opt_state is None
                   else sharding.copies(opt_state))
      anchor = None if anchor is None else jax.vmap(method.partition)(anchor)[0]
      return TrainState(*sharding.copies((trainable, frozen, learner.model_state)), opt_state,
                        anchor)

    # A stage's train state in one program per structure: the learner split into trained and
    # frozen parts, copies of its arrays (the train step donates them) and the optimizer's
    # state (initial, or a copy of the one kept). `combine` is the inverse of the split.
    self._start_state = utility(start, "start_state")
    self._combine = utility(jax.vmap(method.combine), "combine")

  # -- the compile cache ---------------------------------------------------------------------
  def program(self, key: tuple, build: Callable[[], Callable],
              shardings: Callable[[], tuple], donate=()) -> Program:
    """The jitted `build()` for `key`, built once; the run's only `jax.jit` of a step.

    `key` is (kind, program structure, population); `shardings()` gives the
    program's (in_shardings, out_shardings), whole trees. A kind that only evaluates is
    compiled with the evaluation's XLA options, any other with the train step's.
    """
    if key not in self._cache:
      name = "".join(c if c.isalnum() else "_" for c in str(key[0]))
      what, why = self.describe(key)
      kind = str(key[0]).split(" ")[0]
      self._cache[key] = Program(build(), *shardings(), donate, name, what=what, why=why,
                                 listener=self.listener,
                                 options=self.eval_options if kind in _EVALUATING
                                 else self.step_options, key=key, once=kind in _ONCE)
    return self._cache[key]

  def describe(self, key: tuple) -> tuple[str, str]:
    """(what the program of `key` is, why it is compiled now): the first program of its
    kind, a new program structure (the method names it: e.g. a new slot count), or a new
    population size (a stage program's key also holds its padded sizes)."""
    kind, structure, num = key[:3]
    what = PROGRAM_NAMES.get(kind, f"the pass {kind}")
    if num > 1:
      what += f" of {num} learners"
    same_kind = [k for k in self._cache if k[0] == kind]
    if not same_kind:
      return what, "first use" + (f"; structure {_short(structure)}" if structure != () else "")
    if all(k[1] != structure for k in same_kind):
      return what, self.method.program_change(same_kind[-1][1], structure)
    if all(k[2] != num for k in same_kind if k[1] == structure):
      return what, f"new population of {num}"
    return what, "new sizes"

  @property
  def cache(self) -> Mapping[tuple, Program]:
    """The programs compiled so far, by key (read-only)."""
    return types.MappingProxyType(self._cache)

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

  def place_replicated(self, tree):
    """`tree` placed with `replicated` shardings."""
    return sharding.put(tree, self.layout.replicated)

  def batch_shardings(self, batch: Batch, axes: Sequence[str | None]) -> Batch:
    s = self.layout.sharding(batch.idx.shape, axes, "batch")
    return Batch(s, s)

  # -- training ---------------------------------------------------------------------------------
  def step_body(self, structure, method: Method | None = None) -> Callable:
    """One train step of one learner: (state, data, idx (D, b), mask, rng) -> (state, loss).

    `method`: the method whose loss it differentiates (default: the run's; the FLOP count
    traces `Method.counted()`).
    """
    method, task, tx = method or self.method, self.task, self.tx
    loss_fn = precision.loss_in(self.compute_dtype, functools.partial(method.loss, structure))

    coef = self.l2_init

    def objective(trainable, frozen, model_state, x, y, mask, rng, anchor):
      loss, model_state = loss_fn(trainable, frozen, model_state, x, y, mask, rng)
      if anchor is not None and coef:  # c * ||theta - theta_0||^2 (L2 Init)
        loss = loss + coef * sum(jnp.sum(jnp.square(a.astype(jnp.float32) - b))
                                 for a, b in zip(jax.tree.leaves(trainable),
                                                 jax.tree.leaves(anchor)))
      return loss, model_state

    def step(state: TrainState, data, idx, mask, rng):
      x, y = task.inputs(data, idx, rng)
      (loss, model_state), grads = jax.value_and_grad(objective, has_aux=True)(
          state.trainable, state.frozen, state.model_state, x, y, mask, jax.random.fold_in(rng, 1),
          state.anchor)
      updates, opt_state = tx.update(grads, state.opt_state, state.trainable)
      return TrainState(optax.apply_updates(state.trainable, updates), state.frozen, model_state,
                        opt_state, state.anchor), loss.astype(jnp.float32)  # in any precision

    return step

  def chunk_body(self, structure) -> Callable:
    """K train steps of one learner: (state, data, Batch (K, D, b), key, counter) ->
    (state, K losses, whether the trainable params are all finite).

    Step i draws its randomness from `fold_in(key, counter + i)` (`counter`: the call's first
    step's, `step_counter`), so a step's draws do not depend on K. With K > 1 the steps run in
    a `lax.scan`; a step whose mask is all false (padding up to a whole number of calls)
    leaves the state untouched.
    """
    step = self.step_body(structure)

    def chunk(state: TrainState, data, batch: Batch, key, counter):
      if batch.idx.shape[0] == 1:
        state, loss = step(state, data, batch.idx[0], batch.mask[0],
                           jax.random.fold_in(key, counter))
        losses = loss[None]
      else:
        def body(st, inp):
          idx, mask, i = inp
          run = lambda s: step(s, data, idx, mask, jax.random.fold_in(key, counter + i))
          return jax.lax.cond(jnp.any(mask), run, lambda s: (s, jnp.float32(0.0)), st)

        state, losses = jax.lax.scan(body, state, (batch.idx, batch.mask,
                                                   jnp.arange(batch.idx.shape[0],
                                                              dtype=jnp.uint32)))
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

    fn = self.program(("train", structure, num), lambda: over_population(
        self.chunk_body(structure), (0, None, 0, 0, None), num), shardings, donate=(0,))
    return fn(state, self.data, batch, keys, counter)

  def init_state(self, learner: Learner, opt_state=None, anchor: Learner | None = None
                 ) -> TrainState:
    """The train state of a stacked `learner`, placed with its shardings (copies: the train
    step donates it); `anchor` (stacked, same structure): the parameters that the loss's
    `l2_init` term pulls toward (None: no such term)."""
    structure = self.seen_structure(learner.structure)
    state = self._start_state(learner.replace(structure=structure), opt_state,
                              None if anchor is None or not self.l2_init
                              else anchor.replace(structure=structure))
    return sharding.put(state, self.shardings(state))

  def combine(self, learner: Learner, trainable) -> PyTree:
    """`Method.combine` of every member of a stacked `learner` (one program per
    `seen_structure`); `trainable` itself where the method trains all of its parameters (no
    program: the train step donates the state, but nothing keeps the combined parameters
    past the next train call)."""
    if type(self.method).combine is Method.combine:
      return trainable
    return self._combine(learner.replace(structure=self.seen_structure(learner.structure)),
                         trainable)

  def seen_structure(self, structure) -> Hashable:
    """The structure the small programs of partition, combine and selection are given (their
    learners enter with it): what the method's functions read of it, else the program
    structure, so that growth inside the same slots compiles none of them again."""
    seen = self.method.structure_read(structure)
    return self.method.program_structure(structure) if seen is None else seen

  def timing_batch(self, num: int, num_orders: int) -> Batch:
    """A placed train batch of `num` learners, all indices 0 and all real (for timing)."""
    idx = np.zeros((num, self.steps_per_call, num_orders, self.batch_size), np.int32)
    return Batch(idx, np.ones(idx.shape, bool))

  def timing_eval_batch(self, num: int) -> Batch:
    """An evaluation batch of `num` learners, all indices 0 and all real (for timing)."""
    idx = np.zeros((num, self.eval_batch_size), np.int32)
    return Batch(idx, np.ones(idx.shape, bool))

  # -- evaluation ------------------------------------------------------------------------------
  def eval_body(self, structure) -> Callable:
    """(params, model_state, data, Batch) of one learner -> (number correct, summed NLL,
    number correct of each selection unit (U,), the method's `eval_aux` of the batch); an
    example counts 1 - its error."""
    method, task = self.method, self.task
    evaluate_batch = precision.evaluate_in(
        self.compute_dtype, lambda params, model_state, x, y, mask: method.evaluate_batch(
            structure, params, model_state, x, y, mask, task))

    def evaluate(params, model_state, data, batch: Batch):
      x, y = task.inputs(data, batch.idx)
      with inference.evaluation():  # a backbone may take its inference form
        logp, unit_logp, aux = evaluate_batch(params, model_state, x, y, batch.mask)
      errors, nll = task.per_example(logp, y)
      unit_errors, _ = jax.vmap(lambda lp: task.per_example(lp, y))(unit_logp)
      # Accuracy: 1 - error of each example (images: 0 or 1; text: the token error rate).
      return (jnp.sum(jnp.where(batch.mask, 1.0 - errors, 0.0)),
              jnp.sum(jnp.where(batch.mask, nll, 0.0)),
              jnp.sum(jnp.where(batch.mask, 1.0 - unit_errors, 0.0), axis=-1), aux)

    return evaluate

  def eval_fn(self, learner: Learner, shared: bool, batch: Batch) -> Program:
    """Compiled evaluation of a stacked `learner`; `shared`: one index batch for every learner."""
    structure = self.method.program_structure(learner.structure)
    num = slots.leading_size(learner.params)
    axes = (0, 0, None, None if shared else 0)

    def shardings():
      ins = (self.shardings(learner.params, name="params"),
             self.shardings(learner.model_state, name="model_state"), self.replicated(self.data),
             self.batch_shardings(batch, EVAL_BATCH_AXES[-batch.idx.ndim:]))
      return ins, self.layout.replicated

    return self.program(("eval_shared" if shared else "eval", structure, num),
                        lambda: over_population(self.eval_body(structure), axes, num), shardings)

  # -- passes over data (scoring, fitting growth candidates) -----------------------------------
  def pass_fn(self, kind: str, fn: Callable, learner: Learner, build: Callable, batch: Batch,
              carry=()) -> Program:
    """The compiled pass `kind` ("reduce" or "scan") of `fn` over batches for one (unstacked)
    learner; `build()` gives its body; a `scan`'s carry is replicated."""
    name = f"{kind} {getattr(fn, '__qualname__', repr(fn))}"

    def shardings():
      ins = (self.shardings(learner.params, stacked=False, name="params"),
             self.shardings(learner.model_state, stacked=False, name="model_state"),
             self.replicated(self.data), self.batch_shardings(batch, ("batch",)))
      return ins + ((self.replicated(carry),) if kind == "scan" else ()), self.layout.replicated

    return self.program((name, self.method.program_structure(learner.structure), 1), build,
                        shardings)

  # -- one epoch and a whole stage (`alma_jax.engine.epoch`) ----------------------------------------
  def select_fn(self, structure) -> Callable:
    """`Method.select_units` of a stacked population of learners of (learner, not program)
    structure `structure`: (take (S, U), new, old) -> learner."""
    method = self.method
    return jax.vmap(lambda t, a, b: method.select_units(structure, t, a, b))

  def epoch_fns(self, structure, num: int) -> epoch_lib.EpochFns:
    """The train chunk, evaluation batch, parameter combination and unit selection of a
    stacked population of `num` learners of structure `structure`."""
    program = self.method.program_structure(structure)
    return epoch_lib.EpochFns(
        chunk=over_population(self.chunk_body(program), (0, None, 0, 0, None), num),
        evaluate=over_population(self.eval_body(program), (0, 0, None, 0), num),
        combine=jax.vmap(self.method.combine), select=self.select_fn(structure))

  def end_epoch_call(self, rule: epoch_lib.Rule, stop, best: Learner, current: Learner, ok,
                     scores, epoch: int, n_steps: int, thresholds: np.ndarray):
    """`epoch.end_epoch` as a small compiled program (one per structure, population and
    rule; a utility, not a step): the rule of an epoch driven from the host."""
    num, structure = int(ok.shape[0]), best.structure
    rule = rule.program_rule()
    seen = self.seen_structure(structure)
    key = ("end_epoch", seen, num, rule)
    if key not in self._utilities:
      select = self.select_fn(seen)

      def end(stop, best, current, ok, scores, epoch, n_steps, thresholds):
        return epoch_lib.end_epoch(rule, select, stop, best, current, ok, scores, epoch,
                                   n_steps, thresholds)

      self._utilities[key] = utility(end, "end_epoch", key)
    i32 = lambda v: np.asarray(v, np.int32)  # pylint: disable=unnecessary-lambda-assignment
    stop, best, facts = self._utilities[key](
        stop, best.replace(structure=seen), current.replace(structure=seen), ok,
        np.asarray(scores, np.float32), i32(epoch), i32(n_steps), thresholds)
    return stop, best.replace(structure=structure), facts

  def stage_body(self, structure, num: int, rule: epoch_lib.Rule) -> Callable:
    """Epochs of a stacked population as one program: `epoch.epoch` in a `lax.while_loop`.

    (state, base learner, best learner, stop state, data, orders Batch (M, C, S, K, D, b),
    validation Batch (V, S, b'), keys (S,), first epoch, end epoch, train calls per epoch,
    steps per epoch, validation batches, improvement thresholds) -> (state, best, stop,
    the outputs of the M epoch slots, the epoch after the last one run).

    Epoch e (from the first epoch while e < end epoch and a member is active) runs the
    same train calls as `train_call` (the same PRNG counters), the evaluation program's
    body over the validation batches and `epoch.end_epoch`.
    """
    fns = self.epoch_fns(structure, num)

    def stage(state: TrainState, base: Learner, best: Learner, stop, data, orders: Batch,
              val: Batch, keys, first, end, num_calls, n_steps, num_val, thresholds):
      m_slots = orders.idx.shape[0]

      def one(carry, slot):
        e = carry["epoch"]
        return epoch_lib.epoch(
            fns, rule, carry, Batch(orders.idx[slot], orders.mask[slot]), val, data, keys,
            base=base, num_calls=num_calls, n_steps=n_steps, num_val=num_val,
            thresholds=thresholds, counter0=e.astype(jnp.uint32) * jnp.uint32(STEPS_BOUND))

      units, width = stop.best_score.shape[1], orders.idx.shape[1] * orders.idx.shape[3]
      per = lambda shape, dtype: jnp.zeros((m_slots, num) + shape, dtype)  # pylint: disable=unnecessary-lambda-assignment
      outs = {"losses": per((width,), jnp.float32), "finite": per((), bool),
              "correct": per((), jnp.float32), "units": per((units,), jnp.float32),
              "bad": per((), bool), "improved": per((units,), bool),
              "stop": jax.tree.map(lambda a: jnp.zeros((m_slots,) + a.shape, a.dtype), stop)}

      def body(loop):
        carry, outs = loop
        slot = carry["epoch"] - first
        carry, out = one(carry, slot)
        return carry, jax.tree.map(lambda a, v: a.at[slot].set(v), outs, out)

      def running(loop):
        carry, _ = loop
        return (carry["epoch"] < end) & jnp.any(carry["stop"].active)

      carry, outs = jax.lax.while_loop(
          running, body, ({"epoch": first, "state": state, "best": best, "stop": stop}, outs))
      return carry["state"], carry["best"], carry["stop"], outs, carry["epoch"]

    return stage

  def stage_call(self, rule: epoch_lib.Rule, state: TrainState, base: Learner, best: Learner,
                 stop, orders: Batch, val: Batch, keys, first: int, end: int, num_calls: int,
                 n_steps: int, num_val: int, thresholds: np.ndarray):
    """Runs `stage_body`'s program (compiled once per structure, population, array shapes
    and rule); the state is donated."""
    num, structure = int(keys.shape[0]), best.structure
    program = self.method.program_structure(structure)
    # The learner's own structure joins the key where it is not the program's: selecting the
    # best units may depend on it (e.g. which ensemble members trained).
    key = (("stage", program, num, orders.idx.shape, val.idx.shape, thresholds.shape,
            rule.patience, rule.stop_all_on_divergence)
           + (() if program == structure else (structure,)))

    def shardings():
      rep = self.layout.replicated
      state_sh = self.shardings(state)
      learner_sh = lambda l: Learner(self.shardings(l.params, name="params"),  # pylint: disable=unnecessary-lambda-assignment
                                     self.shardings(l.model_state, name="model_state"), structure)
      ins = (state_sh, learner_sh(base), learner_sh(best), self.replicated(stop),
             self.replicated(self.data), Batch(rep, rep), Batch(rep, rep), rep, rep, rep, rep,
             rep, rep, rep)
      return ins, (state_sh, learner_sh(best), self.replicated(stop), rep, rep)

    fn = self.program(key, lambda: self.stage_body(structure, num, rule.program_rule()),
                      shardings, donate=(0,))
    i32 = lambda v: np.asarray(v, np.int32)  # pylint: disable=unnecessary-lambda-assignment
    return fn(state, base, best, stop, self.data, orders, val, keys, i32(first), i32(end),
              i32(num_calls), i32(n_steps), i32(num_val), thresholds)
