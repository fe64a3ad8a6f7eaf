"""Tests of the per-step checkpoints (alma_jax/outputs/checkpoint.py)."""

import contextlib
import gc
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from alma_jax.engine import sharding
from alma_jax.methods.base import Learner
from alma_jax.outputs import checkpoint
from tests import helpers

STRUCTURE = (("tree", ("node", 0, ("leaf", 1), ("leaf", 2))), 3, "members", ())


def _learner(seed=0, width=3):
  """A learner with nested params, BatchNorm-like statistics and a nested structure."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  params = {"members": {"dense": {"kernel": f(2, 5, width), "bias": f(2, width)}},
            "gate": {"kernel": f(width, 2)}}
  model_state = {"batch_stats": {"block0": {"mean": f(width), "var": jnp.exp(f(width))}}}
  return Learner(params=params, model_state=model_state, structure=STRUCTURE)


def _tx():
  return optax.chain(optax.add_decayed_weights(1e-4), optax.adam(1e-3))


def _build_target(learner):
  """A target builder that rebuilds the shapes of `learner` for its structure."""
  replicated = sharding.replicated(sharding.make_mesh(1))

  def build(structure, has_opt_state):
    assert structure == learner.structure
    tree = {"params": learner.params, "model_state": learner.model_state,
            "key": jax.random.key_data(jax.random.key(0))}
    if has_opt_state:
      tree["opt_state"] = _tx().init(learner.params)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        tree)

  return build


def _save_steps(directory, steps, max_to_keep=5):
  learner = _learner()
  opt_state = _tx().init(learner.params)
  # a non-trivial optimizer state: one update
  grads = jax.tree.map(jnp.ones_like, learner.params)
  _, opt_state = _tx().update(grads, opt_state, learner.params)
  with checkpoint.Checkpointer(directory, max_to_keep) as ckpt:
    for t in steps:
      records = [{"t": i, "test_error": 0.5 + 0.01 * i} for i in range(t + 1)]
      ckpt.save(t, learner, opt_state, np.array([t, 7], np.uint32), records, {"compiled": ["x"]})
  return learner, opt_state


def test_structure_json_round_trip_gives_the_same_hashable_tuple():
  obj = checkpoint.structure_to_json(STRUCTURE)
  back = checkpoint.structure_from_json(obj)
  assert back == STRUCTURE and isinstance(back, tuple) and hash(back) == hash(STRUCTURE)
  assert isinstance(obj, list) and isinstance(obj[0][1], list)
  with pytest.raises(TypeError, match="structure may hold only"):
    checkpoint.structure_to_json((1, {"a": 2}))


def test_save_restore_round_trip_is_bitwise(tmp_path):
  learner, opt_state = _save_steps(str(tmp_path / "ckpt"), [0, 2])
  with checkpoint.Checkpointer(str(tmp_path / "ckpt"), 5) as ckpt:
    assert ckpt.steps() == [0, 2]
    snap = ckpt.restore_latest(_build_target(learner))
  assert snap.t == 2 and snap.learner.structure == STRUCTURE
  chex.assert_trees_all_equal(snap.learner.params, learner.params)
  chex.assert_trees_all_equal(snap.learner.model_state, learner.model_state)
  chex.assert_trees_all_equal(snap.opt_state, opt_state)
  chex.assert_trees_all_equal_structs(snap.opt_state, opt_state)  # optax named tuples
  np.testing.assert_array_equal(snap.key_data, [2, 7])
  assert [r["t"] for r in snap.records] == [0, 1, 2] and snap.extra == {"compiled": ["x"]}


def test_without_optimizer_state_and_max_to_keep(tmp_path):
  learner = _learner()
  with checkpoint.Checkpointer(str(tmp_path), 2) as ckpt:
    for t in range(4):
      ckpt.save(t, learner, None, np.zeros(2, np.uint32), [{"t": t}])
    assert ckpt.steps() == [2, 3]
    snap = ckpt.restore(3, _build_target(learner))
  assert snap.opt_state is None
  chex.assert_trees_all_equal(snap.learner.params, learner.params)


def _corrupt_state(step_dir):
  """Overwrites every data file of the `state` item with garbage."""
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"\x00garbage")


def test_corrupt_latest_falls_back_to_the_previous_one(tmp_path):
  directory = str(tmp_path / "ckpt")
  learner, _ = _save_steps(directory, [0, 1, 2])
  _corrupt_state(os.path.join(directory, "2"))
  quarantine = str(tmp_path / "bad")
  with _nothing_left_to_report(), checkpoint.Checkpointer(directory, 5) as ckpt:
    snap = ckpt.restore_latest(_build_target(learner), quarantine_dir=quarantine)
    assert snap.t == 1 and ckpt.steps() == [0, 1]
  chex.assert_trees_all_equal(snap.learner.params, learner.params)
  assert len(os.listdir(quarantine)) == 1  # kept aside, not deleted


def test_all_checkpoints_corrupt_is_a_clear_error(tmp_path):
  directory = str(tmp_path / "ckpt")
  learner, _ = _save_steps(directory, [0, 1])
  with open(os.path.join(directory, "1", "meta", "metadata"), "w") as f:
    f.write("{not json")
  _corrupt_state(os.path.join(directory, "0"))
  with _nothing_left_to_report(), checkpoint.Checkpointer(directory, 5) as ckpt:
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .* can be restored "
                                                         r"\(step 1: .*; step 0: "):
      ckpt.restore_latest(_build_target(learner))
    assert ckpt.steps() == [0, 1]  # nothing removed when nothing restores


@contextlib.contextmanager
def _nothing_left_to_report():
  """Fails when a failed restore leaves work behind that reports an ignored exception later:
  the reads of the other arrays that it abandoned, closed whenever the garbage collector
  gets to them, during whatever runs next."""
  with helpers.unraisable_reports() as reports:
    yield
  assert not reports, helpers.describe_reports(reports)


def test_shape_mismatch_is_incompatible(tmp_path):
  _save_steps(str(tmp_path), [0])
  wider = _learner(width=4)
  with _nothing_left_to_report(), checkpoint.Checkpointer(str(tmp_path), 5) as ckpt:
    with pytest.raises(checkpoint.IncompatibleCheckpointError,
                       match=r"does not fit .*\['batch_stats'\]\['block0'\]\['mean'\]: "
                             r"float32\[3\] != float32\[4\]; .* \(\+8 more\)"):
      ckpt.restore(0, _build_target(wider))


def test_shape_mismatch_of_a_save_without_shapes_is_incompatible(tmp_path, monkeypatch):
  """Saves of earlier versions list no shapes: orbax's read finds the mismatch."""
  with monkeypatch.context() as m:
    m.setattr(checkpoint, "tree_shapes", lambda tree: {})
    _save_steps(str(tmp_path), [0])
  with checkpoint.Checkpointer(str(tmp_path), 5) as ckpt:
    assert ckpt.read_meta(0)["shapes"] == {}
    with pytest.raises(checkpoint.IncompatibleCheckpointError,
                       match="does not fit .* is not compatible with the stored shape"):
      ckpt.restore(0, _build_target(_learner(width=4)))
  # orbax leaves its failed read's tasks behind; collected here, their "never retrieved"
  # records stay with this test instead of reaching a later one that checks its log.
  gc.collect()
