"""Tests of the mesh, the logical-axis rules and the sharded steps (alma_jax/engine/sharding.py,
steps.py, multihost.py)."""

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from alma_jax.engine import population
from alma_jax.engine import sharding
from alma_jax.engine import train
from alma_jax.errors import ConfigError
from alma_jax.methods import ensemble
from alma_jax.methods import gmoe
from alma_jax.runtime import multihost
from tests import helpers

DATA = helpers.synthetic_dataset(n_train=160, n_test=64)
TRAIN_IDX, VAL_IDX = np.arange(128, dtype=np.int32), np.arange(128, 160, dtype=np.int32)
TEST_IDX = np.arange(64, dtype=np.int32)
MESHES = {"1 device": (1, 1), "8 data": (8, 1), "4 data x 2 model": (8, 2)}  # devices, model
# Per method: its options, and the expected partition of a few train-state leaves on the
# 4 x 2 mesh (path -> spec; the population axis comes first).
CASES = {
    "sm": ({}, {".trainable['dense0']['kernel']": P()}),
    # 3 members do not divide the 2-way model axis: replicated, with a warning.
    "ens": ({"num_members": 3}, {".trainable['dense0']['kernel']": P()}),
    "umix": ({"num_members": 2}, {".trainable['dense0']['kernel']": P(None, "model"),
                                  ".opt_state[1].e_g['head']['bias']": P(None, "model")}),
    # Grown from 2 to 3 members (4 slots) before the stage: the slots split, the 1 trained
    # member replicated; frozen members are not in the train state.
    "gens": ({"initial_members": 2}, {".model_state['slots']['active']": P(None, "model"),
                                      ".trainable['dense0']['kernel']": P()}),
    "gmoe": ({"initial_experts": 2}, {".trainable['mix0']['experts']['dense']['kernel']":
                                      P(None, "model"),
                                      ".trainable['mix0']['gates']['kernel']": P()}),
}


def _specs(state) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): x.sharding.spec for p, x in leaves}


def _stage(name: str, num_devices: int, model: int):
  """One stage of `name` on a mesh: (best learner, facts to compare, train state, steps)."""
  c = helpers.small_config(method=name, width=4, batch_size=32, eval_batch_size=32)
  for k, v in CASES[name][0].items():
    c.method[k] = v
  method, steps = helpers.make_steps(c, DATA, num_devices, model)
  traces, loss = [], method.loss
  method.loss = lambda *a: traces.append(a) or loss(*a)
  learner = helpers.random_learner(method)
  if name == "gens":
    learner = ensemble.add_member(learner, jax.random.key(5), init="copy")
  best, _, stats = train.fit_one(steps, learner, TRAIN_IDX, VAL_IDX, jax.random.key(1))
  assert len(traces) == 1  # 2 epochs of 4 steps: one trace of the train step
  acc, nll = steps.evaluate(population.stack([best]), "test", TEST_IDX)
  facts = (stats.epochs_run, stats.best_epoch, stats.best_val_accuracy, acc, nll)
  return best, facts, steps.init_state(population.stack([best])), steps


@pytest.mark.parametrize("name", sorted(CASES))
def test_meshes_give_the_same_parameters_and_metrics(name, caplog):
  out = {}
  with jax.enable_x64(True), caplog.at_level("WARNING"):  # see helpers.float64
    for mesh, (num_devices, model) in MESHES.items():
      caplog.clear()
      out[mesh] = _stage(name, num_devices, model)
      if mesh == "4 data x 2 model":
        warned = caplog.text
    if name == "gmoe":
      _check_growth(*out["4 data x 2 model"])
  (ref, ref_facts, _, _) = out["1 device"]
  for mesh in ("8 data", "4 data x 2 model"):
    best, facts, state, steps = out[mesh]
    chex.assert_trees_all_close(best.params, ref.params, atol=1e-9, rtol=1e-9)
    chex.assert_trees_all_close(best.model_state, ref.model_state, atol=1e-9, rtol=1e-9)
    for a, b in zip(facts, ref_facts):
      np.testing.assert_allclose(a, b, atol=1e-9, rtol=1e-9)
    assert dict(steps.mesh.shape) == {"data": 8 // MESHES[mesh][1], "model": MESHES[mesh][1]}
    specs = _specs(state)
    for path, spec in CASES[name][1].items():
      assert specs[path] == (spec if mesh == "4 data x 2 model" else P()), (mesh, path)
    train_batch = next(v for k, v in steps.programs.cache.items() if k[0] == "train").in_shardings[2]
    assert train_batch.idx.spec[-1] == "data"  # the batch is split over the data axis
  if name == "ens":
    assert "['dense0']['kernel'] (dimension 1, member, size 3 on model=2)" in warned
  elif name in ("sm", "umix"):
    assert "do not divide" not in warned


def _check_growth(best, facts, state, steps):
  """After a split, the programs of the new structure get the shardings of its shapes."""
  grown = gmoe.split_expert(best, 0, 1, jax.random.key(2))  # layer 0: 3 experts in 4 slots
  after, _ = steps.evaluate(population.stack([grown]), "test", TEST_IDX)
  placed = steps.place(population.stack([grown]))
  assert after == pytest.approx(facts[3])  # a tree split keeps the function
  assert len({k[1] for k in steps.compiled if k[0] == "eval"}) == 2  # one program per structure
  assert state.trainable["mix0"]["experts"]["dense"]["kernel"].sharding.spec == P(None, "model")
  assert placed.params["mix0"]["experts"]["dense"]["kernel"].sharding.spec == P(None, "model")
  assert grown.params["mix0"]["experts"]["dense"]["kernel"].shape[0] == 4
  assert placed.params["mix1"]["experts"]["dense"]["kernel"].sharding.spec == P(None, "model")


def test_population_axis_on_data_matches_one_device():
  keys = population.stack_keys([jax.random.key(1), jax.random.key(2)])
  train_idx, val_idx = np.stack([TRAIN_IDX, TRAIN_IDX[::-1]]), np.stack([VAL_IDX, VAL_IDX])
  out = []
  with jax.enable_x64(True):
    for num_devices, model in ((1, 1), (8, 4)):  # 2 data x 4 model: one seed per data slice
      c = helpers.small_config(width=4, batch_size=32, eval_batch_size=32)
      c.mesh.rules = {"population": "data"}
      method, steps = helpers.make_steps(c, DATA, num_devices, model)
      learners = population.stack([helpers.random_learner(method, s) for s in (3, 4)])
      best, _, stats = train.fit_stage(steps, learners, train.StageData(train_idx, val_idx, keys))
      out.append((best.params, stats.best_val_accuracy, steps.init_state(best)))
  chex.assert_trees_all_close(out[0][0], out[1][0], atol=1e-9, rtol=1e-9)
  np.testing.assert_allclose(out[0][1], out[1][1])
  assert out[1][2].trainable["dense0"]["kernel"].sharding.spec == P("data")


@pytest.mark.parametrize("num_devices, data, model, shape", [
    (0, 0, 1, (8, 1)), (0, 0, 2, (4, 2)), (0, 4, 2, (4, 2)), (8, 0, 4, (2, 4)), (1, 0, 1, (1, 1)),
    (0, 2, 1, (2, 1))])
def test_mesh_shape_from_the_config_fields(num_devices, data, model, shape):
  assert sharding.mesh_shape(num_devices, data, model, 8) == shape
  mesh = sharding.make_mesh(num_devices, data, model)
  assert mesh.axis_names == ("data", "model") and tuple(mesh.devices.shape) == shape
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


@pytest.mark.parametrize("num_devices, data, model, message", [
    (0, 0, 3, r"config\.mesh\.model=3 does not divide the 8 devices"),
    (0, 3, 3, r"config\.mesh\.num_devices=9 \(config\.mesh\.data=3 x config\.mesh\.model=3\) "
     r"but only 8 devices are visible"),
    (4, 4, 2, r"config\.mesh\.data=4 x config\.mesh\.model=2 != 4 devices"),
    (16, 0, 1, r"config\.mesh\.num_devices=16 .*only 8 devices are visible")])
def test_mesh_shapes_that_do_not_fit_name_the_fields(num_devices, data, model, message):
  with pytest.raises(ConfigError, match=message):
    sharding.mesh_shape(num_devices, data, model, 8)


def test_rules_are_checked_and_a_mesh_axis_shards_one_dimension(caplog):
  with pytest.raises(ConfigError, match=r"config\.mesh\.rules\.members is unknown"):
    sharding.check_rules({"members": "model"})
  with pytest.raises(ConfigError, match=r"config\.mesh\.rules\.batch='x' is unknown"):
    sharding.check_rules({"batch": "x"})
  layout = sharding.Layout(sharding.make_mesh(8), {"population": "data"})
  axes = ("population", None, None, "batch")
  assert layout.sharding((8, 1, 1, 32), axes, "batch").spec == P("data")  # data used once
  with caplog.at_level("WARNING"):
    assert layout.sharding((2, 1, 1, 32), axes, "batch").spec == P(None, None, None, "data")
    assert "batch (dimension 0, population, size 2 on data=8)" in caplog.text
    caplog.clear()
    layout.sharding((2, 1, 1, 32), axes, "batch")
  assert "do not divide" not in caplog.text  # one warning per leaf


def test_put_places_copies_and_keeps_placed_arrays():
  layout = sharding.Layout(sharding.make_mesh(8))
  s = layout.sharding((16, 3), ("batch",), "x")
  x = sharding.put(np.arange(48.0).reshape(16, 3), s)
  assert x.sharding == s and len(x.addressable_shards) == 8
  assert sharding.put(x, s) is x
  y = sharding.put(x, s, copy=True)
  pointers = lambda a: {b.data.unsafe_buffer_pointer() for b in a.addressable_shards}
  assert y.sharding == s and not pointers(x) & pointers(y)
  one = jax.device_put(np.ones(3))  # on one device: a replicated copy shares no buffer with it
  assert not pointers(one) & pointers(sharding.put(one, layout.replicated, copy=True))
  key = sharding.put(jax.random.key(0), layout.replicated)
  assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.sharding.spec == P()


def test_put_args_leaves_host_values_to_the_program_and_places_device_arrays(monkeypatch):
  layout = sharding.Layout(sharding.make_mesh(8))
  s = layout.sharding((16, 3), ("batch",), "x")
  host, counter = np.arange(48.0).reshape(16, 3), np.uint32(7)
  unplaced = jax.device_put(np.ones((16, 3)))  # one device, uncommitted
  out = sharding.put_args((host, counter, unplaced), (s, layout.replicated, s))
  assert out[0] is host and out[1] is counter
  assert out[2].sharding == s and len(out[2].addressable_shards) == 8
  program = jax.jit(lambda a, c, b: a * c + b, in_shardings=(s, layout.replicated, s))
  with jax.transfer_guard_host_to_device("allow"):  # as `Program` calls it
    got = program(*out)
  assert got.sharding == s  # the program placed its host arguments itself
  np.testing.assert_array_equal(np.asarray(got), host * 7 + 1)
  # Several processes: every value is placed (a host value becomes a global array).
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(sharding, "put", lambda tree, shardings: ("put", tree))
  assert sharding.put_args((host,), (s,)) == ("put", (host,))


@pytest.mark.parametrize("setting, flag, env, want", [
    ("auto", False, {}, False),
    ("auto", True, {}, True),
    ("yes", False, {}, True),
    ("no", False, {"ALMA_JAX_DISTRIBUTED": "1"}, False),
    ("auto", False, {"ALMA_JAX_DISTRIBUTED": "1"}, True),
    ("auto", False, {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}, True),
    ("auto", False, {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}, False),
    ("auto", False, {"SLURM_NTASKS": "8"}, False),  # the batch script, not an srun step
    ("auto", False, {"OMPI_COMM_WORLD_SIZE": "4"}, True),
    ("auto", False, {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, True),
    ("auto", False, {"TPU_WORKER_HOSTNAMES": "w0"}, False)])
def test_distributed_starts_when_the_config_or_the_cluster_asks(setting, flag, env, want):
  assert multihost.wanted(setting, flag, env)[0] == want
