"""Tests of the mega-batch partition (alma_jax/data/stream.py)."""

import numpy as np
import pytest

from alma_jax.data.stream import make_stream


@pytest.mark.parametrize("n,b", [(1000, 10), (1003, 7), (60000, 500)])
def test_partition_is_disjoint_covering_and_equal(n, b):
  s = make_stream(n, b, 0.1, seed=0)
  assert s.num_megabatches == b
  everything = np.concatenate(list(s.train) + list(s.val))
  assert len(everything) == n
  np.testing.assert_array_equal(np.sort(everything), np.arange(n))
  sizes = [len(t) + len(v) for t, v in zip(s.train, s.val)]
  assert max(sizes) - min(sizes) <= 1
  expected = [len(c) for c in np.array_split(np.arange(n), b)]
  assert sizes == expected


def test_ten_percent_validation():
  s = make_stream(60000, 500, 0.1, seed=0)
  for t, v in zip(s.train, s.val):
    assert len(v) == 12 and len(t) == 108


def test_seed_determinism():
  a = make_stream(5000, 10, 0.1, seed=3)
  b = make_stream(5000, 10, 0.1, seed=3)
  c = make_stream(5000, 10, 0.1, seed=4)
  for x, y in zip(a.train, b.train):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(a.train, c.train))


def test_megabatches_are_random_not_contiguous():
  s = make_stream(10000, 10, 0.1, seed=0)
  # A contiguous split would put indices 0..999 in the first mega-batch.
  assert s.train[0].max() - s.train[0].min() > 5000


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_examples=100, num_megabatches=0, val_fraction=0.1), "num_megabatches"),
    (dict(num_examples=10, num_megabatches=11, val_fraction=0.1), "num_megabatches"),
    (dict(num_examples=100, num_megabatches=5, val_fraction=0.0), "val_fraction"),
    (dict(num_examples=100, num_megabatches=5, val_fraction=1.0), "val_fraction"),
])
def test_bad_arguments_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    make_stream(seed=0, **kwargs)
