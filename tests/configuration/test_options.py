"""Tests of a run's frozen options (alma_jax/configuration/options.py)."""

import dataclasses
import json
import typing

import pytest

from alma_jax.configuration import config_lib
from alma_jax.configuration import options
from alma_jax.errors import ConfigError
from alma_jax.outputs import workdir
from alma_jax.stream import validation


def _validated(dataset="mnist", method="gmoe", variant="smoke"):
  return validation.validate(config_lib.apply_variant(config_lib.base_config(dataset, method),
                                                      variant))


@pytest.mark.parametrize("dataset,method", [("mnist", "gmoe"), ("cifar10", "ens"),
                                            ("tiny_shakespeare", "lm_gmoe")])
def test_options_hold_the_config_s_values_and_json(dataset, method):
  config = _validated(dataset, method)
  o = options.of(config)
  assert o.to_dict() == config.to_dict()
  assert workdir.config_dict(o) == workdir.config_dict(config)  # what config.json holds
  assert json.dumps(workdir.config_dict(o)) == json.dumps(workdir.config_dict(config))
  assert options.of(o) is o


def test_sections_are_frozen_typed_and_read_as_a_config_section_does():
  o = options.of(_validated())
  with pytest.raises(dataclasses.FrozenInstanceError):
    o.train.epochs = 3  # pytype: disable=not-writable
  with pytest.raises(TypeError):
    o.optimizer.kwargs["learning_rate"] = 0.1  # a read-only mapping
  hints = {f.name: f.type for f in dataclasses.fields(o.train)}
  assert hints["epochs"] is int and hints["patience_delta"] is float
  assert hints["stage_program"] is str and hints["keep_optimizer_state"] is bool
  assert {f.name: f.type for f in dataclasses.fields(o.method)}["split_by"] is str
  assert {f.name: f.type for f in dataclasses.fields(o.optimizer)}["kwargs"] is typing.Mapping
  assert o.train["epochs"] == o.train.epochs and "epochs" in o.train and "nope" not in o.train
  assert o.train.get("nope", 7) == 7
  with pytest.raises(KeyError):
    o.train["nope"]  # pylint: disable=pointless-statement
  # Equal configs give equal options (one class per section and field list).
  assert options.of(_validated()) == o


def test_replace_rebuilds_by_dotted_path_and_refuses_unknown_fields():
  o = options.of(_validated())
  r = options.replace(o, **{"train.epochs": 7, "seed": 3})
  assert (r.train.epochs, r.seed, o.train.epochs, o.seed) == (7, 3, 2, 0)
  assert r.train.batch_size == o.train.batch_size and r.model is o.model
  with pytest.raises(ConfigError, match="no field 'nope'"):
    options.replace(o, **{"train.nope": 1})


def test_a_seed_s_options_are_those_of_its_separate_run():
  config = _validated("mnist", "sm")
  o = options.of(config)
  assert (workdir.config_dict(config_lib.seed_config(o, 5))
          == workdir.config_dict(config_lib.seed_config(config, 5)))
