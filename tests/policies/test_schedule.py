"""Tests of Algorithm 1's schedule: waiting time and replay."""

import numpy as np
import pytest

from alma_jax.data.stream import make_stream
from alma_jax.policies import schedule


@pytest.mark.parametrize("b,w,expected", [
    (10, 1, list(range(1, 11))),
    (10, 2, [2, 4, 6, 8, 10]),
    (10, 5, [5, 10]),
    (10, 10, [10]),
    (500, 50, list(range(50, 501, 50))),
])
def test_training_times(b, w, expected):
  assert schedule.training_times(b, w) == expected


@pytest.mark.parametrize("w", [3, 4, 7, 0, -1])
def test_wait_must_divide(w):
  with pytest.raises(ValueError, match="config.stream.wait"):
    schedule.training_times(10, w)


def test_no_replay_forgets():
  s = make_stream(1000, 10, 0.1, seed=0)
  st = schedule.stage_data(s, 6, 2, 0.0, seed=0)
  assert st.new_megabatches == (5, 6)
  np.testing.assert_array_equal(np.sort(st.train), np.sort(np.concatenate([s.train[4], s.train[5]])))
  np.testing.assert_array_equal(np.sort(st.val), np.sort(np.concatenate([s.val[4], s.val[5]])))
  assert st.num_replayed == 0


def test_full_replay_keeps_everything_seen():
  s = make_stream(1000, 10, 0.1, seed=0)
  st = schedule.stage_data(s, 6, 2, 1.0, seed=0)
  seen = np.concatenate(s.train[:6])
  np.testing.assert_array_equal(np.sort(st.train), np.sort(seen))
  assert st.num_replayed == sum(len(x) for x in s.train[:4])


@pytest.mark.parametrize("replay", [0.25, 0.5])
def test_partial_replay_fraction(replay):
  s = make_stream(2000, 10, 0.1, seed=0)
  st = schedule.stage_data(s, 5, 1, replay, seed=0)
  past = np.concatenate(s.train[:4])
  assert st.num_replayed == round(replay * len(past))
  replayed = np.setdiff1d(st.train, s.train[4])
  assert np.isin(replayed, past).all()
  assert len(np.unique(st.train)) == len(st.train)
  again = schedule.stage_data(s, 5, 1, replay, seed=0)
  np.testing.assert_array_equal(st.train, again.train)


def test_replay_out_of_range():
  s = make_stream(100, 4, 0.1, seed=0)
  with pytest.raises(ValueError, match="config.stream.replay"):
    schedule.stage_data(s, 2, 1, 1.5, seed=0)


def test_a_stage_trains_on_the_megabatches_since_the_previous_one():
  s = make_stream(1000, 10, 0.1, seed=0)
  fixed = schedule.stage_data(s, 6, 2, 0.5, seed=0)
  after_4 = schedule.stage_data(s, 6, 2, 0.5, seed=0, previous=4)
  np.testing.assert_array_equal(fixed.train, after_4.train)  # the fixed wait's rule
  np.testing.assert_array_equal(fixed.val, after_4.val)
  st = schedule.stage_data(s, 6, 2, 0.0, seed=0, previous=1)  # any times: not a multiple of w
  assert st.new_megabatches == (2, 3, 4, 5, 6)
  np.testing.assert_array_equal(np.sort(st.train), np.sort(np.concatenate(s.train[1:6])))
  with pytest.raises(ValueError, match="cannot follow one at t=6"):
    schedule.stage_data(s, 6, 2, 0.0, seed=0, previous=6)
