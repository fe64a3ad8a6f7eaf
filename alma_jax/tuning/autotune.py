"""Implementation choices made by measurement on the machine that runs.

Some choices change the speed of a train step, not its arithmetic (beyond
float round-off), and which one wins depends on the machine: the convolution
gradient (`model.conv_impl`: XLA's kernels or a weight gradient summed over
batch chunks), how ensemble members run (`method.strategy`: vmap or a loop),
how many train steps one compiled call runs (`train.steps_per_call`), and
XLA:CPU's options for the programs that train (`train.step_fusion`) and for
those that evaluate (`train.eval_fusion`: timed on the evaluation, not the
train step).
Crossovers measured on one CPU do not transfer to another, so when such a
field is left to be chosen ("auto", or 0 steps per call) and
`config.train.autotune="measure"`, the run builds the train call of every
candidate on the run's real shapes, times them in turns (`ROUNDS` rounds, each
timing a group of calls of every candidate: a drift of the host's speed slows
all of them alike) and keeps the fastest.

A choice is remembered under a key made of the device, the JAX version and
the shapes that decide it (for XLA's options, also the options offered):
  * in `<cache dir>/autotune.json` (beside the persistent compilation cache;
    the cache dir is `$ALMA_JAX_CACHE_DIR` or `~/.cache/alma_jax`), so only the
    first run of a shape on a machine pays for the measurement (`measured_once`: runs
    that start together wait for one process's measurement and take its answer);
  * in the run's workdir (`autotune.json`), so a resumed run keeps its
    choices even on another machine.
The run logs every choice (and the times behind a new one) and writes them to
`summary.json` under "choices".

The rules decide with `train.autotune="rules"`, in a run of several
processes (which must agree without measuring or reading files), for a
candidate that fails to build, and for a run on an accelerator that plans
fewer train steps than `gpu_autotune.MIN_STEPS` (`short_accelerator_run`:
there a candidate's cold compile costs seconds that a short run's steps
cannot win back; a choice measured earlier on the machine is still used).
They are `models.conv.resolve_impl`, `methods.ensemble.choose_strategy`
and `steps_per_call_rule` (`RULE_STEPS_PER_CALL` steps per call on CPU,
`SHORT_STEPS_PER_CALL` for an MLP's short steps there, and
`ACCELERATOR_STEPS_PER_CALL` on accelerators, where a small step is bound by
the launch of each call).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

import jax
from absl import logging

from alma_jax import methods
from alma_jax import models
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.configuration import options
from alma_jax.data import images
from alma_jax.engine import population
from alma_jax.engine import programs
from alma_jax.engine import timing
from alma_jax.methods import ensemble
from alma_jax.methods import gmoe
from alma_jax.models import conv
from alma_jax.outputs import io_utils
from alma_jax.runtime import caches
from alma_jax.runtime import host
from alma_jax.tuning import gpu_autotune

FILE = "autotune.json"
MODES = ("measure", "rules")
RULE_STEPS_PER_CALL = 1  # CPU: a call's launch is small beside its step
SHORT_STEPS_PER_CALL = 8  # CPU, steps of a few milliseconds (`_short_steps`)
ACCELERATOR_STEPS_PER_CALL = 8
STEPS_PER_CALL_CANDIDATES = (1, 8)
AUTO_STEPS_PER_CALL = 0  # the value of train.steps_per_call that asks for a choice
# Candidates are timed in turns (`timing.alternate`): ROUNDS rounds, each timing one group of
# calls of every candidate lasting at least MIN_GROUP_S. Timed one after the other, three
# groups of 0.05 s each, P1's candidates on a 2-core AMD EPYC ranked differently from one
# run to the next (an XLA:CPU setting measured at 604 and 1,292 img/s minutes apart).
ROUNDS = 5
MIN_GROUP_S = 0.25
STEP_FUSION, EVAL_FUSION = "train.step_fusion", "train.eval_fusion"
FUSION_RULE = "same"  # the process's XLA flags, nothing on top
# The XLA:CPU options `auto` measures (`programs.FUSIONS`); each costs a compilation of the
# measured program in the first run of a shape on a machine. The older emitters (elemental,
# elemental_no_ynn) compile faster but trained whole runs slower when measured: set explicitly
# (docs/speed.md).
MEASURED_FUSIONS = ("same", "no_ynn", "onednn")


@dataclasses.dataclass(frozen=True)
class Tunable:
  """A config field whose value may be chosen: when it applies, its candidates and its rule.

  `timed`: what a candidate's speed is measured on, "train" (a train step) or "eval" (the
  evaluation program); a single candidate is the rule's answer, not measured.
  """

  path: str
  auto: Any
  candidates: Callable[[Any], tuple]
  rule: Callable[[Any], Any]
  applies: Callable[[Any], bool] = lambda config: True
  measured: bool = True  # False: its rule always decides (nothing to time in a train step)
  timed: str = "train"


def _get(config, path: str):
  section, name = path.split(".")
  return config[section].get(name)


def _conv_rule(config):
  return conv.resolve_impl("auto", config.model.width)


def _strategy_rule(config):
  return ensemble.choose_strategy("auto", config.model.name)


def stage_program_rule(config) -> str:
  """`train.stage_program` when left to be chosen: the whole stage as one program on a CPU,
  for a backbone that is not convolution-heavy and a method that does not grow, where a step
  is short and the calls from the host are a large part of a stage (an MLP: about twice as
  fast); convolution-heavy steps leave nothing to gain, and a growing model would compile the
  larger stage program once per structure. The program counts correct validation examples
  exactly, so it needs a task whose examples are right or wrong (not text)."""
  exact = tasks.task_class(options.of(config)).right_or_wrong()
  grows = methods.get(config.method.name).before_stage is not methods.Method.before_stage
  whole = (exact and not grows and jax.default_backend() == "cpu"
           and not models.spec(config.model.name).conv_heavy)
  return "whole" if whole else "per_epoch"


def eval_fusion_candidates(config) -> tuple[str, ...]:
  """`train.eval_fusion`'s candidates: XLA:CPU's options of `MEASURED_FUSIONS` that its
  compiler knows, on a CPU only."""
  del config
  if jax.default_backend() != "cpu":
    return (FUSION_RULE,)
  return tuple(v for v in MEASURED_FUSIONS if programs.accepts(v))


def step_fusion_candidates(config) -> tuple[str, ...]:
  """`train.step_fusion`'s candidates: XLA:CPU's options, on a CPU for a backbone that is not
  convolution-heavy (a convolution-heavy one's flags are measured for the whole process,
  `train.cpu_fusion`)."""
  if models.spec(config.model.name).conv_heavy:
    return (FUSION_RULE,)
  return eval_fusion_candidates(config)


def _calls_from_the_host(config) -> bool:
  """Whether a CPU run trains by calls from the host (`train.stage_program` per_epoch) with
  steps whose length a call's launch may matter beside: a backbone that is not
  convolution-heavy."""
  if jax.default_backend() != "cpu" or models.spec(config.model.name).conv_heavy:
    return False
  stage = config.train.get("stage_program", "auto")
  return (stage_program_rule(config) if stage == "auto" else stage) == "per_epoch"


def _short_steps(config) -> bool:
  """Whether a CPU run's train steps are short beside the launch of a compiled call: an image
  task's MLP (a step of a few milliseconds, a launch of about one) trained by calls from the
  host."""
  return (_calls_from_the_host(config)
          and "images" in models.spec(config.model.name).tasks)


def _accelerator() -> bool:
  return jax.default_backend() != "cpu"


def short_accelerator_run(config) -> int | None:
  """The run's planned train steps (`config_lib.planned_steps`) when it runs on an
  accelerator and plans fewer than `gpu_autotune.MIN_STEPS`, the bound below which XLA's own
  autotuning is not worth its compile time either; None otherwise (a CPU, a longer run, data
  of unknown size). Such a run takes its rules instead of measuring: on an H200, measuring
  P1's two convolution implementations compiled a second train step (4.9 s) and timed both,
  for a run whose about 800 steps train in 5.4 s (`gpu_autotune`)."""
  return config_lib.short_run_steps(config) if _accelerator() else None


def steps_per_call_rule(config) -> int:
  """Steps per compiled call when they are left to be chosen and not measured: several on an
  accelerator (a small step is bound by the launch of each call) and for short CPU steps
  (`_short_steps`), otherwise one (a signal is looked at between calls)."""
  if jax.default_backend() != "cpu":
    return ACCELERATOR_STEPS_PER_CALL
  return SHORT_STEPS_PER_CALL if _short_steps(config) else RULE_STEPS_PER_CALL


def steps_per_call_candidates(config) -> tuple[int, ...]:
  """`train.steps_per_call`'s candidates: measured where a CPU run trains by calls from the
  host with steps that are not convolution-heavy; elsewhere the rule's answer is the only
  candidate, and no program is compiled to measure it (on an accelerator, where a cold
  compile is costly, 8; for a convolution-heavy step or a whole-stage program on a CPU, 1)."""
  if _calls_from_the_host(config):
    return STEPS_PER_CALL_CANDIDATES
  return (steps_per_call_rule(config),)


TUNABLES = (
    Tunable("model.conv_impl", "auto", lambda c: conv.candidates(),
            _conv_rule, lambda c: models.spec(c.model.name).conv_heavy),
    # With one member at the start both strategies run the same program.
    Tunable("method.strategy", "auto", lambda c: ("vmap", "loop"), _strategy_rule,
            lambda c: _get(c, "method.strategy") is not None and max(
                c.method.get("num_members", 1), c.method.get("initial_members", 1)) > 1),
    Tunable("train.steps_per_call", AUTO_STEPS_PER_CALL, steps_per_call_candidates,
            steps_per_call_rule),
    Tunable("train.stage_program", "auto", lambda c: ("per_epoch", "whole"), stage_program_rule,
            measured=False),
    # gMoE's expert slots: planned (one structure) for a short run on an accelerator.
    Tunable("method.slots", "auto", lambda c: ("pow2", "planned"), gmoe.slot_rule,
            lambda c: methods.get(c.method.name) is gmoe.GrowingMoE, measured=False),
    Tunable(STEP_FUSION, "auto", step_fusion_candidates, lambda c: FUSION_RULE),
    Tunable(EVAL_FUSION, "auto", eval_fusion_candidates, lambda c: FUSION_RULE, timed="eval"),
)


def pending(config) -> list[Tunable]:
  """The tunables this config leaves to be chosen."""
  return [t for t in TUNABLES if t.applies(config) and _get(config, t.path) == t.auto]


def kept_from(config, earlier: dict | None) -> dict[str, Any]:
  """The fields that `config` leaves to be chosen and `earlier` (the resolved config of the
  run it resumes, as its `config.json` holds it) set to a value, with that value: a resumed
  run keeps them as it ran (its checkpoints hold that structure, where a rule might choose
  otherwise on this machine). A field that `earlier` lacks ran with its value of
  `config_lib.ADDED_WITH_OLD_VALUE`, if it has one."""
  if not earlier:
    return {}
  kept = {}
  for t in pending(config):
    section, name = t.path.split(".")
    value = earlier.get(section, {}).get(name, config_lib.ADDED_WITH_OLD_VALUE.get(t.path, t.auto))
    if value != t.auto:
      kept[t.path] = value
  return kept


def by_rules(config):
  """A copy of `config` with every field it leaves to be chosen decided by its rule (what
  `train.autotune="rules"` decides, without logging or files)."""
  return with_choices(config, {t.path: t.rule(config) for t in pending(config)})


def signature(config) -> tuple:
  """The values of every tunable field of `config`."""
  return tuple(repr(_get(config, t.path)) for t in TUNABLES)


def with_choices(config, choices: dict[str, Any]):
  """A copy of `config` with the chosen values in place of "auto"."""
  out = config.copy_and_resolve_references()
  with out.unlocked():
    for path, value in choices.items():
      section, name = path.split(".")
      out[section][name] = value
  return out


# The choices that measure the convolution implementations (the fusion flags' children time
# each of them): a new implementation is measured on a machine again.
CONV_FIELDS = ("model.conv_impl", "train.cpu_fusion")


def _method_fields(config) -> dict[str, Any]:
  """The method's fields as a choice's key holds them, a field its rule decides (gMoE's
  `method.slots=auto`) at the rule's value: the step it builds (runs that chose before gMoE's
  slots defaulted to `auto`, set to `pow2`, keep their choices)."""
  ruled = {t.path: t.rule(config) for t in pending(config)
           if not t.measured and t.path.startswith("method.")}
  return {k: ruled.get(f"method.{k}", v) for k, v in sorted(config.method.items())
          if isinstance(v, (int, float, str, bool)) and k != "strategy"}


def step_facts(config, input_shape, path: str) -> dict[str, Any]:
  """The facts of the train step that a choice of field `path` depends on."""
  return {
      "field": path, "input": list(input_shape), "model": config.model.name,
      "width": config.model.width, "method": config.method.name,
      "batch": config.train.batch_size,
      **({"eval_batch": config.train.eval_batch_size} if path == EVAL_FUSION else {}),
      # The options there are to choose from: a new one is measured on a machine again.
      **({"candidates": list(MEASURED_FUSIONS)} if path in (STEP_FUSION, EVAL_FUSION) else {}),
      **({"conv_impls": list(conv.IMPLS)} if path in CONV_FIELDS else {}),
      "method_fields": _method_fields(config),
      "mesh": [config.mesh.get("num_devices"), config.mesh.get("model")],
  }


def machine_key(config, input_shape, path: str) -> str:
  """What a choice depends on: the device (on a CPU backend, which CPU: its device kind is
  "cpu" on every host), the JAX version and XLA flags, the step's shapes."""
  dev = jax.devices()[0]
  backend = jax.default_backend()
  facts = dict(step_facts(config, input_shape, path), backend=backend,
               device=getattr(dev, "device_kind", str(dev)), devices=jax.device_count(),
               jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
               **({"cpu": host.cpu_name()} if backend == "cpu" else {}))
  return json.dumps(facts, sort_keys=True)


def default_cache_file() -> str:
  return os.path.join(images.default_cache_dir(), FILE)


def read(path: str | None) -> dict[str, Any]:
  """The choices stored in `path` (a missing or unreadable file holds none)."""
  if not path or not os.path.exists(path):
    return {}
  try:
    stored = io_utils.read_json(path)
    return stored if isinstance(stored, dict) else {}
  except (OSError, ValueError):
    logging.warning("ignoring the unreadable choices file %s", path)
    return {}


def remember(path: str, key: str, value) -> None:
  """Adds one choice to the file at `path` (read, merged and replaced atomically)."""
  try:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    stored = read(path)
    stored[key] = value
    io_utils.write_json_atomic(path, stored)
  except (OSError, io_utils.WorkdirWriteError) as e:
    # A read-only cache costs a measurement next time, nothing else.
    logging.warning("could not store the choice in %s: %s", path, e)


def _initial(steps, seed: int):
  """A population of one learner of `steps`' method, freshly initialised by the program that
  initialises a run's learners (`population.initial`): the run itself then finds it compiled
  (in this process, or in the persistent cache), where a program of the measurement's own
  would be compiled for it alone (4.2 s for P1's VGG on an H200)."""
  return population.initial(steps.method, population.keys([seed]))


def step_call(steps, seed: int = 0) -> tuple[Callable[[], Any], int]:
  """`timing.step_call` of `steps`' method, freshly initialised, on its real shapes."""
  return timing.step_call(steps.programs, _initial(steps, seed))


def time_train_steps(candidates: dict[Any, Any], seed: int = 0) -> dict[Any, float]:
  """Seconds per train step of each of `candidates` ({name: `steps.Steps`}: its method,
  freshly initialised, on its real shapes), timed in turns (`timing.alternate`)."""
  return time_in_turns({k: step_call(s, seed) for k, s in candidates.items()})


def time_evaluations(candidates: dict[Any, Any], seed: int = 0) -> dict[Any, float]:
  """Seconds per example of each of `candidates`' evaluation ({name: `steps.Steps`}: its
  method, freshly initialised), timed in turns (`timing.alternate`)."""
  return time_in_turns({k: timing.eval_call(s.programs, _initial(s, seed))
                        for k, s in candidates.items()})


def time_in_turns(calls: dict[Any, tuple[Callable[[], Any], int]]) -> dict[Any, float]:
  """Seconds per unit (step, example) of each of `calls` ({name: (call, units per call)}),
  timed in turns (`timing.alternate`, `ROUNDS` rounds of groups of at least `MIN_GROUP_S`)."""
  seconds = timing.alternate({k: call for k, (call, _) in calls.items()}, ROUNDS, MIN_GROUP_S)
  return {k: seconds[k] / units for k, (_, units) in calls.items()}


def choose(config, input_shape, build: Callable[[Any], Any], *, mode: str,
           workdir_file: str | None = None, cache_file: str | None = None,
           measure: Callable[[dict], dict] = time_train_steps,
           measure_eval: Callable[[dict], dict] = time_evaluations,
           given: dict[str, tuple[Any, str]] | None = None,
           deferred: list | None = None) -> dict[str, Any]:
  """Chooses a value for every field `config` leaves to be chosen.

  Args:
    config: the run's config.
    input_shape: one example's shape.
    build: config -> `steps.Steps` of the method that config makes (what is timed).
    mode: "measure" or "rules" (`config.train.autotune`).
    workdir_file: the run's own record of its choices (read first, then written).
    cache_file: this machine's record (default `default_cache_file()`).
    measure: {candidate: Steps} -> {candidate: seconds per train step}, timed in turns.
    measure_eval: {candidate: Steps} -> {candidate: seconds per example of the evaluation}.
    given: {field path: (value, how)} measured already (e.g. with the process's XLA flags,
      `cpu_fusion.measured_with_flags()`): used and remembered in place of a measurement.
    deferred: when given, the (key, value) entries for `workdir_file` are appended to it
      instead of written (a run writes them once the workdir turns out to be its own).

  Returns:
    {field path: value}, one entry per field that was left to be chosen.
  """
  cache_file = cache_file or default_cache_file()
  given = given or {}
  mine, machine = read(workdir_file), read(cache_file)
  short = short_accelerator_run(config)
  choices: dict[str, Any] = {}
  for tunable in pending(config):
    path = tunable.path
    key = machine_key(config, input_shape, path)
    if jax.process_count() > 1:  # processes must agree: none measures
      value, how = tunable.rule(config), "by rule (a run of several processes)"
    elif key in mine:
      value, how = mine[key], f"kept from {workdir_file}"
    elif path in given:
      value, how = given[path]
      remember(cache_file, key, value)
    elif mode == "rules" or not tunable.measured:
      value, how = tunable.rule(config), "by rule"
    elif key in machine:
      value, how = machine[key], f"measured earlier on this machine ({cache_file})"
    elif short is not None:
      value, how = tunable.rule(config), (
          f"by rule ({short:,} planned train steps on an accelerator < "
          f"{gpu_autotune.MIN_STEPS:,}: measuring would compile more than it can save)")
    else:
      timer = measure_eval if tunable.timed == "eval" else measure
      value, how, _ = measured_once(
          cache_file, key, path,
          lambda t=tunable, m=timer: _measure(config, t, build, m, choices))
    logging.info("%s: %r %s", path, value, how)
    choices[path] = value
    if workdir_file and jax.process_count() == 1 and tunable.measured:  # a rule decides again
      if deferred is not None:
        deferred.append((key, value))
      else:
        remember(workdir_file, key, value)
  return choices


def lock_file(cache_file: str, key: str) -> str:
  """The lock file under which one process at a time measures the choice `key` recorded in
  `cache_file` (beside it, in the cache folder's lock files)."""
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  return caches.lock_file(os.path.dirname(cache_file) or ".", f"autotune_{digest}")


def measured_once(cache_file: str, key: str, path: str,
                  measure_now: Callable[[], tuple[Any, str, bool]]) -> tuple[Any, str, bool]:
  """(value, how, whether it is a measurement) of the choice `key` of field `path`: measured by
  `measure_now` (-> the same triple) and remembered in `cache_file`, by one process of this
  machine at a time. Runs that start together (a sweep's parallel runs, an array job on one
  node) would otherwise each time the candidates while the others load the cores, and could
  choose differently for the same shapes; a run that finds the measurement under way waits
  for it and takes its answer. A rule's answer (a candidate failed) is not remembered, so
  the next process tries again."""
  def earlier(_warn: bool):
    stored = read(cache_file)
    return ((stored[key], f"measured earlier on this machine ({cache_file})", True)
            if key in stored else None)

  def now():
    value, how, measured = measure_now()
    if measured:
      remember(cache_file, key, value)
    return value, how, measured

  return caches.read_or_make(lock_file(cache_file, key), f"the measurement of {path}",
                             earlier, now)


def _measure(config, tunable: Tunable, build, measure, chosen: dict) -> tuple[Any, str, bool]:
  """(the fastest candidate, how it was chosen, True); (the rule, why, False) when a candidate
  fails."""
  others = {t.path: t.rule(config) for t in pending(config)}  # the rules, until chosen
  candidates = tunable.candidates(config)
  if len(candidates) == 1:
    return candidates[0], "by rule (the only candidate here)", False
  per_call = 1 if tunable.timed == "eval" else _get(config, "train.batch_size")
  built = {}
  for candidate in candidates:
    variant = with_choices(config, {**others, **chosen, tunable.path: candidate})
    try:
      built[candidate] = build(variant)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("%s=%r could not be timed (%s: %s); the rule decides", tunable.path,
                      candidate, type(e).__name__, e)
      return tunable.rule(config), "by rule (a candidate failed)", False
  try:
    times = {c: t / per_call for c, t in measure(built).items()}
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("%s's candidates %s could not be timed (%s: %s); the rule decides",
                    tunable.path, list(candidates), type(e).__name__, e)
    return tunable.rule(config), "by rule (a candidate failed)", False
  best = min(times, key=times.get)
  timed = ", ".join(f"{k!r} {_rate(config, v)}" for k, v in times.items())
  return best, f"measured ({timed})", True


def example_unit(config) -> tuple[str, int]:
  """(the unit a speed counts, units per example): tokens of data.seq_len per sequence
  for text, one image per example for images."""
  seq_len = (config.data.get("seq_len") if "text" in models.spec(config.model.name).tasks
             else None)
  return ("tokens", int(seq_len)) if seq_len else ("img", 1)


def _rate(config, seconds_per_example: float) -> str:
  """The speed of `seconds_per_example` in the unit of the config's examples: tokens/s for
  text (sequences of data.seq_len tokens), img/s for images."""
  unit, per_example = example_unit(config)
  return f"{per_example / seconds_per_example:,.0f} {unit}/s"
