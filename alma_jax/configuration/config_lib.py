"""The config's fields and the helpers of the experiment files in `configs/`.

`BASE_FIELDS` declares every field a run reads (path, default, check, doc);
methods and tasks declare their own (`alma_jax.configuration.plugins`). A config file calls
`base_config(dataset, method)` for the paper's defaults of the base fields
and the method's fields, overrides what its experiment changes, and passes
its argument string to `apply_variant`, the one parser of variants: named sets
of field values (each task's `VARIANTS`, and `PROTOCOL_VARIANTS`), e.g.
`smoke` (seconds, for tests), `quick` (minutes on a laptop CPU) and `paper` (the
paper's values, or the released code's where the paper is silent, of the fields
whose defaults are neither; `alma_jax/configuration/paper.py` sources them).

This module imports nothing heavy (no JAX), nor does `base_config`: the fields
of tasks and methods come from their declarations, so a config file's
`get_config()` builds its config without loading any model code.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from alma_jax.configuration import fields as F
from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError

DISTRIBUTED = ("auto", "yes", "no")
# JAX's PRNG keys hold 32 bits of a seed: larger seeds would repeat smaller ones.
MAX_SEED = 2**32 - 1
_MNIST_OR = lambda mnist, other: F.ByDataset({"mnist": mnist}, other)  # pylint: disable=invalid-name


def _optional_boolean(path: str, v):
  if v is not None and not isinstance(v, bool):
    raise ConfigError(f"config.{path}={v!r} must be true, false or None, got {type(v).__name__}")
  return v


BASE_FIELDS = (
    F.Field("seed", 0, F.integer(0, hi=MAX_SEED),
            "the random seed (stream, initialisation, data order)"),
    F.Field("num_seeds", 1, F.integer(1), "> 1: train seeds seed ... seed+num_seeds-1 as one "
            "vmapped program; each seed's outputs go to <workdir>/seed_<seed>/"),
    # -- data
    F.Field("data.name", "mnist", F.text("the name of a tfds data set"), "tfds data set name"),
    F.Field("data.data_dir", None, F.optional_path(),
            "prepared tfds data (None: $TFDS_DATA_DIR or tfds's default)", resumable=True),
    F.Field("data.cache_dir", None, F.optional_path(),
            "decoded-array cache (None: $ALMA_JAX_CACHE_DIR or ~/.cache/alma_jax)", resumable=True),
    F.Field("data.use_cache", True, F.boolean(), "keep decoded arrays as .npy files",
            resumable=True),
    F.Field("data.download", "auto", F.choice(F.owned("alma_jax.data.images:DOWNLOAD_CHOICES")),
            "may tfds download a data set that is not prepared locally: yes, no, or auto (when "
            "its download host answers)", resumable=True),
    F.Field("data.train_subset", 0, F.integer(0), "> 0: use only this many training examples"),
    F.Field("data.test_subset", 0, F.integer(0), "> 0: evaluate on only this many test examples"),
    # -- stream
    F.Field("stream.num_megabatches", _MNIST_OR(500, 100), F.integer(1), "B"),
    F.Field("stream.val_fraction", 0.1, F.number(0.0, 1.0, open_lo=True, open_hi=True),
            "fraction of each mega-batch kept as its validation set"),
    F.Field("stream.wait", 1, F.integer(1),
            "waiting time w: training at t = w, 2w, ..., B; must divide B"),
    F.Field("stream.replay", 0.0, F.number(0.0, 1.0),
            "fraction of all earlier mega-batches added to each stage"),
    F.Field("stream.warm_start", "finetune", F.choice(F.owned("alma_jax.policies:stage_names"), "names"),
            "how each stage starts (`alma_jax/policies/`): finetune (from the learner as the "
            "previous stage left it), scratch (re-initialised after the growth, which "
            "decides on the trained learner; gEns: its new members fresh) or shrink_perturb "
            "(stream.shrink * learnt + stream.perturb * fresh, after growth)"),
    F.Field("stream.init_from_scratch", None, F.Check(_optional_boolean, bool),
            "the older spelling of stream.warm_start: True selects scratch (None: follows "
            "stream.warm_start; a contradiction is an error)"),
    F.Field("stream.wait_policy", "fixed", F.choice(F.owned("alma_jax.policies:wait_names"), "names"),
            "when the learner trains (`alma_jax/policies/`): fixed (every stream.wait "
            "mega-batches), geometric (at ceil(w0 * r^k)) or triggered (when the new data's "
            "error or the unseen share calls for it; one seed per run)"),
    F.Field("model.name", _MNIST_OR("mlp", "vgg"), F.choice(F.owned("alma_jax.models:BACKBONES"), "names"),
            "backbone"),
    F.Field("model.width", 64, F.integer(1),
            "hidden units H (MLP), channels C (VGG) or channels of the first stage (ResNet)"),
    F.Field("model.conv_impl", "auto", F.choice(F.owned("alma_jax.models.conv:IMPLS")),
            "3x3 convolutions and their gradients in convolution-heavy backbones (VGG, "
            "ResNet): xla, chunked_dw, native_dw or native (the package's XLA:CPU kernels), "
            "or auto (chosen: see train.autotune)"),
    F.Field("model.init", "lecun", F.choice(F.owned("alma_jax.models.inits:INITS")),
            "initialisation: lecun (Flax: LeCun-normal kernels, zero biases) or torch (PyTorch's "
            "default, as in the released code: kernels and biases U(+-1/sqrt(fan_in)))"),
    # -- method (its own fields are declared by the method)
    F.Field("method.name", "sm", F.choice(F.owned("alma_jax.methods:names"), "names"), "the method"),
    # -- training
    F.Field("train.batch_size", 128, F.integer(1), "training batch size"),
    F.Field("train.eval_batch_size", 1000, F.integer(1), "evaluation batch size"),
    F.Field("train.epochs", 100, F.integer(1), "at most this many epochs per stage"),
    F.Field("train.patience", 25, F.integer(1),
            "stop a stage after this many epochs without a better validation accuracy"),
    F.Field("train.patience_delta", 0.0, F.number(0.0, 1.0, open_hi=True),
            "an epoch improves when its validation accuracy (a fraction) exceeds the best by "
            "more than this (released code: 0.001)"),
    F.Field("train.keep_optimizer_state", False, F.boolean(),
            "keep the optimizer state across stages (default: fresh each stage)"),
    F.Field("train.augment", _MNIST_OR("none", "crop_flip"), F.choice(F.owned("alma_jax.data.augment:AUGMENTATIONS")),
            "crop_flip (random crop with 4-pixel padding and flip, in the step) or none"),
    F.Field("train.steps_per_call", 0, F.integer(0),
            "train steps per compiled call (a lax.scan over them); 0: chosen (see "
            "train.autotune); speed only (a step's random draws do not depend on it; float "
            "round-off may)"),
    F.Field("train.stage_program", "auto", F.choice(("per_epoch", "whole", "auto")),
            "per_epoch (a compiled call per chunk of steps, an evaluation per epoch), whole (a "
            "stage's epochs, validation and early stopping as one compiled program; image "
            "tasks) or auto (whole on a CPU for a backbone that is not convolution-heavy and a "
            "method that does not grow); speed only (see alma_jax/engine/train.py)",
            resumable=True),
    F.Field("train.autotune", "measure", F.choice(F.owned("alma_jax.tuning.autotune:MODES")),
            "how fields left to be chosen (model.conv_impl='auto', method.strategy='auto', "
            "train.steps_per_call=0) are decided: measure (time each candidate on this "
            "machine once, remembered in the cache dir) or rules", resumable=True),
    F.Field("train.cpu_fusion", "auto", F.choice(F.owned("alma_jax.tuning.cpu_fusion:CHOICES")),
            "XLA:CPU fusion flags of the run's process: none (XLA's default), ynn (its dot, "
            "elementwise and reduction fusions by YNNPACK), onednn (convolutions and matrix "
            "products by oneDNN), ynn_onednn (both), or auto (a convolution-heavy backbone "
            "on a CPU: chosen by measurement with train.autotune=measure, see "
            "alma_jax/tuning/cpu_fusion.py; none otherwise); speed only, so it may change on resume "
            "(float round-off then differs from there on)", resumable=True),
    F.Field("train.step_fusion", "auto",
            F.choice(F.owned("alma_jax.engine.programs:FUSION_CHOICES")),
            "XLA:CPU options of the programs that train, on top of train.cpu_fusion's flags: "
            "same (none), no_ynn (no YNNPACK fusions), onednn (oneDNN's convolutions and dots), "
            "elemental (XLA's older elemental emitters in place of its MLIR fusion emitters), "
            "elemental_no_ynn (both elemental and no_ynn), "
            "or auto (on a CPU with train.autotune=measure, for a backbone that is not "
            "convolution-heavy: the fastest train step on this machine of same, no_ynn and "
            "onednn, see "
            "alma_jax/tuning/autotune.py; same otherwise); speed only (float round-off)",
            resumable=True),
    F.Field("train.eval_fusion", "auto",
            F.choice(F.owned("alma_jax.engine.programs:FUSION_CHOICES")),
            "XLA:CPU options of the evaluation programs (and of the passes that only evaluate), "
            "on top of train.cpu_fusion's flags: same, no_ynn, onednn, elemental, "
            "elemental_no_ynn as train.step_fusion, or "
            "auto (on a CPU with train.autotune=measure: the fastest evaluation on this machine "
            "of same, no_ynn and onednn; "
            "same otherwise); speed only (float round-off of the evaluation)", resumable=True),
    F.Field("train.gpu_autotune", "auto", F.choice(F.owned("alma_jax.tuning.gpu_autotune:CHOICES")),
            "XLA's GPU autotuning level (--xla_gpu_autotune_level: 0 off, 4 XLA's default) of "
            "the run's process on an accelerator: 0-4, or auto (0 for a run of fewer than 8,000 "
            "planned train steps, 4 otherwise; see alma_jax/tuning/gpu_autotune.py); an "
            "XLA_FLAGS that sets it wins; speed only", resumable=True),
    F.Field("train.gpu_threefry", "kernel",
            F.choice(F.owned("alma_jax.tuning.gpu_threefry:CHOICES")),
            "how a GPU computes the Threefry hash of the run's random draws: kernel (jaxlib's "
            "compiled kernel, one call per hash) or xla (XLA:GPU compiles the hash's operations "
            "into the program's fusions: the same bits, a much longer compile of programs that "
            "draw, such as an initialisation; see alma_jax/tuning/gpu_threefry.py); nothing "
            "changes on a CPU or a TPU; speed only", resumable=True),
    F.Field("train.cpu_allocator", "auto",
            F.choice(F.owned("alma_jax.tuning.cpu_tuning:CHOICES")),
            "glibc's allocator settings of the run's process: tuned (freed memory kept in the "
            "process, one arena: faster convolution steps on XLA:CPU), glibc (its defaults: "
            "faster compilation and small steps), or auto (tuned for a convolution-heavy "
            "backbone on a CPU, glibc otherwise; see alma_jax/tuning/cpu_tuning.py); "
            "ALMA_JAX_MALLOC_TUNING=0 means glibc; speed only", resumable=True),
    F.Field("train.compute_dtype", "float32", F.choice(("float32", "bfloat16")),
            "arithmetic of the train and evaluation programs: float32, or bfloat16 (mixed "
            "precision: float32 parameters, optimizer and model state; for GPUs and TPUs, no "
            "faster on XLA:CPU; see alma_jax/engine/precision.py)"),
    F.Field("train.on_divergence", "raise", F.choice(("raise", "rollback")),
            "a non-finite loss raises, or rolls the stage back to its best epoch (may change "
            "when a run resumes: it does not change the records already written)",
            resumable=True),
    F.Field("train.progress_every_s", 10.0, F.number(0.0, math.inf, allow_inf=True),
            "at most one progress line per this many seconds within a stage", resumable=True),
    # -- optimizer
    F.Field("optimizer.name", _MNIST_OR("adadelta", "sgd"), F.choice(F.owned("alma_jax.engine.optim:OPTIMIZERS"), "names"),
            "an optax optimizer by name"),
    F.Field("optimizer.kwargs",
            _MNIST_OR({"learning_rate": 1.0},
                      {"learning_rate": 0.01, "momentum": 0.9, "nesterov": False}),
            F.mapping(), "the optimizer's arguments (CIFAR: nesterov=True for the released "
            "code's gMoE and Firefly)"),
    F.Field("optimizer.weight_decay", _MNIST_OR(0.0, 1e-4), F.number(0.0, math.inf),
            "PyTorch-style coupled weight decay"),
    # -- devices and checkpoints
    F.Field("mesh.num_devices", 0, F.integer(0),
            "devices of the mesh (0: all, or config.mesh.data x config.mesh.model); a "
            "multi-process run uses all"),
    F.Field("mesh.data", 0, F.integer(0),
            "size of the mesh's data axis, over which batches are split (0: the devices left "
            "by config.mesh.model)"),
    F.Field("mesh.model", 1, F.integer(1),
            "size of the mesh's model axis, over which ensemble members and gMoE experts are "
            "split"),
    F.Field("mesh.rules", {"population": "replicated", "batch": "data", "member": "model",
                           "expert": "model"},
            F.mapping(),
            "logical axis (population, batch, member, expert) -> mesh axis (data, model) or "
            "replicated; a dimension that does not divide its axis is replicated, with a "
            "warning"),
    F.Field("mesh.distributed", "auto", F.choice(DISTRIBUTED),
            "call jax.distributed.initialize(): yes, no, or auto (when the cluster environment "
            "asks: SLURM with several tasks, a multi-host TPU VM, or ALMA_JAX_DISTRIBUTED=1)",
            resumable=True),
    F.Field("checkpoint.enabled", True, F.boolean(), "write checkpoints", resumable=True),
    F.Field("checkpoint.max_to_keep", 3, F.integer(1), "keep the last few checkpoints",
            resumable=True),
    F.Field("log.wandb", "", F.optional_text("a Weights & Biases project name, or '' (off)"),
            "log to Weights & Biases (pip install wandb): the project name; each seed is one "
            "W&B run, resumed with the run; '' turns it off",
            resumable=True),
    F.Field("log.progress", "full", F.choice(("off", "stage", "full"), "levels"),
            "progress lines: full (compile lines, running lines with speed and ETAs, a "
            "heartbeat), stage (a line per training stage), or off", resumable=True),
    F.Field("log.plasticity", False, F.boolean(),
            "add plasticity diagnostics to every record (alma_jax.engine.plasticity): the "
            "parameters' norm and distance from the run's initial ones and, for a method with "
            "hidden units (sm, ens, umix, gens or ff on mlp or vgg), the fraction of dormant "
            "units per "
            "layer and the effective rank of the last hidden layer's features on a fixed probe "
            "set"),
    F.Field("log.dormant_threshold", 0.025, F.number(0.0, 1.0),
            "log.plasticity: a unit is dormant when its activity over its layer's mean is at "
            "most this (ReDo's tau; 0: dead units alone)"),
    F.Field("log.plasticity_probe", 512, F.integer(1),
            "log.plasticity: the probe set, the first this many examples of the training "
            "split (unaugmented; the same for every time step and seed)"),
    F.Field("log.tensorboard", True, F.boolean(),
            "write TensorBoard event files (per time step and per epoch) into the workdir",
            resumable=True),
    F.Field("log.error_png", True, F.boolean(),
            "draw error.png (the test error over t) into the workdir when the run ends, in a "
            "child process that imports matplotlib while the run goes on; off for large "
            "sweeps, whose figures the report draws", resumable=True),
    F.Field("checkpoint.every", 1, F.integer(1),
            "checkpoint after every this many training stages (and at t=0 and t=B)",
            resumable=True),
    F.Field("checkpoint.every_s", 300.0, F.number(0.0, allow_inf=True),
            "inside a training stage, save its progress every this many seconds (0: off); a "
            "signal (SIGTERM, SIGINT, SIGHUP) also saves it before the run stops",
            resumable=True),
    F.Field("checkpoint.stage_every_epochs", 0, F.integer(0),
            "inside a training stage, save its progress after every this many epochs (0: off)",
            resumable=True),
)

BASE_FIELDS_BY_PATH = {f.path: f for f in BASE_FIELDS}


def base_fields() -> tuple[F.Field, ...]:
  """The fields every config has: `BASE_FIELDS` and those of every policy (each policy
  declares its own, `alma_jax.configuration.plugins.policies`)."""
  return BASE_FIELDS + plugins.policy_fields()


F.declare(BASE_FIELDS)
# Fields declared after runs were written: a resolved config that lacks one (a workdir's
# config.json) ran as its default does, so absent and default are the same run.
ADDED_FIELDS = ("stream.warm_start", "stream.wait_policy", "stream.shrink", "stream.perturb",
                "stream.geometric_w0", "stream.geometric_ratio", "stream.trigger_margin",
                "stream.trigger_fraction", "stream.trigger_min_wait", "stream.trigger_max_wait",
                "stream.redo_threshold", "stream.cbp_fraction", "stream.cbp_maturity",
                "train.l2_init", "log.plasticity", "log.dormant_threshold",
                "log.plasticity_probe", "method.min_slots", "log.error_png")
# Fields declared after runs were written whose default is not how those runs ran: a config
# that lacks one ran with the value given here.
ADDED_WITH_OLD_VALUE = {
    "model.scan_layers": False,  # the Switch Transformer's blocks unrolled
    "method.slots": "exact",  # the Switch Transformer's experts without padding slots
}


def resumable_paths() -> tuple[str, ...]:
  """Fields that may differ when a run is resumed (they do not change results)."""
  return tuple(f.path for f in BASE_FIELDS if f.resumable)


def seed_config(config, seed: int):
  """The config (or options) of a separate run of `seed` (what its seed directory records)."""
  if not isinstance(config, ml_collections.ConfigDict):  # options (frozen dataclasses)
    return dataclasses.replace(config, seed=seed, num_seeds=1)
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.seed = seed
    c.num_seeds = 1
  return c


def stage_steps(config) -> int:
  """Train steps of a stage when its epochs have a fixed length (0: they do not)."""
  return int(config.train.epochs) * int(F.get(config.train, "train.steps_per_epoch"))


# Planned train steps below which a run on an accelerator is short: better off without what
# buys faster steps with compile time (XLA's GPU autotuning, `alma_jax.tuning.gpu_autotune`;
# gMoE's growth in one slot structure, `method.slots`).
SHORT_RUN_STEPS = 8000
# Training examples of the data sets whose size is known before they are loaded.
TRAIN_SIZES = {"mnist": 60000, "fashion_mnist": 60000, "kmnist": 60000, "cifar10": 50000,
               "cifar100": 50000}


def planned_steps(config) -> int | None:
  """An upper bound on the run's train steps from its config alone (every stage running all
  its epochs); None when the size of its data is not known before loading it."""
  epochs = int(config.train.epochs)
  b = int(config.stream.num_megabatches)
  wait = int(config.stream.wait) if F.get(config.stream, "stream.wait_policy") == "fixed" else 1
  stages = math.ceil(b / wait)
  fixed = stage_steps(config)
  if fixed:  # text: a fixed number of steps per epoch
    return stages * fixed
  n = int(F.get(config.data, "data.train_subset")) or TRAIN_SIZES.get(config.data.name)
  if not n:
    return None
  batch, replay = int(config.train.batch_size), float(config.stream.replay)
  total = 0
  for s in range(1, stages + 1):
    seen = n * min(b, s * wait) / b
    new = n * min(wait, b - (s - 1) * wait) / b
    total += epochs * math.ceil((new + replay * (seen - new)) / batch)
  return total


def short_run_steps(config) -> int | None:
  """The run's planned train steps (`planned_steps`) when they are fewer than
  `SHORT_RUN_STEPS`; None for a longer run or data of unknown size."""
  steps = planned_steps(config)
  return steps if steps is not None and steps < SHORT_RUN_STEPS else None


def base_config(dataset: str, method: str = "sm") -> ml_collections.ConfigDict:
  """The paper's settings (Appendix B) for `dataset` (MNIST: MLP; others: VGG) and `method`,
  with the fields and settings of the task of `dataset` (`alma_jax.tasks`)."""
  c = F.fill(ml_collections.ConfigDict(), base_fields(), dataset)
  c.data.name = dataset
  c.method.name = method
  # The task and the method declare fields of their own (`alma_jax.configuration.plugins`).
  task = plugins.task(c)  # e.g. text: the language-model setting (section 5, App. B.2)
  F.fill(c, task.FIELDS, dataset)
  task.defaults(c)
  return F.fill(c, plugins.method_fields(c), dataset)


# -- variants: named sets of field values, chosen after the colon of --config -----------------
KEEP = F.KEEP  # a variant's value that leaves the field as it is for this data set
# Variants applied before the others, wherever they are named: `paper` sets what the paper
# fixes, and a variant named with it (quick, smoke) keeps every field it sets (its reductions of
# the stream, the width, the epochs and the patience), so "quick,paper" == "paper,quick".
FIRST_VARIANTS = ("paper",)

# A timing protocol (`protocol`): smoke is a tiny slice of the data, for tests of its files.
PROTOCOL_VARIANTS = {
    "smoke": {"data.train_subset": 1000, "data.test_subset": 500, "train.epochs": 1,
              "train.patience": 1},
}


def _set(c: ml_collections.ConfigDict, path: str, value) -> None:
  *parents, leaf = path.split(".")
  node = c
  for p in parents:
    node = node[p]
  node[leaf] = value


def variant_names(arg: str | None) -> list[str]:
  """The variants named in `arg` ("quick,paper" -> ["quick", "paper"]), in the order given."""
  return [p.strip() for p in (arg or "").split(",") if p.strip()]


def variant_value(c: ml_collections.ConfigDict, value):
  """A variant's `value` for `c`: a `ByDataset` taken by `c.data.name`, a `ByMethod` by
  `c.method.name` (nested either way), anything else as it is (`KEEP` included)."""
  while isinstance(value, (F.ByDataset, F.ByMethod)):
    value = value.get(c.data.name if isinstance(value, F.ByDataset) else c.method.name)
  return value


def apply_variant(c: ml_collections.ConfigDict, arg: str | None,
                  table: dict | None = None) -> ml_collections.ConfigDict:
  """Applies the comma-separated variants `arg` (e.g. "quick" or "quick,iid") to `c`.

  The variants of `FIRST_VARIANTS` (`paper`) come first, the others follow in the order given,
  so a later one wins a field that two set: "quick,paper" and "paper,quick" are the same config,
  quick's reductions kept and every other field the paper fixes set to the paper's value.

  Args:
    c: a config from `base_config`.
    arg: the variants; "" or None: none (the defaults).
    table: variant name -> {field path: value}; by default the variants of `c`'s task
      (`VARIANTS` of its declaration, `alma_jax.configuration.plugins.tasks`). A value may
      be a `ByDataset` (by `c.data.name`), a `ByMethod` (by `c.method.name`) and `KEEP`.

  Raises:
    ValueError: an unknown variant, naming the valid ones, or one named twice.
  """
  scaled = None
  if table is None:
    task = plugins.task(c)
    table, scaled = task.VARIANTS or plugins.tasks.IMAGE_VARIANTS, task.SCALED_STEPS
  parts = variant_names(arg)
  steps_factor = 1
  for p in parts:
    if scaled is not None and scaled.fullmatch(p):
      steps_factor *= int(p[:-1])
    elif p not in table:
      valid = list(table) + (["'Kx' with K a positive integer such as '2x'"] if scaled else [])
      raise ValueError(f"config variant {p!r} is unknown; valid: {valid} (comma-separated)")
  repeated = sorted({p for p in parts if parts.count(p) > 1})
  if repeated:
    raise ValueError(f"config variant {repeated[0]!r} is named more than once in {arg!r}; "
                     "name each variant once")
  parts = sorted(parts, key=lambda p: p not in FIRST_VARIANTS)  # stable: the rest keep order
  for p in parts:
    for path, value in table.get(p, {}).items():
      value = variant_value(c, value)
      if value is not KEEP:
        _set(c, path, value)
  if steps_factor != 1:
    c.train.steps_per_epoch *= steps_factor
  return c


def protocol(c: ml_collections.ConfigDict, arg: str | None, *, num_megabatches: int, width: int,
             epochs: int) -> ml_collections.ConfigDict:
  """A fixed timing protocol: B mega-batches, w=1, no replay, exactly `epochs` per stage.

  `arg` may be `smoke` (`PROTOCOL_VARIANTS`: a tiny slice of the data, for tests of the
  protocol files).
  """
  c.stream.num_megabatches = num_megabatches
  c.stream.wait = 1
  c.stream.replay = 0.0
  c.model.width = width
  c.train.epochs = epochs
  c.train.patience = epochs  # no early stopping within the fixed epochs
  return apply_variant(c, arg, PROTOCOL_VARIANTS)
