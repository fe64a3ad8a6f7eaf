"""Bad inputs give one clear error naming the field, and lose nothing (alma_jax/stream/validation.py)."""

import glob
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

import alma_jax
from alma_jax import errors
from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.configuration.plugins import methods as declared_methods
from alma_jax.data import text as text_data
from alma_jax.errors import ConfigError, DivergenceError
from alma_jax.outputs import checkpoint
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as workdir_lib
from alma_jax.outputs import workdir_lock
from alma_jax.stream import config_resolve
from alma_jax.stream import run
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT




# (case id, {field__path: bad value}, expected message regex). All names the field.
CONFIG_CASES = [
    ("vgg_on_28x28_images", {"model__name": "vgg"},
     r"^config\.model\.name='vgg' needs images whose height and width are multiples of 32; "
     r"config\.data\.name='mnist' has 28x28 images; valid names for them: \['mlp', 'resnet'\]$"),
    ("wait_not_divisor", {"stream__num_megabatches": 10, "stream__wait": 3},
     r"^config\.stream\.wait=3 does not divide config\.stream\.num_megabatches=10; "
     r"allowed values: \[1, 2, 5, 10\]$"),
    ("wait_zero", {"stream__wait": 0}, r"config\.stream\.wait=0 must be >= 1"),
    ("wait_float", {"stream__wait": 2.0}, r"config\.stream\.wait=2\.0 must be an integer"),
    ("num_megabatches_zero", {"stream__num_megabatches": 0},
     r"config\.stream\.num_megabatches=0 must be >= 1"),
    ("replay_above_one", {"stream__replay": 1.5}, r"config\.stream\.replay=1\.5 must be in \[0\.0, 1\.0\]"),
    ("replay_negative", {"stream__replay": -0.1}, r"config\.stream\.replay=-0\.1 must be in"),
    ("replay_string", {"stream__replay": "half"}, r"config\.stream\.replay='half' must be a number"),
    ("val_fraction_zero", {"stream__val_fraction": 0.0},
     r"config\.stream\.val_fraction=0\.0 must be in \(0\.0, 1\.0\)"),
    ("val_fraction_one", {"stream__val_fraction": 1.0}, r"config\.stream\.val_fraction=1\.0 must be in"),
    ("val_fraction_nan", {"stream__val_fraction": float("nan")}, r"config\.stream\.val_fraction=nan"),
    ("width_zero", {"model__width": 0}, r"config\.model\.width=0 must be >= 1"),
    ("unknown_backbone", {"model__name": "densenet"},
     r"config\.model\.name='densenet' is unknown; valid names: \['mlp', 'resnet', 'switch', "
     r"'vgg'\]"),
    ("backbone_of_another_task", {"model__name": "switch"},
     r"^config\.model\.name='switch' cannot model images; valid values: \['mlp', 'resnet', "
     r"'vgg'\]$"),
    ("lm_name_on_images", {"method__name": "lm_sm"},
     r"^config\.method\.name='lm_sm' is sm on text, but config\.data\.name='mnist' is images "
     r"data; use config\.method\.name='sm'$"),
    ("unknown_method", {"method__name": "boosting"},
     r"config\.method\.name='boosting' is unknown; valid names: \[.*'sm'.*\]"),
    ("num_members_zero", {"method__name": "ens", "method__num_members": 0},
     r"config\.method\.num_members=0 must be >= 1"),
    ("epochs_zero", {"train__epochs": 0}, r"config\.train\.epochs=0 must be >= 1"),
    ("epochs_float", {"train__epochs": 2.5}, r"config\.train\.epochs=2\.5 must be an integer"),
    ("patience_zero", {"train__patience": 0}, r"config\.train\.patience=0 must be >= 1"),
    ("batch_size_zero", {"train__batch_size": 0}, r"config\.train\.batch_size=0 must be >= 1"),
    ("eval_batch_size_neg", {"train__eval_batch_size": -1},
     r"config\.train\.eval_batch_size=-1 must be >= 1"),
    ("steps_per_call_negative", {"train__steps_per_call": -1},
     r"config\.train\.steps_per_call=-1 must be >= 0"),
    ("autotune_unknown", {"train__autotune": "always"},
     r"config\.train\.autotune='always' is unknown; valid values: \['measure', 'rules'\]"),
    ("seed_string", {"seed": "0"}, r"config\.seed='0' must be an integer, got str"),
    ("seed_bool", {"seed": True}, r"config\.seed=True must be an integer, got bool"),
    ("seed_negative", {"seed": -1}, r"^config\.seed=-1 must be in \[0, 4294967295\]$"),
    ("seed_huge", {"seed": 2**70}, r"^config\.seed=1180591620717411303424 must be in \[0, "),
    ("seeds_beyond_the_last", {"seed": 2**32 - 2, "num_seeds": 3},
     r"^config\.seed=4294967294 with config\.num_seeds=3 reaches seed 4294967296; seeds must be "
     r"in \[0, 4294967295\]$"),
    ("num_seeds_zero", {"num_seeds": 0}, r"config\.num_seeds=0 must be >= 1"),
    ("num_seeds_with_gmoe", {"num_seeds": 2, "method__name": "gmoe"},
     r"config\.num_seeds=2 needs a method whose growth is the same for every seed; "
     r"config\.method\.name='gmoe' is not one; valid names: \['ens', 'gens', 'lm_ens', 'lm_gens', 'lm_sm', 'sm', 'umix'\]"),
    ("on_divergence", {"train__on_divergence": "ignore"},
     r"config\.train\.on_divergence='ignore' is unknown; valid values: \['raise', 'rollback'\]"),
    ("augment", {"train__augment": "mixup"},
     r"config\.train\.augment='mixup' is unknown; valid values: \['crop_flip', 'none'\]"),
    ("keep_optimizer_state", {"train__keep_optimizer_state": "yes"},
     r"config\.train\.keep_optimizer_state='yes' must be true or false"),
    ("progress_negative", {"train__progress_every_s": -1.0},
     r"config\.train\.progress_every_s=-1\.0 must be in"),
    ("max_to_keep_zero", {"checkpoint__max_to_keep": 0},
     r"config\.checkpoint\.max_to_keep=0 must be >= 1"),
    ("checkpoint_every_zero", {"checkpoint__every": 0}, r"config\.checkpoint\.every=0 must be >= 1"),
    ("num_devices_negative", {"mesh__num_devices": -1}, r"config\.mesh\.num_devices=-1 must be >= 0"),
    ("num_devices_too_many", {"mesh__num_devices": 4096},
     r"config\.mesh\.num_devices=4096 but only \d+ cpu devices are visible"),
    ("mesh_model_does_not_divide", {"mesh__model": 2},
     r"config\.mesh\.model=2 does not divide the 1 devices of the mesh; allowed values: \[1\]"),
    ("mesh_data_times_model", {"mesh__num_devices": 0, "mesh__data": 3, "mesh__model": 3},
     r"config\.mesh\.num_devices=9 \(config\.mesh\.data=3 x config\.mesh\.model=3\) but only 8 "
     r"devices are visible"),
    ("mesh_rules_axis", {"mesh__rules": {"population": "seeds"}},
     r"config\.mesh\.rules\.population='seeds' is unknown; valid values: "
     r"\['data', 'model', 'replicated'\]"),
    ("mesh_rules_name", {"mesh__rules": {"members": "model"}},
     r"config\.mesh\.rules\.members is unknown; valid logical axes"),
    ("distributed", {"mesh__distributed": "maybe"},
     r"config\.mesh\.distributed='maybe' is unknown; valid values: \['auto', 'no', 'yes'\]"),
    ("train_subset_negative", {"data__train_subset": -5},
     r"config\.data\.train_subset=-5 must be >= 0"),
    ("test_subset_negative", {"data__test_subset": -1}, r"config\.data\.test_subset=-1 must be >= 0"),
    ("unknown_dataset", {"data__name": "imagenet"},
     r"config\.data\.name='imagenet' is not available offline: no prepared tfds copy in "
     r".*imagenet and no decoded copy in .* data sets prepared in .*: \[.*\]; "
     r"set TFDS_DATA_DIR .* or set config\.data\.download=yes"),
    ("dataset_name_empty", {"data__name": ""}, r"config\.data\.name='' must be the name of a tfds"),
    ("download_unknown", {"data__download": "maybe"},
     r"config\.data\.download='maybe' is unknown; valid values: \['auto', 'no', 'yes'\]"),
    ("unknown_optimizer", {"optimizer__name": "sgdd"},
     r"config\.optimizer\.name='sgdd' is unknown; valid names: \[.*'adadelta'.*\]"),
    ("optimizer_kwargs", {"optimizer__kwargs": {"lr": 0.1}},
     r"config\.optimizer.*\['lr'\].*optax\.adadelta does not take"),
    ("learning_rate_string", {"optimizer__kwargs": {"learning_rate": "fast"}},
     r"^config\.optimizer\.kwargs\.learning_rate='fast' must be a number in \(0\.0, inf\), "
     r"got str$"),
    ("learning_rate_negative", {"optimizer__kwargs": {"learning_rate": -0.1}},
     r"^config\.optimizer\.kwargs\.learning_rate=-0\.1 must be in \(0\.0, inf\)$"),
    ("learning_rate_zero", {"optimizer__kwargs": {"learning_rate": 0.0}},
     r"^config\.optimizer\.kwargs\.learning_rate=0\.0 must be in \(0\.0, inf\)$"),
    ("learning_rate_infinite", {"optimizer__kwargs": {"learning_rate": float("inf")}},
     r"^config\.optimizer\.kwargs\.learning_rate=inf must be in \(0\.0, inf\)$"),
    ("learning_rate_none", {"optimizer__kwargs": {"learning_rate": None}},
     r"^config\.optimizer\.kwargs\.learning_rate=None must be a number"),
    # optax.adadelta without a learning rate (None) updates up the gradient; optax.sgd
    # without one does not build.
    ("learning_rate_missing", {"optimizer__kwargs": {}},
     r"^config\.optimizer\.kwargs has no learning_rate: give the learning rate of "
     r"optax\.adadelta, e\.g\. --config\.optimizer\.kwargs\.learning_rate=0\.01 \(a number > 0\)$"),
    ("learning_rate_missing_sgd",
     {"optimizer__name": "sgd", "optimizer__kwargs": {"momentum": 0.9}},
     r"^config\.optimizer\.kwargs has no learning_rate: give the learning rate of optax\.sgd, "),
    ("weight_decay_negative", {"optimizer__weight_decay": -1.0},
     r"config\.optimizer\.weight_decay=-1\.0 must be in"),
]




@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A completed MNIST smoke run (its workdir is copied, never changed)."""
  wd = str(tmp_path_factory.mktemp("finished"))
  c = helpers.smoke()
  summary = run.run(c, wd)
  return wd, c, summary


def _copy(src, tmp_path):
  dst = str(tmp_path / "wd")
  shutil.copytree(src, dst)
  return dst


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_fields(case, tmp_path):
  _, fields, pattern = case
  wd = str(tmp_path / "wd")
  os.makedirs(wd)
  with open(os.path.join(wd, "notes.txt"), "w") as f:
    f.write("kept")
  before = helpers.tree_digest(wd)
  with pytest.raises(ValueError, match=pattern) as info:  # ConfigError or DatasetUnavailableError
    run.run(helpers.smoke(**fields), wd, overwrite=True)
  assert "\n" not in errors.one_line(info.value)
  assert errors.exit_code(info.value) == 2
  assert helpers.tree_digest(wd) == before  # nothing written, nothing removed


def test_the_input_shape_read_from_the_data_is_checked_too():
  # A data set whose shape is known only once it loads (not in KNOWN_SHAPES): the set-up
  # checks the shape it read with the same function.
  c = config_lib.apply_variant(config_lib.base_config("cifar10", "sm"), "smoke")
  for shape in ((32, 32, 3), (64, 96, 1), (28, 28)):
    validation.check_input_shape(c, shape)
  with pytest.raises(ConfigError, match=r"^config\.model\.name='vgg' needs images whose height "
                                        r"and width are multiples of 32; config\.data\.name="
                                        r"'cifar10' has 48x40 images; valid names for them: "
                                        r"\['mlp', 'resnet'\]$"):
    validation.check_input_shape(c, (48, 40, 3))


@requires_mnist
def test_a_run_checks_the_input_shape_it_loads(monkeypatch, tmp_path):
  # MNIST as a data set whose shape is not known before it loads.
  monkeypatch.delitem(validation.KNOWN_SHAPES, "mnist")
  with pytest.raises(ConfigError, match=r"^config\.model\.name='vgg' needs images whose height "
                                        r"and width are multiples of 32; config\.data\.name="
                                        r"'mnist' has 28x28 images"):
    run.run(helpers.smoke(model__name="vgg"), str(tmp_path / "wd"))


def test_at_least_thirty_distinct_bad_inputs():
  assert len({c[0] for c in CONFIG_CASES}) >= 30


def test_valid_configs_pass():
  for arg in ("", "smoke", "quick"):
    for name in ("mnist", "cifar10"):
      c = config_lib.apply_variant(config_lib.base_config(name), arg)
      c.data.download = "yes"  # the data need not be here
      validation.validate(c)


# -- the optimizer's arguments --------------------------------------------------------------------
@pytest.mark.parametrize("name, kwargs, pattern", [
    ("adam", {"b1": float("nan")}, r"config\.optimizer\.kwargs\.b1=nan must be in \[0\.0, 1\.0\)"),
    ("adam", {"b2": 1.0}, r"config\.optimizer\.kwargs\.b2=1\.0 must be in \[0\.0, 1\.0\)"),
    ("lion", {"b1": -0.1}, r"config\.optimizer\.kwargs\.b1=-0\.1 must be in \[0\.0, 1\.0\)"),
    ("adamw", {"eps": -1e-8}, r"config\.optimizer\.kwargs\.eps=-1e-08 must be in \[0\.0, inf\)"),
    ("adam", {"eps_root": float("inf")},
     r"config\.optimizer\.kwargs\.eps_root=inf must be in \[0\.0, inf\)"),
    ("adadelta", {"rho": 1.5}, r"config\.optimizer\.kwargs\.rho=1\.5 must be in \[0\.0, 1\.0\]"),
    ("rmsprop", {"decay": -0.5},
     r"config\.optimizer\.kwargs\.decay=-0\.5 must be in \[0\.0, 1\.0\]"),
    ("sgd", {"momentum": 1.1},
     r"config\.optimizer\.kwargs\.momentum=1\.1 must be None or in \[0\.0, 1\.0\]"),
    ("sgd", {"momentum": "high"},
     r"config\.optimizer\.kwargs\.momentum='high' must be None or a number in \[0\.0, 1\.0\], "
     r"got str"),
    ("sgd", {"nesterov": "yes"},
     r"config\.optimizer\.kwargs\.nesterov='yes' must be true or false, got str"),
    ("rmsprop", {"centered": 1},
     r"config\.optimizer\.kwargs\.centered=1 must be true or false, got int"),
    ("adamw", {"weight_decay": -1e-4},
     r"config\.optimizer\.kwargs\.weight_decay=-0\.0001 must be in \[0\.0, inf\)"),
    ("adagrad", {"initial_accumulator_value": -0.1},
     r"config\.optimizer\.kwargs\.initial_accumulator_value=-0\.1 must be in \[0\.0, inf\)"),
])
def test_the_optimizer_s_arguments_are_checked_by_name(name, kwargs, pattern):
  # Optax builds these optimizers with any of these values: Adam's first update is NaN with
  # b1=nan or b2=1.0 (the run is then reported as a divergence), and an SGD momentum above 1
  # makes the steps grow without bound.
  c = helpers.smoke(optimizer__name=name, optimizer__kwargs={"learning_rate": 0.1, **kwargs})
  with pytest.raises(ConfigError, match=rf"^{pattern}$"):
    validation.validate(c, backend=False, data=False)


def test_the_optimizer_s_arguments_at_their_bounds_and_its_defaults_pass():
  for name, kwargs in [("adam", {"b1": 0.0, "b2": 0.0, "eps": 0.0, "eps_root": 0.0}),
                       ("sgd", {"momentum": None, "nesterov": False}),
                       ("sgd", {"momentum": 1.0, "nesterov": True}),
                       ("adadelta", {"rho": 1.0}), ("rmsprop", {"decay": 0.0, "centered": True}),
                       ("adamw", {"weight_decay": 0.0}),
                       ("adagrad", {"initial_accumulator_value": 0.0})]:
    c = helpers.smoke(optimizer__name=name, optimizer__kwargs={"learning_rate": 0.1, **kwargs})
    validation.validate(c, backend=False, data=False)


def test_every_optimizer_built_without_a_learning_rate_is_refused():
  # Not only in validation: any code that builds the optimizer (a report's gating plot, a
  # speed-setting child) gets the same refusal, never Adadelta's step up the gradient.
  from alma_jax.engine import optim  # pylint: disable=g-import-not-at-top
  for name in ("adadelta", "sgd", "adam"):
    c = helpers.smoke(optimizer__name=name, optimizer__kwargs={})
    with pytest.raises(ConfigError, match=rf"^config\.optimizer\.kwargs has no learning_rate: "
                                          rf"give the learning rate of optax\.{name}, "):
      optim.make_optimizer(c.optimizer)


def test_an_optimizer_argument_on_the_command_line_is_checked_in_its_words():
  lm = os.path.join(ROOT, "configs", "lm_sm.py:smoke")  # Adam with b1, b2 and eps
  c = config_resolve.resolve(lm, ["--config.optimizer.kwargs.b2=1.0"])
  with pytest.raises(ConfigError, match=r"^config\.optimizer\.kwargs\.b2=1\.0 must be in "
                                        r"\[0\.0, 1\.0\)$"):
    validation.validate(c, backend=False, data=False)
  with pytest.raises(config_resolve.ConfigResolveError,
                     match=r"config\.optimizer\.kwargs\.b1='high' must be a number in "
                           r"\[0\.0, 1\.0\), got str"):
    config_resolve.resolve(lm, ["--config.optimizer.kwargs.b1=high"])


@pytest.mark.parametrize("path", sorted(
    glob.glob(os.path.join(ROOT, "configs", "*.py"))
    + glob.glob(os.path.join(ROOT, "configs", "bench", "*.py"))),
    ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "configs")))
def test_every_config_file_and_variant_validates_and_builds_its_method(path):
  # The end-to-end runs cover one config per method and data set; this covers every file.
  name = os.path.basename(path)
  variants = (("", "smoke", "quick", "base", "large", "quick,iid", "smoke,2x")
              if name.startswith("lm_") else ("",) if "/bench/" in path
              else ("", "smoke", "quick"))
  for variant in variants:
    c = config_resolve.resolve(f"{path}:{variant}" if variant else path)
    c.data.download = "yes"  # the data need not be here
    c = validation.validate(c)
    if c.data.name in validation.KNOWN_SHAPES:
      methods.make(c, *validation.KNOWN_SHAPES[c.data.name])
    else:
      methods.make(c, (c.data.seq_len,), text_data.VOCAB_SIZE)


_BACKEND_PROBE = """
import glob, os, sys
from jax._src import xla_bridge
from alma_jax.stream import config_resolve, validation
paths = sorted(glob.glob("configs/*.py") + glob.glob("configs/bench/*.py"))
for path in paths:
  c = config_resolve.resolve(path)
  c.data.download = "yes"  # the data need not be here
  validation.validate(c, backend=False)
  if xla_bridge.backends_are_initialized():
    sys.exit(f"validating {path} started the backend")
print("checked", len(paths))
"""


def test_validation_without_the_backend_does_not_start_it():
  # A process checks its config this way before it sets the XLA flags that the backend reads
  # when it starts (alma_jax.main); the backend must still be free to start with them after.
  proc = subprocess.run([sys.executable, "-c", _BACKEND_PROBE], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, check=False,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert int(proc.stdout.split()[-1]) >= 18, proc.stdout


# -- inputs that need the data or a workdir ------------------------------------------------------
@requires_mnist
@pytest.mark.parametrize("fields, pattern", [
    ({"data__train_subset": 10, "stream__num_megabatches": 20},
     r"config\.stream\.num_megabatches=20 exceeds the 10 training examples"),
    ({"data__train_subset": 12, "stream__num_megabatches": 12},
     r"config\.stream\.num_megabatches=12 leaves a mega-batch with \d+ training and \d+ validation"),
], ids=["more_megabatches_than_examples", "empty_megabatches"])
def test_data_dependent_fields(fields, pattern, tmp_path):
  wd = str(tmp_path / "wd")
  with pytest.raises(ValueError, match=pattern) as info:
    run.run(helpers.smoke(**fields), wd)
  assert errors.exit_code(info.value) == 2
  assert os.listdir(wd) == []  # no config.json that would block the corrected rerun


def test_missing_dataset_names_the_place_and_the_variable(tmp_path):
  c = helpers.smoke(data__data_dir=str(tmp_path / "no_data"), data__use_cache=False)
  with pytest.raises(ValueError, match=r"no_data.*TFDS_DATA_DIR") as info:
    run.run(c, str(tmp_path / "wd"))
  assert errors.exit_code(info.value) == 2


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(ConfigError, match=r"--workdir=.*a_file/sub is not writable"):
    run.run(helpers.smoke(), str(blocker / "sub"))
  with pytest.raises(ConfigError, match=r"--workdir=.*a_file exists and is not a dir"):
    run.run(helpers.smoke(), str(blocker))
  assert blocker.read_text() == "x"


@requires_mnist
def test_config_mismatch_on_resume_names_fields_and_keeps_the_run(finished_run, tmp_path):
  wd = _copy(finished_run[0], tmp_path)
  before = helpers.tree_digest(wd)
  with pytest.raises(ConfigError,
                     match=r"holds a run with a different config: config\.model\.width: 8 → 16; "
                           r"config\.stream\.wait: 1 → 2; .*--overwrite"):
    run.run(helpers.smoke(model__width=16, stream__wait=2), wd)
  assert helpers.tree_digest(wd) == before


@requires_mnist
def test_unreadable_config_json(finished_run, tmp_path):
  wd = _copy(finished_run[0], tmp_path)
  with open(os.path.join(wd, "config.json"), "w") as f:
    f.write("{trunc")
  before = helpers.tree_digest(wd)
  with pytest.raises(ConfigError, match=r"config\.json cannot be read .*; delete it to resume "
                                        r"from the checkpoints"):
    run.run(helpers.smoke(), wd)
  assert helpers.tree_digest(wd) == before
  os.unlink(os.path.join(wd, "config.json"))  # as the message says
  run.run(helpers.smoke(), wd)
  assert helpers.outputs(wd) == helpers.outputs(finished_run[0])


def _corrupt(step_dir):
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"\x00garbage")


@requires_mnist
def test_all_checkpoints_corrupt_is_an_error_that_keeps_them(finished_run, tmp_path):
  wd = _copy(finished_run[0], tmp_path)
  ckpt_dir = os.path.join(wd, "checkpoints")
  for step in os.listdir(ckpt_dir):
    _corrupt(os.path.join(ckpt_dir, step))
  before = helpers.tree_digest(wd)
  with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .*checkpoints can be "
                                                       r"restored \(step 4: .*step 3: .*step 2: "):
    run.run(helpers.smoke(), wd)
  assert helpers.tree_digest(wd) == before


@requires_mnist
def test_corrupt_latest_checkpoint_falls_back_and_finishes_identically(finished_run, tmp_path):
  wd = _copy(finished_run[0], tmp_path)
  _corrupt(os.path.join(wd, "checkpoints", "4"))
  summary = run.run(helpers.smoke(), wd)
  assert strip(summary) == strip(finished_run[2])
  assert len(os.listdir(os.path.join(wd, "checkpoints_unreadable"))) == 1


@requires_mnist
def test_incompatible_checkpoint_written_by_another_config(finished_run, tmp_path):
  wd = _copy(finished_run[0], tmp_path)
  os.unlink(os.path.join(wd, "config.json"))  # only the checkpoints know the old config now
  before = helpers.tree_digest(wd)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"checkpoints were written by a different config: "
                           r"config\.model\.width: 8 → 16"):
    run.run(helpers.smoke(model__width=16), wd)
  assert helpers.tree_digest(wd) == before


def strip(summary):
  return {k: v for k, v in summary.items() if k not in ("wall_s", "timings", "provenance")}


# -- divergence ------------------------------------------------------------------------------------
def diverging(**fields):
  # One step per epoch (the whole stage is a batch): epoch 1 gives huge but finite
  # weights, epoch 2 non-finite ones.
  return helpers.smoke(train__batch_size=450, optimizer__name="sgd",
               optimizer__kwargs={"learning_rate": 1e20}, train__epochs=3, train__patience=3,
               **fields)


@requires_mnist
def test_divergence_names_stage_and_epoch_and_keeps_the_checkpoint(tmp_path):
  wd = str(tmp_path / "wd")
  with pytest.raises(DivergenceError, match=r"stage t=1 epoch 2: non-finite") as info:
    run.run(diverging(), wd)
  assert errors.exit_code(info.value) == 1
  assert [r["t"] for r in io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))] == [0]
  with checkpoint.Checkpointer(os.path.join(wd, "checkpoints"), 3) as ckpt:
    assert ckpt.steps() == [0]
    assert ckpt.read_meta(0)["t"] == 0


@requires_mnist
def test_rollback_continues_from_the_best_epoch(tmp_path, caplog):
  wd = str(tmp_path / "wd")
  summary = run.run(diverging(train__on_divergence="rollback"), wd)
  assert "stage t=1 epoch 2: non-finite loss or parameters; rolling back to the best epoch (1)" \
      in caplog.text
  assert "stage t=1 diverged; continuing with its best epoch (1)" in caplog.text
  records = io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))
  assert [r["t"] for r in records] == [0, 1, 2, 3, 4] and summary["num_stages"] == 4
  assert all(0.0 <= r["test_error"] <= 1.0 for r in records)


# -- through the command line: one line on stderr and the exit code -------------------------------
def _main(args, timeout=120):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", "alma_jax.main"] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


def _check_one_line(proc, code, pattern):
  assert proc.returncode == code, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("alma_jax: error: ")]
  assert len(errors) == 1, proc.stderr[-2000:]
  assert errors[0] == proc.stderr.rstrip("\n").splitlines()[-1]
  assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("args, code, pattern", [
    (["--config.stream.wait=3"], 2,
     r"config\.stream\.wait=3 does not divide config\.stream\.num_megabatches=4; "
     r"allowed values: \[1, 2, 4\]"),
    (["--config.stream.wiat=3"], 2,
     r"--config\.stream\.wiat: stream has no field 'wiat' in configs/mnist_sm\.py:smoke; its "
     r"fields: \[.*'wait'.*\]"),
    (["--config.method.tree=False"], 2, r"method has no field 'tree' .*its fields: \['name'\]"),
    (["--config.train.epochs=many"], 2,
     r"invalid --config override: config\.train\.epochs='many' must be an integer, got str"),
    (["--config.optimizer.kwargs.learning_rate=fast"], 2,
     r"invalid --config override: config\.optimizer\.kwargs\.learning_rate='fast' must be a "
     r"number in \(0\.0, inf\), got str"),
    (["--config.optimizer.kwargs.learning_rate=-1"], 2,
     r"config\.optimizer\.kwargs\.learning_rate=-1\.0 must be in \(0\.0, inf\)"),
    (["--config.seed=-1"], 2, r"config\.seed=-1 must be in \[0, 4294967295\]"),
    ([f"--config.seed={2**70}"], 2, r"config\.seed=1180591620717411303424 must be in \[0, "),
    (["--config.seed=1.5"], 2, r"config\.seed=1\.5 must be an integer, got float"),
], ids=["bad_wait", "unknown_field", "field_of_another_method", "bad_type", "learning_rate_word",
        "learning_rate_negative", "seed_negative", "seed_huge", "seed_float"])
def test_command_line_errors_are_one_line(args, code, pattern, tmp_path):
  proc = _main(["--config=configs/mnist_sm.py:smoke", f"--workdir={tmp_path}/wd"] + args)
  _check_one_line(proc, code, pattern)


@pytest.mark.parametrize("args, pattern", [
    (["--config=configs/cifar_sm.py:smoke", "--config.stream.wait=3"],
     r"config\.stream\.wait=3 does not divide config\.stream\.num_megabatches=4"),
    (["--config=configs/cifar_ff.py:smoke", "--config.num_seeds=2"],
     r"config\.num_seeds=2 needs a method whose growth is the same for every seed; "
     r"config\.method\.name='ff' is not one"),
    (["--config=configs/cifar_sm.py:smoke", "--config.mesh.num_devices=4096"],
     r"config\.mesh\.num_devices=4096 but only \d+ cpu devices are visible; use 0 for all"),
    (["--config=configs/cifar_sm.py:smoke", "--config.mesh.model=4096"],
     r"config\.mesh\.model=4096 does not divide the \d+ devices of the mesh"),
    (["--config=configs/cifar_sm.py:smoke", "--compilation_cache_dir={tmp}/wd_file"],
     r"--compilation_cache_dir=.*/wd_file exists and is not a directory; give a writable "
     r"folder, or --compilation_cache_dir=none to run without the cache"),
    (["--config=configs/cifar_sm.py:smoke", "--num_processes=2"],
     r"--num_processes=2: these flags set up a multi-process run; add --jax_distributed"),
], ids=["wait", "seeds_of_a_growing_method", "mesh_devices", "mesh_model", "cache_dir",
        "process_flags"])
def test_a_broken_rule_is_reported_before_the_speed_settings_are_measured(args, pattern,
                                                                         tmp_path):
  (tmp_path / "wd_file").write_text("x")
  args = [a.format(tmp=tmp_path) for a in args]
  proc = _main_measuring(args[0], f"{tmp_path}/wd", args[1:], tmp_path)
  _check_one_line(proc, 2, pattern)
  assert not os.path.exists(tmp_path / "wd")


@requires_mnist
def test_a_run_written_at_a_default_since_left_to_be_chosen_resumes_through_the_command_line(
    tmp_path):
  # gMoE's slots defaulted to pow2, now auto: the command's check of the workdir, before the
  # run, takes the value the run was written with, as the run does.
  written = alma_jax.load_config("mnist_gmoe:smoke")
  written.method.slots = "pow2"
  wd = tmp_path / "wd"
  wd.mkdir()
  io_utils.write_json_atomic(str(wd / "config.json"), workdir_lib.config_dict(
      validation.validate(written, backend=False)))
  (wd / "log.jsonl").write_text('{"t": 1}\n')  # a record: the workdir holds a run
  proc = _main(["--config=configs/mnist_gmoe.py:smoke", f"--workdir={wd}"])
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "method.slots: 'pow2' as the resumed run had it" in proc.stderr
  assert io_utils.read_json(str(wd / "config.json"))["method"]["slots"] == "pow2"
  assert "final_error" in io_utils.read_json(str(wd / "summary.json"))


def _main_measuring(config, workdir, args, tmp_path):
  """`alma_jax.main` on a fresh cache, where a convolution run first measures XLA:CPU's
  fusion settings in child processes (minutes): an input it refuses is refused before that,
  not after (a child's measurement that started fails the test by its time limit)."""
  env = dict(os.environ, PYTHONPATH=ROOT, ALMA_JAX_CACHE_DIR=str(tmp_path / "cache"))
  proc = subprocess.run([sys.executable, "-m", "alma_jax.main", config, f"--workdir={workdir}",
                         "--config.train.cpu_fusion=auto", "--config.train.autotune=measure"]
                        + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
                        check=False)
  assert "measuring train.cpu_fusion" not in proc.stderr
  return proc


def test_a_workdir_that_cannot_hold_the_run_is_reported_before_the_speed_settings_are_measured(
    tmp_path):
  config = "--config=configs/cifar_sm.py:smoke"
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  proc = _main_measuring(config, str(blocker), [], tmp_path)
  _check_one_line(proc, 2, r"--workdir=.*a_file exists and is not a directory")
  proc = _main_measuring(config, "", [], tmp_path)  # `--workdir=`
  _check_one_line(proc, 2, r"--workdir is empty; give a directory for the run's outputs")
  # A workdir with another config's run (its config.json, and a record).
  wd = tmp_path / "wd"
  printed = _main([config, "--print_config", "--config.model.width=9"])
  assert printed.returncode == 0, printed.stderr[-2000:]
  wd.mkdir()
  (wd / "config.json").write_text(printed.stdout)
  (wd / "log.jsonl").write_text('{"t": 1}\n')
  before = helpers.tree_digest(str(wd))
  proc = _main_measuring(config, str(wd), [], tmp_path)
  _check_one_line(proc, 2, r"--workdir=.*wd holds a run with a different config: .*"
                           r"config\.model\.width: 9 → 4")
  assert helpers.tree_digest(str(wd)) == before
  # A workdir in use by a running process (here, the lock held by this one).
  busy = tmp_path / "busy"
  busy.mkdir()
  with workdir_lock.hold(str(busy)):
    proc = _main_measuring(config, str(busy), [], tmp_path)
  _check_one_line(proc, 2, rf"--workdir={re.escape(str(busy))} is in use by the run with pid "
                           rf"{os.getpid()} ")


_UNCLOSED = "def get_config(arg=None):\n  return dict(\n"
_RAISES = "def get_config(arg=None):\n  x = 1\n  raise RuntimeError('boom')\n"


@pytest.mark.parametrize("config, text, flags, pattern", [
    ("mycfg.py", _UNCLOSED, [], r"--config=mycfg\.py: mycfg\.py, line 2: SyntaxError: '\(' was "
                                r"never closed"),
    ("mycfg.py", _RAISES, ["--config.seed=1"],
     r"--config=mycfg\.py: mycfg\.py, line 3: RuntimeError: boom"),
    ("/etc/passwd", None, [], r"--config=/etc/passwd: /etc/passwd, line 1: SyntaxError"),
    (":smoke", None, ["--config.seed=1"], r"--config=:smoke: no config file or name before the "
                                          r"colon .*Available names: .*mnist_sm"),
    ("configs/mnist_ff.py:smoke", None, ["--config.method.growth_rate=inf"],
     r"config\.method\.growth_rate=inf must be in \[0\.0, inf\)"),
], ids=["unclosed_parenthesis", "body_raises", "not_python", "no_file_before_colon",
        "infinite_float"])
def test_config_files_that_fail_to_load_are_one_line_naming_file_and_line(config, text, flags,
                                                                          pattern, tmp_path):
  if text is not None:
    (tmp_path / config).write_text(text)
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "alma_jax.main", f"--config={config}",
                         f"--workdir={tmp_path}/wd"] + flags, cwd=tmp_path if text else ROOT,
                        env=env, capture_output=True, text=True, timeout=120, check=False)
  _check_one_line(proc, 2, pattern)


def test_command_line_warm_start_contradicting_init_from_scratch_is_one_line(tmp_path):
  proc = _main(["--config=configs/mnist_sm.py:smoke", f"--workdir={tmp_path}/wd",
                "--config.stream.warm_start=finetune", "--config.stream.init_from_scratch=True"])
  _check_one_line(proc, 2, r"--config\.stream\.init_from_scratch=True contradicts "
                           r"--config\.stream\.warm_start='finetune'")
  assert not os.path.exists(tmp_path / "wd")


def test_resolving_a_config_file_that_raises_names_its_line(tmp_path):
  path = tmp_path / "mycfg.py"
  path.write_text(_RAISES)
  with pytest.raises(config_resolve.ConfigResolveError,
                     match=rf"^--config={re.escape(str(path))}: .*mycfg\.py, line 3: "
                           r"RuntimeError: boom$"):
    config_resolve.resolve(str(path), ["--config.seed=1"])


@requires_mnist
def test_command_line_mismatch_and_divergence(finished_run, tmp_path):
  wd = _copy(finished_run[0], tmp_path)
  proc = _main(["--config=configs/mnist_sm.py:smoke", f"--workdir={wd}",
                "--config.mesh.num_devices=1", "--config.model.width=9"])
  _check_one_line(proc, 2, r"config\.model\.width: 8 → 9")
  proc = _main(["--config=configs/mnist_sm.py:smoke", f"--workdir={tmp_path}/div",
                "--config.mesh.num_devices=1", "--config.train.batch_size=450",
                "--config.optimizer.name=sgd", "--config.optimizer.kwargs.learning_rate=1e20",
                "--config.train.epochs=3"])
  _check_one_line(proc, 1, r"stage t=1 epoch 2: non-finite")


@requires_mnist
def test_the_divergence_advice_resumes_the_run(tmp_path):
  wd = str(tmp_path / "div")
  args = ["--config=configs/mnist_sm.py:smoke", f"--workdir={wd}", "--config.mesh.num_devices=1",
          "--config.train.batch_size=450", "--config.optimizer.name=sgd",
          "--config.optimizer.kwargs.learning_rate=1e20", "--config.train.epochs=3",
          "--config.train.patience=3"]
  proc = _main(args)
  _check_one_line(proc, 1, r"stage t=1 epoch 2: non-finite training loss or parameters; rerun the "
                           r"same command with --config\.train\.on_divergence=rollback to resume "
                           r"from the last checkpoint")
  first = io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))
  assert [r["t"] for r in first] == [0]
  # Following the advice resumes the run (train.on_divergence may change on resume).
  proc = _main(args + ["--config.train.on_divergence=rollback"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resuming {wd} after t=0/4" in proc.stderr
  resumed = [{k: v for k, v in r.items() if k != "wall_s"}
             for r in io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))]
  # ... to the records of a run that rolled back from the start.
  fresh = str(tmp_path / "fresh")
  run.run(diverging(train__on_divergence="rollback"), fresh)
  assert resumed == [{k: v for k, v in r.items() if k != "wall_s"}
                     for r in io_utils.read_jsonl(os.path.join(fresh, "log.jsonl"))]
  assert [r["t"] for r in resumed] == [0, 1, 2, 3, 4]


def test_batch_larger_than_a_stage_is_a_warning_not_an_error(caplog):
  # The paper's MNIST setting: B=500 gives 108 training examples per
  # mega-batch, less than the batch of 128.
  from alma_jax.data import stream as stream_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config("mnist")
  stream = stream_lib.make_stream(60000, 500, 0.1, 0)
  with caplog.at_level("WARNING"):
    validation.validate_data(c, 60000, stream)
  assert "config.train.batch_size=128 is larger than the training data of a stage" in caplog.text
  caplog.clear()
  c.stream.wait = 10
  with caplog.at_level("WARNING"):
    validation.validate_data(c, 60000, stream)
  assert "batch_size" not in caplog.text


@pytest.mark.parametrize("eval_batch, num_test, warned", [
    (1000, 1000, False), (2000, 1000, False), (2001, 1000, True), (2001, 3000, False),
    (2001, None, True)])
def test_an_evaluation_batch_beyond_every_evaluated_set_is_a_warning(eval_batch, num_test,
                                                                     warned, caplog):
  from alma_jax.data import stream as stream_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config("mnist")
  c.train.eval_batch_size, c.stream.wait = eval_batch, 4
  with caplog.at_level("WARNING"):
    validation.validate_data(c, 2000, stream_lib.make_stream(2000, 4, 0.1, 0), num_test)
  message = (f"config.train.eval_batch_size={eval_batch} is larger than every set the run "
             f"evaluates (2000 training{'' if num_test is None else f' and {num_test} test'} "
             f"examples), so each evaluation pads its batch to {eval_batch} examples; 2000 or "
             "less would pad less")
  assert (message in caplog.text) == warned, caplog.text


@pytest.mark.parametrize("method, fields, warned", [
    ("gmoe", {"method.grow_every": 4}, "its first growth comes before stage 5 "
     "(config.method.grow_every=4) and config.stream.wait_policy='fixed' plans 4 training "
     "stage(s) over config.stream.num_megabatches=4"),
    ("gmoe", {"method.grow_every": 3}, None),
    ("gmoe", {"method.grow_every": 0, "stream.wait": 4}, "before stage 2 "
     "(config.method.grow_every=0) and config.stream.wait_policy='fixed' plans 1 training"),
    ("gmoe", {"method.grow": False, "stream.wait": 4}, None),
    ("ff", {"method.grow_every": 2, "stream.wait": 2}, "before stage 3"),
    ("ff", {"method.growth_rate": 0.0, "stream.wait": 4}, None),
    ("gens", {"stream.wait": 4}, "before stage 2 and config.stream.wait_policy='fixed' plans 1 "
     "training stage(s)"),
    ("gens", {"stream.wait": 2}, None),
    ("ens", {"stream.wait": 4}, None),
    ("gmoe", {"method.grow_every": 4, "stream.wait_policy": "triggered"},
     "wait_policy='triggered' plans 3 training stage(s) over "
     "config.stream.num_megabatches=4 (the error may add more)"),
], ids=["gmoe_every_4", "gmoe_every_3", "gmoe_auto_one_stage", "gmoe_fixed", "ff_every_2",
        "ff_no_rate", "gens_one_stage", "gens_two_stages", "ens", "triggered"])
def test_a_growing_method_that_will_not_grow_is_a_warning(method, fields, warned, caplog):
  from alma_jax.data import stream as stream_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config("mnist", method)
  c.stream.num_megabatches, c.stream.wait = 4, 1
  for path, value in fields.items():
    section, name = path.split(".")
    c[section][name] = value
  with caplog.at_level("WARNING"):
    validation.validate_data(c, 2000, stream_lib.make_stream(2000, 4, 0.1, 0))
  if warned is None:
    assert "will not grow" not in caplog.text
  else:
    assert f"config.method.name={method!r} will not grow: its first growth comes " in caplog.text
    assert warned in caplog.text


@pytest.mark.parametrize("method, fields, grows_before", [
    ("gmoe", {"method.grow_every": 3}, (4, 7)),
    ("gmoe", {"method.grow_every": 0, "stream.num_megabatches": 40}, (5, 9)),  # 40 // 10
    ("gmoe", {"method.grow": False}, ()),
    ("ff", {"method.grow_every": 2}, (3, 5, 7, 9)),
    ("ff", {"method.growth_rate": 0.0}, ()),
], ids=["gmoe_every_3", "gmoe_auto", "gmoe_fixed", "ff_every_2", "ff_no_rate"])
def test_a_method_grows_before_the_stages_its_declared_period_gives(method, fields,
                                                                      grows_before):
  c = helpers.small_config("mnist", method)
  c.stream.num_megabatches, c.stream.wait = 10, 1
  for path, value in fields.items():
    section, name = path.split(".")
    c[section][name] = value
  c = validation.validate(c)
  m = methods.make(c, *validation.KNOWN_SHAPES["mnist"])
  period = m.growth_period(c, c.stream.num_megabatches // c.stream.wait)
  stages = range(1, 10)
  declared = [s for s in stages if period is not None and declared_methods.grows_before(s, period)]
  assert declared == list(grows_before)
  ask = (lambda s: m.should_grow(s)) if method == "gmoe" else (
      lambda s: m.should_grow(types.SimpleNamespace(stage=s)))
  assert [s for s in stages if ask(s)] == declared


@requires_mnist
def test_a_mistyped_data_set_name_is_refused_with_the_name_it_is_close_to():
  with pytest.raises(ValueError, match=r"config\.data\.name='mnsit' is not available offline.*"
                                        r"did you mean 'mnist'\?$"):
    validation.validate(helpers.smoke(data__name="mnsit", data__download="no"))


_UNKNOWN_VARIANT = ("config variant 'smok' is unknown; valid: ['paper', 'smoke', 'quick'] "
                    "(comma-separated)")


def test_a_library_error_raised_for_a_config_file_keeps_its_own_message():
  with pytest.raises(config_resolve.ConfigResolveError) as info:
    config_resolve.resolve("configs/mnist_sm.py:smok")
  # Its own words, without absl's around them ("flag --config=...: Error whilst parsing config
  # file: ValueError: ...").
  assert str(info.value) == f"--config=configs/mnist_sm.py:smok: {_UNKNOWN_VARIANT}"


def test_an_override_its_field_s_type_refuses_is_said_in_the_field_s_words():
  # The command line said so already; the API, the launchers and the sweep said "invalid
  # literal for int() with base 10: 'a'".
  with pytest.raises(config_resolve.ConfigResolveError) as info:
    config_resolve.resolve("configs/mnist_sm.py:smoke", ["--config.model.width=a"])
  assert str(info.value) == ("--config=configs/mnist_sm.py:smoke: config.model.width='a' must "
                             "be an integer, got str")


@pytest.mark.parametrize("typed", [["--config=mnist_sm:smok"], ["--config", "mnist_sm:smok"]])
def test_the_command_line_names_an_unknown_variant_s_config_as_typed(typed):
  proc = _main(typed + ["--workdir=/nonexistent/wd"])
  _check_one_line(proc, 2, "")
  assert proc.stderr.splitlines()[-1] == (
      f"alma_jax: error: --config=mnist_sm:smok: {_UNKNOWN_VARIANT}")
