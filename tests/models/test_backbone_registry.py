"""Tests of the backbone contract (alma_jax/models/registry.py): what the package's backbones
declare, what reads it, and a backbone added from outside the package."""

import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from alma_jax import methods
from alma_jax import models
from alma_jax.configuration.plugins import backbones as declared_backbones
from alma_jax.errors import ConfigError
from alma_jax.methods import base
from alma_jax.methods import ensemble
from alma_jax.models import switch
from alma_jax.outputs import io_utils
from alma_jax.stream import run
from alma_jax.stream import validation
from alma_jax.tuning import autotune
from alma_jax.tuning import cpu_fusion
from tests import helpers
from tests.conftest import requires_mnist

MNIST = (28, 28, 1)


class TinyNet(nn.Module):
  """A backbone defined outside the package: one hidden layer of `width` ReLU units."""

  width: int
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask
    x = nn.relu(nn.Dense(self.width, name="hidden")(x.reshape((x.shape[0], -1))))
    return nn.Dense(self.num_classes, name="head")(x)


TINY = models.BackboneSpec("tiny", lambda mc, n: TinyNet(int(mc.width), n))


@pytest.fixture(name="tiny")
def fixture_tiny():
  models.register(TINY)
  yield TINY
  del models.BACKBONES[TINY.name], declared_backbones.BACKBONES[TINY.name]


# -- the package's backbones ---------------------------------------------------------------------
def test_the_package_backbones_declare_their_capabilities():
  got = {n: (s.tasks, s.conv_heavy, s.width_layout is not None, s.mixture is not None)
         for n, s in models.BACKBONES.items()}
  assert got == {"mlp": (("images",), False, True, True),
                 "vgg": (("images",), True, True, True),
                 "resnet": (("images",), True, False, False),
                 "switch": (("text",), False, False, False)}
  # A backbone's stacked leaves are its class's LEAF_AXES (the mesh's `model` axis splits them).
  assert base.backbone_leaf_axes(switch.SwitchTransformer) == (
      (r"\['layers'\].*\['expert_", (None, "expert")), (r"\['expert_", ("expert",)))


def test_the_cpu_speed_rules_read_conv_heavy():
  for name, heavy in (("mlp", False), ("vgg", True), ("resnet", True)):
    assert ensemble.choose_strategy("auto", name, "cpu") == ("loop" if heavy else "vmap")
    assert ensemble.choose_strategy("auto", name, "gpu") == "vmap"
    c = helpers.small_config("cifar10", method="sm")
    c.model.name = name
    assert cpu_fusion.applies(c) == heavy
    assert ("model.conv_impl" in [t.path for t in autotune.pending(c)]) == heavy


def test_unknown_names_and_tasks_are_clear_errors():
  with pytest.raises(ConfigError, match=r"config\.model\.name='nope' is not a backbone; valid "
                     r"names: \['mlp', 'resnet', 'switch', 'vgg'\]"):
    models.spec("nope")
  with pytest.raises(ConfigError, match=r"config\.model\.name='switch' cannot model images; "
                     r"valid names: \['mlp', 'resnet', 'vgg'\]"):
    models.check_task("switch", "images")
  with pytest.raises(ValueError, match="registered twice"):
    models.register(models.BackboneSpec("mlp", lambda mc, n: None))


def test_firefly_grows_the_layers_of_the_width_layout():
  # Firefly's widths come from the spec: 16 conv layers for the VGG, 2 for the MLP.
  c = helpers.small_config("cifar10", method="ff", width=4)
  assert methods.make(validation.complete(c), (32, 32, 3), 10).initial_structure() == (4,) * 16
  c = helpers.small_config("mnist", method="ff", width=4)
  assert methods.make(validation.complete(c), MNIST, 10).initial_structure() == (4, 4)


# -- a backbone from outside the package ---------------------------------------------------------
def test_a_registered_backbone_is_a_valid_config_value(tiny):
  c = helpers.small_config("mnist", method="sm")
  c.model.name = tiny.name
  method = methods.make(validation.validate(c), MNIST, 10)
  assert method.init(jax.random.key(0)).params["hidden"]["kernel"].shape == (784, 8)
  for name, field in (("gmoe", "mixture"), ("ff", "width_layout")):
    c.method.name = name
    with pytest.raises(ConfigError, match=rf"config\.model\.name='tiny' .* declares no {field} "):
      validation.validate(c)


@requires_mnist
def test_sm_runs_on_a_backbone_registered_at_run_time(tiny, tmp_path):
  c = helpers.smoke("sm", model__name=tiny.name)
  summary = run.run(c, str(tmp_path))
  records = io_utils.read_jsonl(os.path.join(tmp_path, "log.jsonl"))
  b = c.stream.num_megabatches
  assert [r["t"] for r in records] == list(range(b + 1))
  errors = np.array([r["test_error"] for r in records])
  assert np.all(np.isfinite(errors)) and summary["num_stages"] == b
  # Its parameters: 784 x 8 + 8 hidden, 8 x 10 + 10 classifier.
  assert {r["num_params"] for r in records} == {784 * 8 + 8 + 8 * 10 + 10}
  assert errors[-1] < errors[0]  # it learns
