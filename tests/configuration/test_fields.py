"""Tests of the config fields declared once (alma_jax/configuration/fields.py, config_lib.py)."""

import math
import os
import re

import ml_collections
import pytest

from alma_jax import methods
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.errors import ConfigError
from alma_jax.stream import validation
from tests import helpers

ROOT = helpers.ROOT


@pytest.mark.parametrize("check, value, message", [
    (F.integer(1), 0, r"config\.x\.y=0 must be >= 1"),
    (F.integer(), 2.0, r"config\.x\.y=2\.0 must be an integer, got float"),
    (F.integer(), True, r"config\.x\.y=True must be an integer, got bool"),
    (F.number(0.0, 1.0), 1.5, r"config\.x\.y=1\.5 must be in \[0\.0, 1\.0\]"),
    (F.number(0.0, 1.0, open_lo=True), 0.0, r"must be in \(0\.0, 1\.0\]"),
    (F.number(0.0, 1.0), float("nan"), r"config\.x\.y=nan must be in"),
    (F.number(0.0, 1.0, open_lo=True), "fast",
     r"config\.x\.y='fast' must be a number in \(0\.0, 1\.0\], got str"),
    (F.integer(0, hi=9), 10, r"config\.x\.y=10 must be in \[0, 9\]"),
    (F.integer(0, hi=9), -1, r"config\.x\.y=-1 must be in \[0, 9\]"),
    (F.boolean(), "yes", r"config\.x\.y='yes' must be true or false, got str"),
    (F.choice(("b", "a")), "c", r"config\.x\.y='c' is unknown; valid values: \['a', 'b'\]"),
    (F.optional_path(), 3, r"config\.x\.y=3 must be a path or None"),
])
def test_checks_name_the_field_and_the_allowed_values(check, value, message):
  with pytest.raises(ConfigError, match=message):
    check("x.y", value)


def test_checks_return_valid_values():
  assert F.integer(1)("a", 3) == 3
  assert F.number(0.0, 1.0)("a", 1) == 1.0 and isinstance(F.number()("a", 1), float)
  assert F.choice(lambda: ["p", "q"])("a", "q") == "q"
  assert F.optional_path()("a", None) is None


def test_base_config_takes_every_default_from_the_declarations():
  for dataset in ("mnist", "cifar10"):
    c = config_lib.base_config(dataset)
    for f in config_lib.BASE_FIELDS:
      if f.path == "data.name":
        continue
      got = F.lookup(c, f.path)
      want = f.default_for(dataset)
      got = got.to_dict() if isinstance(got, ml_collections.ConfigDict) else got
      assert got == want, f.path
  assert config_lib.base_config("mnist").stream.num_megabatches == 500
  assert config_lib.base_config("cifar10").optimizer.name == "sgd"


@pytest.mark.parametrize("name", methods.names())
@pytest.mark.parametrize("dataset, shape", [("mnist", ((28, 28, 1), 10)),
                                            ("tiny_shakespeare", ((8,), 50257))])
def test_each_method_declares_its_fields_and_they_are_filled(name, dataset, shape):
  cls = methods.get(name)
  c = config_lib.base_config(dataset, name)
  if name.startswith("lm_") and dataset == "mnist":  # SM, Ens, ... on text, not on images
    with pytest.raises(ConfigError, match=rf"config\.method\.name='{name}' is \w+ on text"):
      validation.validate(c)
    return
  if name == "ff" and dataset != "mnist":
    return
  declared = cls.fields(c)
  assert all(f.path.startswith("method.") for f in declared)
  for f in declared:
    assert F.lookup(c, f.path) == f.default_for(dataset)
  method = methods.make(c, *shape)
  assert {f.name for f in declared} == set(vars(method.opts))


def test_a_config_lacking_fields_is_completed_with_their_defaults():
  c = config_lib.base_config("mnist", "ens")
  del c.checkpoint["every"]
  del c.method["strategy"]
  done = validation.complete(c)
  assert done.checkpoint.every == 1 and done.method.strategy == "auto"
  assert "every" not in c.checkpoint  # the input is not modified


def test_resumable_fields_are_those_declared_resumable():
  assert set(config_lib.resumable_paths()) == {
      "data.data_dir", "data.cache_dir", "data.use_cache", "data.download",
      "train.progress_every_s", "train.on_divergence", "checkpoint.enabled",
      "checkpoint.max_to_keep", "checkpoint.every", "checkpoint.every_s",
      "checkpoint.stage_every_epochs", "mesh.distributed", "log.tensorboard", "log.wandb",
      "log.progress", "log.error_png",
          "train.autotune", "train.cpu_fusion", "train.stage_program", "train.gpu_autotune",
          "train.gpu_threefry",
          "train.cpu_allocator", "train.step_fusion", "train.eval_fusion"}


def test_field_table_names_every_declared_field():
  with open(os.path.join(ROOT, "docs", "fields.md")) as f:
    readme = f.read()
  declared = [f.path for f in config_lib.base_fields()]
  for name in methods.names():
    for dataset in ("mnist", "tiny_shakespeare"):  # some fields depend on the backbone
      declared += [f.path for f in methods.fields_for(config_lib.base_config(dataset, name))]
  for task in tasks.TASKS.values():
    declared += [f.path for f in task.FIELDS]
  missing = sorted({p for p in declared if f"`{p}`" not in readme})
  assert not missing, f"the field table (docs/fields.md) lacks {missing}"


@pytest.mark.parametrize("path, value, allowed", [
    ("train.patience_delta", 2.0, r"\[0\.0, 1\.0\)"),
    ("train.patience_delta", 1.0, r"\[0\.0, 1\.0\)"),
    ("optimizer.weight_decay", math.inf, r"\[0\.0, inf\)"),
    ("stream.replay", math.nan, r"\[0\.0, 1\.0\]"),
])
def test_out_of_range_and_infinite_numbers_are_refused_naming_the_field(path, value, allowed):
  c = config_lib.base_config("mnist")
  section, name = path.rsplit(".", 1)
  c[section][name] = value
  with pytest.raises(ConfigError, match=rf"config\.{re.escape(path)}=.* must be in {allowed}"):
    validation.validate(c)


def test_infinite_numbers_are_refused_unless_the_field_opts_in():
  assert F.number(0.0)("x", 1e300) == 1e300
  with pytest.raises(ConfigError, match=r"config\.x=inf must be in \[0\.0, inf\)"):
    F.number(0.0)("x", math.inf)
  with pytest.raises(ConfigError, match=r"config\.x=-inf must be in \(-inf, inf\)"):
    F.number()("x", -math.inf)
  assert F.number(0.0, allow_inf=True)("x", math.inf) == math.inf
  assert validation.value_error("checkpoint.every_s", math.inf) is None  # inf: never
