"""Tests of the CIFAR ResNet (alma_jax/models/resnet.py): whole runs of the methods that take
any backbone, the refusal of those that need a capability it does not declare, and its
multiply-adds against a count by hand."""

import functools
import os

import jax
import numpy as np
import pytest

from alma_jax import methods
from alma_jax import models
from alma_jax.engine import accounting
from alma_jax.errors import ConfigError
from alma_jax.models import resnet
from alma_jax.outputs import io_utils
from alma_jax.stream import config_resolve
from alma_jax.stream import run
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_cifar10

CIFAR = (32, 32, 3)
ROOT = helpers.ROOT
CONFIG = os.path.join(ROOT, "configs", "cifar_sm_resnet.py")


def resnet_smoke(method: str, **method_fields):
  """configs/cifar_sm_resnet.py:smoke (C=4) with `method` and its fields, shortened to B=2
  stages of one epoch on one device, the CPU speed choices left to their rules (measuring
  would time candidates): compiling the programs is most of a run's time."""
  c = config_resolve.resolve(f"{CONFIG}:smoke", [
      f"--config.method.name={method}", "--config.mesh.num_devices=1",
      "--config.stream.num_megabatches=2", "--config.train.epochs=1",
      "--config.train.patience=1", "--config.train.autotune=rules",
      "--config.train.cpu_fusion=none"])
  c = validation.complete(c)
  with c.unlocked():
    c.method.update(method_fields)
  return c


# -- whole runs --------------------------------------------------------------------------------
@requires_cifar10
@pytest.mark.parametrize("method, fields", [
    ("sm", {}), ("ens", {"num_members": 2}), ("umix", {"num_members": 2}), ("gens", {})])
def test_methods_run_on_the_resnet(method, fields, tmp_path):
  c = resnet_smoke(method, **fields)
  b = c.stream.num_megabatches
  summary = run.run(c, str(tmp_path))
  records = io_utils.read_jsonl(os.path.join(tmp_path, "log.jsonl"))
  assert [r["t"] for r in records] == list(range(b + 1))
  errors = np.array([r["test_error"] for r in records])
  assert np.all(np.isfinite(errors)) and np.all((errors >= 0) & (errors <= 1))
  assert summary["num_stages"] == b and summary["cer"] == pytest.approx(errors.sum())
  assert all(r["train_flops"] > 0 for r in records[1:])
  if method == "sm":  # the record: the prediction of an evaluation batch, per example
    eb = c.train.eval_batch_size
    per_example = counts(c.model.width, False, eb).flops / eb
    assert [r["inference_flops_per_example"] for r in records] == [per_example] * (b + 1)
  if method == "gens":  # one more member before every later stage
    assert records[-1]["num_params"] == b * records[1]["num_params"]


@pytest.mark.parametrize("variant", ["", "smoke", "quick"])
def test_the_config_file_is_cifar_sm_with_the_resnet(variant):
  c = config_resolve.resolve(f"{CONFIG}:{variant}" if variant else CONFIG)
  sm = config_resolve.resolve(os.path.join(ROOT, "configs", "cifar_sm.py") +
                              (f":{variant}" if variant else ""))
  assert c.model.name == "resnet" and sm.model.name == "vgg"
  with sm.unlocked():
    sm.model.name = "resnet"
  assert c.to_dict() == sm.to_dict()


# -- what it does not declare --------------------------------------------------------------------
@pytest.mark.parametrize("method, missing", [
    ("gmoe", r"declares no mixture \(the mixture points and expert sub-network of gMoE\)"),
    ("ff", r"declares no width_layout \(the growable layers of Firefly\)")])
def test_methods_that_need_an_undeclared_capability_refuse_the_resnet(method, missing):
  with pytest.raises(ConfigError, match=rf"config\.model\.name='resnet' .*{missing}; "
                     r"valid names: \['mlp', 'vgg'\]") as e:
    validation.validate(resnet_smoke(method))
  assert "\n" not in str(e.value)


def test_its_spec():
  s = models.spec("resnet")
  assert s.conv_heavy and s.tasks == ("images",)
  assert s.width_layout is None and s.mixture is None


# -- multiply-adds -----------------------------------------------------------------------------
def hand_macs(c: int, num_classes: int = 10) -> int:
  """Multiply-adds of one 32x32x3 image through the ResNet of width C, layer by layer.

  A convolution with k x k kernels, Cin inputs and Cout outputs on an H x W output map
  costs k*k*Cin*Cout*H*W; the classifier Cin*classes. These are all the products
  (`alma_jax.engine.accounting` counts the multiply-adds of convolutions and matrix products
  only). BatchNorm, ReLU, the residual additions and the global average pool are
  elementwise or reductions: they add FLOPs (1 per element), no multiply-adds.
  """
  def conv(k, cin, cout, side):
    return k * k * cin * cout * side * side
  return (
      conv(3, 3, c, 32)                                       # stem
      + 4 * conv(3, c, c, 32)                                 # stage 0: 2 blocks x 2 convs
      + conv(3, c, 2 * c, 16) + 3 * conv(3, 2 * c, 2 * c, 16)  # stage 1: stride 2, then 3
      + conv(1, c, 2 * c, 16)                                 #   1x1 shortcut, stride 2
      + conv(3, 2 * c, 4 * c, 8) + 3 * conv(3, 4 * c, 4 * c, 8)  # stage 2
      + conv(1, 2 * c, 4 * c, 8)
      + conv(3, 4 * c, 8 * c, 4) + 3 * conv(3, 8 * c, 8 * c, 4)  # stage 3
      + conv(1, 4 * c, 8 * c, 4)
      + 8 * c * num_classes)                                  # the classifier


def test_the_hand_count_is_resnet18s_known_cost():
  # ResNet-18 on CIFAR-10 (C=64): the commonly quoted 0.56 GMACs per image.
  assert hand_macs(64) == pytest.approx(0.56e9, rel=0.01)


def counts(width: int, train: bool, n: int = 3) -> accounting.Count:
  """What `alma_jax.engine.accounting` counts for a batch of n images through SM on the ResNet: its
  prediction (as for `inference_flops_per_example`) or its training forward pass (as for
  `train_macs`). Traced on shapes alone: nothing is initialised or compiled."""
  c = helpers.small_config("cifar10", width=width)
  c.model.name = "resnet"
  method = methods.make(validation.complete(c), CIFAR, 10)
  learner = jax.eval_shape(method.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((n,) + CIFAR, np.float32)
  fn = (functools.partial(method.logits, (), train=True) if train
        else functools.partial(method.predict, ()))
  return accounting.count(fn, learner.params, learner.model_state, x)


@pytest.mark.parametrize("width", [4, 64])
@pytest.mark.parametrize("train", [False, True])
def test_counted_multiply_adds_match_the_hand_count(width, train):
  count = counts(width, train, n=3)
  assert count.macs == 3 * hand_macs(width)
  assert count.flops > 2 * count.macs  # BatchNorm, ReLU, additions and the pool add FLOPs


def test_width_sets_every_stage():
  x = np.zeros((1,) + CIFAR, np.float32)
  v = jax.eval_shape(lambda k: resnet.ResNet(width=3).init(k, x), jax.random.key(0))
  widths = {name: p["conv1"]["kernel"].shape[-1] for name, p in v["params"].items()
            if name.startswith("stage")}
  assert widths == {f"stage{s}_block{b}": 3 * 2**s for s in range(4) for b in range(2)}
  assert v["params"]["head"]["kernel"].shape == (24, 10)
  assert set(v["batch_stats"]["stage1_block0"]) == {"bn0", "bn1", "shortcut_bn"}
  assert "shortcut" not in v["params"]["stage1_block1"]
