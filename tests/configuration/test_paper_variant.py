"""The `paper` variant: every image config resolved with `:paper` (alone or with `quick`) has the
values of the sourced table (alma_jax/configuration/paper.py), and changes nothing else."""

import glob
import os
import subprocess
import sys

import pytest

import alma_jax
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.configuration import paper
from alma_jax.outputs import workdir
from alma_jax.stream import config_resolve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE_CONFIGS = sorted(os.path.relpath(p, ROOT) for pattern in ("mnist_*.py", "cifar_*.py")
                       for p in glob.glob(os.path.join(ROOT, "configs", pattern)))
# What a config file chooses on purpose away from the paper: its backbone.
CHOSEN = {"configs/cifar_sm_resnet.py": {"model.name": "resnet"}}


def _resolved(arg: str) -> dict:
  return workdir.flatten(config_resolve.resolved_dict(os.path.join(ROOT, arg)))


def _expected(config: dict, path: str) -> dict:
  want = paper.expected(config["data.name"], config["method.name"])
  assert want, f"no paper settings for {config['data.name']}/{config['method.name']}"
  return {**want, **CHOSEN.get(path, {})}


def test_every_image_config_file_is_checked():
  assert len(IMAGE_CONFIGS) == 13
  methods = {(c["data.name"], c["method.name"]) for c in map(_resolved, IMAGE_CONFIGS)}
  assert methods == {(d, m) for d in paper.DATASETS for m in paper.METHODS}


@pytest.mark.parametrize("path", IMAGE_CONFIGS)
def test_paper_sets_the_table_values_and_nothing_else(path):
  default, got = _resolved(path), _resolved(f"{path}:paper")
  want = _expected(got, path)
  assert {p: got.get(p, "absent") for p in want} == want
  changed = {p for p in got if got[p] != default.get(p)}
  assert changed <= set(want), f"`paper` sets fields outside the table: {changed - set(want)}"


@pytest.mark.parametrize("path", IMAGE_CONFIGS)
def test_quick_keeps_its_reductions_with_paper_in_either_order(path):
  default, quick = _resolved(path), _resolved(f"{path}:quick")
  both = _resolved(f"{path}:quick,paper")
  assert _resolved(f"{path}:paper,quick") == both
  reduced = {p for p in quick if quick[p] != default.get(p)}
  assert {"train.epochs", "train.patience"} <= reduced
  for p, value in _expected(both, path).items():
    assert both[p] == (quick[p] if p in reduced else value), p
  changed = {p for p in both if both[p] != quick.get(p)}
  assert changed <= set(_expected(both, path))


def test_method_dependent_values():
  """The five defaults that are neither the paper's nor the released code's, by method."""
  def get(arg, p):
    return _resolved(arg)[p]
  assert get("configs/mnist_gmoe.py", "method.grow_every") == 0  # about 10 growths
  assert get("configs/mnist_gmoe.py:paper", "method.grow_every") == 1
  assert get("configs/cifar_gmoe.py:paper", "optimizer.kwargs.nesterov") is True
  assert get("configs/cifar_ff.py:paper", "optimizer.kwargs.nesterov") is True
  assert get("configs/cifar_sm.py:paper", "optimizer.kwargs.nesterov") is False
  assert "optimizer.kwargs.nesterov" not in _resolved("configs/mnist_gmoe.py:paper")  # Adadelta
  assert get("configs/mnist_ens.py:paper", "train.patience") == 100
  assert get("configs/cifar_umix.py:paper", "train.patience") == 100
  assert get("configs/cifar_gens.py:paper", "train.patience") == 25
  assert get("configs/mnist_sm.py:paper", "train.patience_delta") == 0.001
  assert get("configs/mnist_ens.py:paper", "train.patience_delta") == 0.0
  assert get("configs/cifar_sm_resnet.py:paper", "model.init") == "torch"
  assert get("configs/cifar_ff.py:paper", "method.epsilon") == 1.0


def test_smoke_and_quick_stay_at_the_defaults_the_paper_variant_changes():
  for arg in ("configs/cifar_gmoe.py:smoke", "configs/mnist_ens.py:quick"):
    c = _resolved(arg)
    assert (c["model.init"], c["train.patience_delta"]) == ("lecun", 0.0)
  assert _resolved("configs/cifar_ff.py:smoke,paper")["method.num_new"] == 4


def test_by_method_and_by_dataset_nest_and_keep():
  table = {"v": {"train.epochs": F.ByMethod({"ens": F.ByDataset({"mnist": 7}, 8)},
                                            config_lib.KEEP)}}
  for dataset, method, epochs in (("mnist", "ens", 7), ("cifar10", "ens", 8),
                                  ("mnist", "sm", 100)):
    c = config_lib.apply_variant(config_lib.base_config(dataset, method), "v", table)
    assert c.train.epochs == epochs


def test_paper_comes_first_and_the_others_keep_their_order():
  table = {"paper": {"train.epochs": 1, "train.patience": 1},
           "a": {"train.epochs": 2}, "b": {"train.epochs": 3}}
  c = config_lib.apply_variant(config_lib.base_config("mnist"), "b,a,paper", table)
  assert (c.train.epochs, c.train.patience) == (2, 1)


def test_an_unknown_variant_still_names_the_valid_ones():
  with pytest.raises(ValueError, match=r"config variant 'papr' is unknown; valid: \['paper', "
                                       r"'smoke', 'quick'\] \(comma-separated\)"):
    config_lib.apply_variant(config_lib.base_config("cifar10", "gmoe"), "quick,papr")
  with pytest.raises(config_resolve.ConfigResolveError, match="'papr' is unknown"):
    config_resolve.resolve(os.path.join(ROOT, "configs/mnist_sm.py:papr"))


def test_the_table_lists_fields_of_the_config_once_with_a_source_and_a_value():
  for d in paper.DATASETS:
    for m in paper.METHODS:
      c = config_lib.base_config(d, m)
      for s in paper.settings(d, m).values():  # raises on a field listed twice
        assert s.source and s.value is not None and s.value != paper.NOT_RELEASED, s
        F.lookup(c, s.path)  # a field of this config (a ConfigError otherwise)


def test_the_table_module_imports_nothing():
  code = ("import sys; from alma_jax.configuration import paper; "
          "print(sorted(m for m in sys.modules if m.startswith(('jax', 'flax', 'optax', "
          "'ml_collections', 'alma_jax.configuration.'))))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        check=True, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.stdout.strip() == "['alma_jax.configuration.paper']"


def test_load_config_takes_the_variant_by_name():
  c = alma_jax.load_config("mnist_gmoe:quick,paper")
  assert (c.method.grow_every, c.model.init, c.train.epochs) == (1, "torch", 20)
