"""What a run is made of before its stream starts: data, streams, method, steps, policies.

`build(config, workdir)` loads the data (and fingerprints it), partitions
each seed's stream, decides the fields left to be chosen (the convolution
gradient, the ensemble strategy, the steps per call, and the CPU fusion flags in effect:
`alma_jax.tuning.tune`), builds the method's compiled
steps and the stage and waiting policies (`alma_jax.policies`). The `Setup`
it returns also answers what the loop and the checkpoints ask of it: the
contexts of a stage, the first learners, the FLOPs of a structure, and the
abstract state a checkpoint is restored into.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from alma_jax import methods
from alma_jax import models
from alma_jax import policies
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.configuration import options
from alma_jax.data import stream as stream_lib
from alma_jax.engine import meter as meter_lib
from alma_jax.engine import optim
from alma_jax.engine import plasticity
from alma_jax.engine import population
from alma_jax.engine import sharding
from alma_jax.engine.steps import Steps
from alma_jax.errors import ConfigError
from alma_jax.outputs import checkpoint as ckpt_lib
from alma_jax.outputs import workdir as wd
from alma_jax.policies import schedule
from alma_jax.runtime import background
from alma_jax.runtime import host_random
from alma_jax.runtime import multihost
from alma_jax.stream import validation
from alma_jax.tuning import tune

VGG_SEEDS_WARNING = ("config.num_seeds=%d with config.model.name=%r on CPU: vmapped convolutions "
                     "run as grouped convolutions, many times slower than separate runs "
                     "(benchmarks/ensemble_strategy.py); separate runs are faster here")


# Config fields that reach a run's programs only as values or as arguments' shapes: left out of
# the key of its kept programs and FLOP counts (`Setup.program_context`).
SCHEDULE_ONLY = ("seed", "stream.wait", "stream.replay")


@dataclasses.dataclass
class Setup:
  """A run's fixed parts: what every time step of its stream uses.

  Attributes:
    config, workdir: the validated config and the output directory.
    seeds: the seeds of the population (`config.seed` ... + `config.num_seeds` - 1).
    out_dirs: each seed's output folder (the workdir itself for one seed).
    primary: whether this process writes the outputs (checkpoints: every process).
    task: what a batch means (`alma_jax.tasks`).
    subsets: each seed's training subset (indices into the training split), or None.
    streams: each seed's mega-batches (`alma_jax.data.stream.Stream`).
    inputs: the fingerprint of the data the run reads.
    choices: the fields decided before the run (`alma_jax.tuning.autotune`).
    choice_records: what the workdir is to remember of them, once the run owns it
      (`tune.remember_in_workdir`).
    steps: the compiled steps; `method` is `steps.method`.
    keys: the seeds' root PRNG keys, stacked.
    stage_policy, wait_policy: how a stage starts, and when the learner trains.
  """

  config: Any
  workdir: str
  seeds: list[int]
  out_dirs: list[str]
  primary: bool
  task: Any
  subsets: list[np.ndarray | None]
  streams: list[stream_lib.Stream]
  inputs: str
  choices: dict
  choice_records: tuple
  steps: Steps
  keys: jax.Array
  stage_policy: policies.StagePolicy
  wait_policy: policies.WaitPolicy
  _flops: dict = dataclasses.field(default_factory=dict)
  _initial: list = dataclasses.field(default_factory=list)
  _grown_init: dict = dataclasses.field(default_factory=dict)
  _diagnostics: list = dataclasses.field(default_factory=list)

  @property
  def method(self) -> methods.Method:
    return self.steps.method

  @property
  def num_t(self) -> int:
    """B, the last time step."""
    return self.config.stream.num_megabatches

  def test_idx(self) -> np.ndarray:
    return np.arange(self.steps.data.size("test"), dtype=np.int32)

  def contexts(self, t: int, stage: int, previous: int) -> list[methods.StageContext]:
    """Each seed's context of the stage at time step `t` (the `stage`-th; the previous one
    trained at `previous`, 0 for none)."""
    s = self.config.stream
    out = []
    for i, sd in enumerate(self.seeds):
      data = schedule.stage_data(self.streams[i], t, s.wait, s.replay, sd, previous=previous)
      out.append(methods.StageContext(
          t=t, stage=stage, is_first=stage == 1, train_idx=self._to_train_split(i, data.train),
          val_idx=self._to_train_split(i, data.val), reduce=self.steps.reduce,
          scan=self.steps.scan, eval_aux=self.steps.eval_aux))
    return out

  @property
  def probe(self) -> "_Probe":
    """What a waiting policy may ask of the run (`alma_jax.policies.base.Probe`)."""
    return _Probe(self)

  def megabatch_val_idx(self, i: int, t: int) -> np.ndarray:
    """Seed `i`'s validation examples of mega-batch `t` (indices into the training split)."""
    return self._to_train_split(i, np.asarray(self.streams[i].val[t - 1], np.int32))

  def _to_train_split(self, i: int, idx: np.ndarray) -> np.ndarray:
    sub = self.subsets[i]
    return idx if sub is None else sub[idx].astype(np.int32)

  def initial_learner(self):
    """The untrained learners of t = 0, stacked and placed; refused with `ConfigError` when
    their parameters alone would not fit in memory (`check_parameter_memory`)."""
    check_parameter_memory(self.method, self.keys)
    return population.initial(self.method, self.keys, self.steps.place)

  def initial(self):
    """`initial_learner()`, made once per process: what the `train.l2_init` term pulls toward
    and what the plasticity diagnostics measure the distance from."""
    if not self._initial:
      self._initial.append(self.initial_learner())
    return self._initial[0]

  def anchor(self, learner):
    """theta_0 of the stacked `learner`'s structure, per seed (`plasticity.initial_values`):
    `initial()` while the structure is the initial one. After growth, the grown structure's
    initialisation is drawn once (the last structure's is kept) and the padding slots take
    `learner`'s values of now."""
    initial = self.initial()
    if learner.structure == initial.structure:
      return initial
    if learner.structure not in self._grown_init:
      self._grown_init.clear()
      self._grown_init[learner.structure] = [
          self.method.init(host_random.fold_in(k, 0), learner.structure)
          for k in population.member_keys(self.keys)]
    fresh = self._grown_init[learner.structure]
    return population.stack([
        plasticity.initial_values(self.method, population.unstack(initial, i), f,
                                  population.unstack(learner, i))
        for i, f in enumerate(fresh)], self.steps.place)

  def diagnostics(self) -> plasticity.Diagnostics | None:
    """The plasticity diagnostics of the records (None: `log.plasticity` is off)."""
    if not F.get(self.config.log, "log.plasticity"):
      return None
    if not self._diagnostics:
      log = self.config.log
      self._diagnostics.append(plasticity.Diagnostics(
          self.steps, F.get(log, "log.dormant_threshold"),
          min(F.get(log, "log.plasticity_probe"), self.steps.data.size("train")), self.anchor))
    return self._diagnostics[0]

  def flops(self, learner) -> dict[str, float]:
    """`Steps.flops` of one (unstacked, or abstract) learner, counted once per structure (and
    kept across processes while programs are: `accounting.step_flops`)."""
    counted = self._flops.get(learner.structure)  # counted, being counted (`count_ahead`) or not
    counted = background.value(self.steps.flops(learner) if counted is None else counted)
    self._flops[learner.structure] = counted
    return counted

  def count_ahead(self, learners) -> None:
    """Starts `seed_flops(learners)` on the background thread (`alma_jax.runtime.background`),
    for a structure about to train: its traces go on while the stage compiles and trains."""
    member = population.abstract_member(learners)
    if member.structure not in self._flops:
      self._flops[member.structure] = background.later(self.steps.flops, member)

  def seed_flops(self, learners) -> dict[str, float]:
    """`flops` of a learner of the stacked `learners` (of its shapes: counting needs no
    values, and every member has the same)."""
    return self.flops(population.abstract_member(learners))

  def program_context(self) -> str:
    """What besides the code decides this run's compiled programs (`executables.keeping`):
    its config but for the fields of `SCHEDULE_ONLY`, the choices made for it and the
    fingerprint of its data.

    Those fields reach programs only as values or shapes. The seed: the PRNG keys
    (arguments, or the key program's static argument) and the data order (indices);
    `stream.wait` and `stream.replay`: which examples a stage trains on (indices, and the
    stage's size where a program takes the stage whole: an argument's shape, part of the
    program's key). So the runs of a sweep over seeds, waiting times and replay share
    their programs and FLOP counts, but for runs of one seed on a `data.train_subset`,
    whose data (in the fingerprint) the seed draws; `num_seeds` (the population's size)
    stays in, and so does every field a config derives from these."""
    config = {k: v for k, v in wd.flatten(wd.config_dict(self.config)).items()
              if k not in SCHEDULE_ONLY}
    return json.dumps({"config": config, "choices": self.choices, "inputs": self.inputs},
                      sort_keys=True, default=repr)

  def log_estimate(self, learner) -> None:
    """Logs an upper bound on the training time (all epochs, no early stop)."""
    b, fixed = self.config.train.batch_size, config_lib.stage_steps(self.config)
    sizes = _stage_sizes(self.streams[0], self.wait_policy.planned_times(self.num_t),
                         self.config.stream.replay)
    total = (len(sizes) * fixed if fixed
             else sum(-(-m // b) for m in sizes) * self.config.train.epochs)
    if total < 5000:  # a short run: measuring would cost a noticeable part of it
      return
    per_step = self.steps.seconds_per_step(learner)
    est = per_step * total
    logging.info("estimated training time: at most %s for %d steps at %.4f s/step (growing "
                 "models get slower; early stopping shortens it)", meter_lib.duration(est),
                 total, per_step)

  def progress_plan(self) -> meter_lib.Plan:
    """What the progress ETAs count on: the planned stages' train steps per epoch (the
    first seed's stream), epochs, examples per step and their unit."""
    times = self.wait_policy.planned_times(self.num_t)
    fixed = int(F.get(self.config.train, "train.steps_per_epoch"))
    b = int(self.config.train.batch_size)
    sizes = _stage_sizes(self.streams[0], times, self.config.stream.replay)
    unit, per_example = tune.example_unit(self.config)
    return meter_lib.Plan(num_t=self.num_t, stages={t: fixed or -(-m // b)
                                                    for t, m in zip(times, sizes)},
                          epochs=int(self.config.train.epochs),
                          examples_per_step=b * len(self.seeds),
                          unit="examples" if unit == "img" else unit, unit_per_example=per_example)

  # -- what a checkpoint is restored into ---------------------------------------------------------
  def restore_target(self) -> Callable:
    """(structure, has_opt_state) -> the abstract stacked checkpoint state, with the shardings
    of the steps (the key replicated)."""
    steps = self.steps

    def build(structure, has_opt_state):
      return ckpt_lib.abstract_state(
          self.method, steps.tx, self.keys, structure, has_opt_state,
          lambda k, v: steps.replicated(v) if k == "key" else steps.shardings(v, name=k))

    return build

  def check_saved_config(self, extra: dict) -> None:
    """Raises unless a checkpoint's facts (`extra`) name this config and these inputs."""
    current = wd.config_dict(self.config)
    diffs = wd.config_diff(extra.get("config", current), current)
    if diffs:
      raise ckpt_lib.IncompatibleCheckpointError(
          f"the checkpoints were written by a different config: {'; '.join(diffs)}; pass "
          "--overwrite to discard them")
    if extra.get("inputs", self.inputs) != self.inputs:
      d = self.config.data
      what = f"config.data.text_file={d.text_file!r}" if d.get("text_file") else (
          f"the data set {d.name!r}")
      raise ckpt_lib.IncompatibleCheckpointError(
          f"the checkpoints were written from other input data than {what} holds now "
          f"(fingerprint {extra['inputs'][:12]} then, {self.inputs[:12]} now); restore the "
          "original inputs to resume, or pass --overwrite to discard the checkpoints")


def build(config, workdir: str) -> Setup:
  """The `Setup` of a validated `config` writing to `workdir`. The config is read here, by
  the tuning of the speed choices, and as frozen `options` by everything the set-up builds."""
  c = options.of(config)
  s = c.stream
  seeds = [int(c.seed) + i for i in range(int(c.num_seeds))]
  out_dirs = [workdir] if len(seeds) == 1 else [wd.seed_dir(workdir, sd) for sd in seeds]
  mesh = sharding.mesh_from_config(c)
  task = tasks.for_config(c)
  ds, subsets = task.load(c, seeds)
  n_train = len(ds.train_y) if subsets[0] is None else len(subsets[0])
  streams = [stream_lib.make_stream(n_train, s.num_megabatches, s.val_fraction, sd)
             for sd in seeds]
  validation.validate_data(c, n_train, streams[0], len(ds.test_y))
  shape, data = ds.train_x.shape[1:], task.device_data(ds)
  validation.check_input_shape(c, shape)
  inputs = fingerprint(data)

  built: dict[tuple, Steps] = {}  # a measured candidate's programs serve the run

  def build_steps(cfg) -> Steps:  # the compiled steps of the method `cfg` makes
    key = tune.signature(cfg)
    if key not in built:
      o = options.of(cfg)
      built[key] = Steps.from_config(o, methods.make(o, shape, ds.num_classes), task,
                                     optim.from_config(o), data, mesh)
    return built[key]

  choices, choice_records = tune.run_choices(config, shape, build_steps, workdir)
  steps = build_steps(tune.with_choices(config, choices))
  logging.info("data %s: %d train / %d test examples, B=%d mega-batches of ~%d, wait=%d, "
               "replay=%.2f, seeds %s; mesh %s", c.data.name, n_train, len(ds.test_y),
               s.num_megabatches, len(streams[0].train[0]) + len(streams[0].val[0]), s.wait,
               s.replay, seeds, dict(mesh.shape))
  if len(seeds) > 1 and jax.default_backend() == "cpu" and models.spec(c.model.name).conv_heavy:
    logging.warning(VGG_SEEDS_WARNING, len(seeds), c.model.name)
  return Setup(config=c, workdir=workdir, seeds=seeds, out_dirs=out_dirs,
               primary=multihost.is_primary(), task=task, subsets=subsets, streams=streams,
               inputs=inputs, choices=choices, choice_records=choice_records, steps=steps,
               keys=population.keys(seeds),
               stage_policy=policies.make_stage(c), wait_policy=policies.make_wait(c))


class _Probe:
  """`alma_jax.policies.base.Probe` of a run's set-up."""

  def __init__(self, setup: Setup):
    self._setup, self.num_seeds = setup, len(setup.seeds)

  def sizes(self, t: int) -> list[int]:
    return [len(x) for x in self._setup.streams[0].train[:t]]

  def val_error(self, learner, t: int) -> tuple[float, int]:
    idx = self._setup.megabatch_val_idx(0, t)
    if not len(idx):
      return float("nan"), 0
    acc, _ = self._setup.steps.evaluate(learner, "train", idx)
    return float(1.0 - acc[0]), len(idx)

  def flops(self, learner) -> dict[str, float]:
    return self._setup.seed_flops(learner)


def _stage_sizes(stream, times: list[int], replay: float) -> list[int]:
  """How many training examples each stage at `times` has."""
  sizes, previous = [], 0
  for t in times:
    new = sum(len(stream.train[i - 1]) for i in range(previous + 1, t + 1))
    past = sum(len(stream.train[i - 1]) for i in range(1, previous + 1))
    sizes.append(new + int(round(replay * past)))
    previous = t
  return sizes


def fingerprint(data) -> str:
  """SHA-256 of the arrays of the data a run trains and tests on (any change of an input
  file or data set that reaches the run changes it)."""
  digests = [ckpt_lib.array_digest(np.asarray(leaf)) for leaf in jax.tree.leaves(data)]
  return hashlib.sha256(" ".join(digests).encode()).hexdigest()


# -- memory of the parameters ------------------------------------------------------------------
def memory_limit() -> tuple[int | None, str]:
  """(bytes, what they are) of the memory that holds the parameters: the local accelerators'
  memory where JAX reports it, else this machine's physical memory (None: unknown)."""
  devices = jax.local_devices()
  try:
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  except Exception:  # pylint: disable=broad-except  (a backend without memory statistics)
    limits = [None]
  if limits and all(limits):
    return int(sum(limits)), f"the memory of {len(devices)} {devices[0].platform} device(s)"
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
  except (ValueError, OSError, AttributeError):
    return None, "unknown"


def _size(n: float) -> str:
  """`n` bytes in the largest binary unit that keeps the number >= 1 (e.g. 2.9 TiB)."""
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:,.1f} {unit}"
  return f"{int(n)} bytes"


def check_parameter_memory(method: methods.Method, keys: jax.Array, limit: int | None = None,
                           what: str = "") -> None:
  """Raises `ConfigError` when the parameters (and model state) of the learners of `keys`, as
  `method.init` would make them, need more bytes than `limit` (default: `memory_limit()`);
  counted from their shapes (`jax.eval_shape`), before anything is allocated or compiled."""
  if limit is None:
    limit, what = memory_limit()
    if limit is None:
      return
  shapes = jax.eval_shape(lambda k: method.init(k[0]), keys)
  leaves = jax.tree.leaves((shapes.params, shapes.model_state))
  count = sum(int(np.prod(l.shape, dtype=object)) for l in leaves)
  need = len(keys) * sum(int(np.prod(l.shape, dtype=object)) * l.dtype.itemsize for l in leaves)
  if need > limit:
    model = method.config.model
    raise ConfigError(
        f"config.model (name={F.get(model, 'model.name')!r}, width={model.get('width')!r}): the "
        f"parameters alone would need {_size(need)} ({count:,} per learner x {len(keys)} "
        f"seed(s)), more than {what} ({_size(limit)}); training needs several times more "
        "(gradients, optimizer state): choose a smaller model")
