"""Tests of the task contract (alma_jax/tasks/): the task follows the data or the backbone, one
loss serves every method, the lm_ method names stand for SM, Ens, gEns and gMoE on text, and a
new kind of data is a task defined outside the package."""

import json
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from alma_jax import methods
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError
from alma_jax.methods import ensemble
from alma_jax.methods import gmoe
from alma_jax.methods import sm
from alma_jax.outputs import io_utils
from alma_jax.stream import run as run_lib
from alma_jax.stream import validation
from alma_jax.tasks import base as task_base
from tests import helpers
from tests.conftest import requires_mnist


# -- which task ------------------------------------------------------------------------------------
def test_the_task_follows_the_data_then_the_backbone():
  assert tasks.task_class(config_lib.base_config("mnist")) is tasks.ImageTask
  assert tasks.task_class(config_lib.base_config("cifar10", "ens")) is tasks.ImageTask
  assert tasks.task_class(config_lib.base_config("tiny_shakespeare", "sm")) is tasks.TextTask
  c = config_lib.base_config("imagenet")  # not a known data set: its backbone (vgg) decides
  assert tasks.task_class(c) is tasks.ImageTask
  c.model.name = "switch"
  assert tasks.task_class(c) is tasks.TextTask
  c = config_lib.base_config("corpus")  # named after a text file: the file makes it text
  assert tasks.task_class(c) is tasks.ImageTask
  with c.unlocked():
    c.data.text_file = "/tmp/book.txt"
  assert tasks.task_class(c) is tasks.TextTask


def test_a_text_config_gets_the_text_settings_and_fields():
  c = config_lib.base_config("tiny_shakespeare", "sm")
  assert c.model.name == "switch" and c.train.steps_per_epoch == 120000
  assert c.optimizer.schedule == "warmup_linear" and c.data.seq_len == 512
  assert dict(c.method) == {"name": "sm"}


def test_a_backbone_that_does_not_serve_the_task_is_refused():
  c = config_lib.apply_variant(config_lib.base_config("mnist"), "smoke")
  c.model.name = "switch"
  with pytest.raises(ConfigError, match=r"^config\.model\.name='switch' cannot model images; "
                                        r"valid values: \['mlp', 'resnet', 'vgg'\]$"):
    validation.validate(c)


# -- the lm_ names ---------------------------------------------------------------------------------
ALIASES = {"lm_sm": ("sm", sm.SingleModel), "lm_ens": ("ens", ensemble.Ensemble),
           "lm_gens": ("gens", ensemble.GrowingEnsemble), "lm_gmoe": ("gmoe", gmoe.GrowingMoE)}
# The method fields that the lm_ configs recorded before they were names of SM, Ens, gEns and
# gMoE on text (their config.json must stay the same, so that their runs resume), and lm_gmoe's
# `slots`, added since (a run recorded without it resumes with `exact`:
# tests/models/test_switch.py), whose default is now `auto` (it was `pow2`; a run recorded with
# either resumes as it ran: tests/methods/test_growth_slots.py).
RECORDED_METHOD_FIELDS = {
    "lm_sm": {"name": "lm_sm"},
    "lm_ens": {"name": "lm_ens", "num_members": 2, "strategy": "auto"},
    "lm_gens": {"name": "lm_gens", "initial_members": 1, "grow_by": 1, "new_member": "copy",
                "combine": "probs", "slots": "pow2", "strategy": "auto"},
    "lm_gmoe": {"name": "lm_gmoe", "initial_experts": 4, "grow_by": 2, "grow_schedule": "2,2,4",
                "grow_every": 1, "max_experts": 0, "router_noise": 0.0, "slots": "auto"},
}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_lm_name_is_its_method_on_text(alias):
  name, cls = ALIASES[alias]
  assert methods.get(alias) is cls and alias in methods.names()
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", alias), "smoke")
  plain = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", name), "smoke")
  if alias == "lm_ens":  # configs/lm_ens.py's own choice
    c.method.num_members = plain.method.num_members = 2
  assert c.method.name == alias
  with c.unlocked():
    c.method.name = name
  assert c.to_dict() == plain.to_dict()  # the same config but for the name
  with open(os.path.join(helpers.ROOT, "configs", f"{alias}.py")) as f:
    assert f'base_config("tiny_shakespeare", "{alias}")' in f.read()
  recorded = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", alias), "")
  if alias == "lm_ens":
    recorded.method.num_members = 2
  assert recorded.method.to_dict() == RECORDED_METHOD_FIELDS[alias]
  method = methods.make(recorded, (16,), 50257)
  assert type(method) is cls and isinstance(method.task, tasks.TextTask)
  # The experts of every block are stacked on an axis of their own (sharded like gMoE's).
  assert any("expert" in axes for _, axes in method.LEAF_AXES)


def test_an_lm_name_on_image_data_names_the_method_to_use():
  c = config_lib.apply_variant(config_lib.base_config("mnist"), "smoke")
  c.method.name = "lm_ens"
  with pytest.raises(ConfigError, match=r"config\.method\.name='lm_ens' is ens on text, but "
                                        r"config\.data\.name='mnist' is images data; use "
                                        r"config\.method\.name='ens'"):
    validation.validate(c)


def test_gmoe_has_the_fields_of_the_mixture_it_grows():
  image = methods.fields_for(config_lib.base_config("mnist", "gmoe"))
  text = methods.fields_for(config_lib.base_config("tiny_shakespeare", "gmoe"))
  assert "method.gating" in {f.path for f in image} and "method.router_noise" not in {
      f.path for f in image}
  assert {f.path for f in text} == {f"method.{k}" for k in RECORDED_METHOD_FIELDS["lm_gmoe"]
                                    if k != "name"}


# -- one loss --------------------------------------------------------------------------------------
def test_masked_cross_entropy_over_examples_and_over_tokens():
  logits = jax.random.normal(jax.random.key(0), (3, 5, 7))
  y = jax.random.randint(jax.random.key(1), (3, 5), 0, 7)
  mask = jnp.asarray([True, False, True])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  # Per sequence: the mean over the tokens of the real sequences.
  np.testing.assert_allclose(task_base.masked_cross_entropy(logits, y, mask),
                             (ce[0].sum() + ce[2].sum()) / 10, rtol=1e-6)
  np.testing.assert_allclose(task_base.masked_cross_entropy(logits, y, mask, summed=True),
                             ce[0].sum() + ce[2].sum(), rtol=1e-6)
  # Per example, and nothing from an all-padding batch.
  flat = task_base.masked_cross_entropy(logits[:, 0], y[:, 0], mask)
  np.testing.assert_allclose(flat, (ce[0, 0] + ce[2, 0]) / 2, rtol=1e-6)
  assert float(task_base.masked_cross_entropy(logits, y, jnp.zeros(3, bool))) == 0.0
  # The NLL of log-probabilities is the cross-entropy of their logits.
  np.testing.assert_allclose(task_base.nll(jax.nn.log_softmax(logits), y), ce, rtol=1e-5)


def test_the_text_loss_adds_the_weighted_balance_loss():
  task = tasks.TextTask(seq_len=5, balance_weight=0.25)
  logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
  y = jnp.zeros((2, 5), jnp.int32)
  mask = jnp.ones(2, bool)
  ce = task_base.masked_cross_entropy(logits, y, mask)
  np.testing.assert_allclose(task.loss(logits, y, mask, {"balance": jnp.float32(2.0)}),
                             ce + 0.5, rtol=1e-6)
  np.testing.assert_allclose(task.loss(logits, y, mask), ce, rtol=1e-6)
  with pytest.raises(ValueError, match="no weight for the backbone's auxiliary outputs"):
    tasks.ImageTask().loss(logits[:, 0], y[:, 0], mask, {"balance": 1.0})


# -- a task of its own -----------------------------------------------------------------------------
class BlobsTask(task_base.Task):
  """Three Gaussian blobs in 4 dimensions: points and their blob, made here."""

  name = "blobs"
  DATASETS = ("blobs",)
  BACKBONES = ("mlp",)
  FIELDS = (F.Field("data.spread", 0.3, F.number(0.0, open_lo=True), "the blobs' std"),)
  SUMMARY_STATS = (("final_nll", "final NLL", "{:.3f}"),)

  @classmethod
  def defaults(cls, c):
    c.model.name = "mlp"
    c.model.width = 8
    c.optimizer.name = "adam"
    c.optimizer.kwargs = {"learning_rate": 0.01}
    c.optimizer.weight_decay = 0.0
    c.train.augment = "none"
    c.stream.num_megabatches = 3
    c.train.batch_size = 16
    c.train.eval_batch_size = 64

  def __init__(self, spread=0.3):
    self.spread = spread

  @classmethod
  def from_config(cls, config):
    return cls(config.data.spread)

  def load(self, config, seeds):
    rng = np.random.default_rng(int(config.seed))
    centres = 2.0 * np.eye(3, 4, dtype=np.float32)

    def points(n):
      y = rng.integers(0, 3, n).astype(np.int32)
      return (centres[y] + self.spread * rng.normal(size=(n, 4))).astype(np.float32), y

    (tx, ty), (sx, sy) = points(int(config.data.train_subset) or 300), points(90)
    return types.SimpleNamespace(num_classes=3, train_x=tx, train_y=ty, test_x=sx,
                                 test_y=sy), [None] * len(seeds)

  def device_data(self, ds):
    return task_base.ArrayData(x=np.concatenate([ds.train_x, ds.test_x]),
                               y=np.concatenate([ds.train_y, ds.test_y]),
                               num_train=len(ds.train_y))

  def inputs(self, data, idx, rng=None):
    del rng
    return data.x[idx], data.y[idx]

  def record_metrics(self, nll_mean, flops):
    del flops
    return {"test_nll": float(nll_mean)}

  def summary(self, records):
    return {"final_nll": records[-1].extra["test_nll"]} if records else {}

  def progress(self, records):
    return "test_nll=%.3f" % records[-1].extra["test_nll"]


@pytest.fixture
def blobs():
  tasks.register(BlobsTask)
  yield BlobsTask
  del tasks.TASKS[BlobsTask.name], plugins.TASKS[BlobsTask.name]


def test_a_task_from_a_test_file_runs_sm_through_the_loop(blobs, tmp_path):
  c = config_lib.base_config("blobs", "sm")
  assert c.model.name == "mlp" and c.data.spread == 0.3  # the task's defaults and fields
  c.train.epochs, c.train.patience = 8, 8
  c.train.autotune = "rules"
  c.mesh.num_devices = 1
  c.checkpoint.enabled = False
  c.log.tensorboard = False
  wd = str(tmp_path / "run")
  summary = run_lib.run(c, wd)
  log = io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))
  assert [r["t"] for r in log] == [0, 1, 2, 3]
  assert log[-1]["test_error"] < 0.2 < log[0]["test_error"]
  assert log[-1]["test_nll"] < log[0]["test_nll"] < 2 * math.log(3)
  assert summary["final_nll"] == log[-1]["test_nll"] and summary["num_stages"] == 3
  with open(os.path.join(wd, "summary.json")) as f:
    assert json.load(f)["final_nll"] == summary["final_nll"]
  assert ("final_nll", "final NLL", "{:.3f}") in tasks.summary_stats()
  # A backbone the task does not list is refused, naming the ones it does.
  c.model.name = "vgg"
  with pytest.raises(ConfigError, match=r"config\.model\.name='vgg' cannot model blobs; "
                                        r"valid values: \['mlp'\]"):
    validation.validate(c)


def test_a_subset_field_beyond_the_data_takes_all_of_it_with_a_warning(caplog):
  with caplog.at_level("WARNING"):
    assert task_base.subset_size("train_subset", 500, 600, "training examples of 'x'") == 500
    assert task_base.subset_size("train_subset", 600, 600, "training examples of 'x'") == 600
  assert not caplog.text
  with caplog.at_level("WARNING"):
    assert task_base.subset_size("test_subset", 10**7, 600, "test examples of 'x'") == 600
  assert ("config.data.test_subset=10000000 asks for more than the 600 test examples of 'x': "
          "all 600 are used") in caplog.text


@requires_mnist
def test_image_subsets_beyond_the_data_set_use_all_of_it(caplog):
  from alma_jax.tasks import images as image_tasks  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config("mnist", "sm")
  c.data.train_subset, c.data.test_subset = 10**7, 20000
  with caplog.at_level("WARNING"):
    ds, subsets = image_tasks.load_data(c, [0, 1])
  assert len(ds.train_y) == 60000 and len(ds.test_y) == 10000
  assert [len(s) for s in subsets] == [60000, 60000]
  assert "config.data.train_subset=10000000 asks for more than the 60000 training examples of " \
         "'mnist': all 60000 are used" in caplog.text
  assert "config.data.test_subset=20000 asks for more than the 10000 test examples" in caplog.text
