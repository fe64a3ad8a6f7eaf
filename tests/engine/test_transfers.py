"""Tests that a stage's compiled calls stay on the device (alma_jax/engine/programs.py, train.py).

A train or evaluation call must receive its device arrays already placed (the
state a call returns, the resident data, the stage's keys) and make no
implicit transfer inside the call (`jax.transfer_guard("disallow")` raises on
one), except the one it makes on purpose: the host values of the call (a
batch's indices and mask, the call's counter) go in through the program's
dispatch (`sharding.put_args`), never through `jax.device_put`. A second stage
of the same structure must compile nothing at all, and the donated train state
must really be reused (XLA warns "Some donated buffers were not usable" when
it is not; here that warning is an error).
"""

import warnings

import jax
import numpy as np
import pytest

from alma_jax.engine import population
from alma_jax.engine import programs as programs_lib
from alma_jax.engine import sharding
from alma_jax.engine import timing
from alma_jax.engine import train
from tests import helpers

DONATION_WARNING = "Some donated buffers were not usable"


@pytest.fixture
def guarded_calls(monkeypatch):
  """Every compiled program call runs under `jax.transfer_guard("disallow")`, its host
  arguments must be integers or booleans (indices, masks, counters: no parameters or data
  left on the host), and it must place nothing with `jax.device_put`; returns the number of
  calls made so far and of the values they placed (a list of two ints)."""
  counts = [0, 0]
  call, place = programs_lib.Program.__call__, sharding._place  # pylint: disable=protected-access
  inside = [False]

  def guarded(self, *args):
    counts[0] += 1
    host = [np.asarray(x).dtype for x in jax.tree.leaves(args) if not isinstance(x, jax.Array)]
    assert all(d.kind in "biu" for d in host), host
    inside[0] = True
    try:
      with jax.transfer_guard("disallow"):
        return call(self, *args)
    finally:
      inside[0] = False

  def counted_place(x, s):
    counts[1] += inside[0]
    return place(x, s)

  monkeypatch.setattr(programs_lib.Program, "__call__", guarded)
  monkeypatch.setattr(sharding, "_place", counted_place)
  return counts


@pytest.mark.parametrize("dataset, method, members", [
    ("mnist", "sm", 1), ("mnist", "ens", 2), ("mnist", "gmoe", 1), ("cifar10", "sm", 1)])
def test_stages_transfer_nothing_implicitly_and_compile_once(guarded_calls, dataset, method,
                                                             members):
  shape = (32, 32, 3) if dataset == "cifar10" else (28, 28, 1)
  ds = helpers.synthetic_dataset(n_train=300, n_test=64, shape=shape)
  c = helpers.small_config(dataset, method, width=4, batch_size=32, eval_batch_size=64)
  if method == "ens":
    c.method.num_members = members
  m, steps = helpers.make_steps(c, ds)
  # As in a run: the learner is placed before a stage and after it (`run.py`).
  learner = steps.place(population.stack([helpers.init(m)]))
  train_idx = np.arange(200, dtype=np.int32)[None]
  val_idx = np.arange(200, 300, dtype=np.int32)[None]
  keys = population.stack_keys([jax.random.key(1)])

  def stage(learner, t):
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message=DONATION_WARNING)
      out, _, stats = train.fit_stage(
          steps, learner, train.StageData(train_idx, val_idx, population.fold(keys, t), t))
    assert stats.epochs_run.tolist() == [2]
    return steps.place(out)

  learner = stage(learner, 1)
  compiled, xla_programs = steps.compiled, timing.compile_counts()["xla_programs"]
  calls = guarded_calls[0]
  stage(learner, 2)
  # Two epochs of >= 2 train calls (ceil(200 / 32) steps) and one validation call each.
  assert guarded_calls[0] - calls >= 2 * (2 + 1)
  assert guarded_calls[1] == 0  # no call placed a value itself: all were placed, or host values
  assert steps.compiled == compiled
  assert timing.compile_counts()["xla_programs"] == xla_programs


def test_a_train_call_reuses_the_donated_state():
  ds = helpers.synthetic_dataset(n_train=64, n_test=16)
  m, steps = helpers.make_steps(helpers.small_config(width=4, batch_size=16), ds)
  learner = steps.place(population.stack([helpers.init(m)]))
  state = steps.init_state(learner)
  d, k = m.num_data_orders(learner.structure), steps.steps_per_call
  batch = programs_lib.Batch(np.zeros((1, k, d, 16), np.int32), np.ones((1, k, d, 16), bool))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=DONATION_WARNING)
    new, _, _ = steps.train_call(learner.structure, state, batch,
                                 population.stack_keys([jax.random.key(0)]), np.uint32(0))
  # XLA wrote the new state into the donated buffers: the old arrays are gone.
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(learner))  # copied, not donated
