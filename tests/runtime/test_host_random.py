"""PRNG keys, folds and permutations made on the host (`alma_jax.runtime.host_random`): the
bits of `jax.random`, and no compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import random as jrandom

from alma_jax.runtime import host_random
from tests import helpers

SEEDS = (0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1)
MESSAGES = (0, 1, 3, 2**31, 2**32 - 1)


def _data(keys) -> np.ndarray:
  return np.asarray(jax.random.key_data(keys))


def test_the_hash_is_jax_s_threefry_2x32():
  rng = np.random.default_rng(0)
  words = rng.integers(0, 2**32, (4, 500), dtype=np.uint64).astype(np.uint32)
  words[:, :4] = [[0, 0, 2**32 - 1, 2**32 - 1]] * 4  # the ends of the range, where sums wrap
  expected = jrandom.threefry2x32_p.bind(*(jnp.asarray(w) for w in words))
  for got, want in zip(host_random.threefry2x32(*words), expected):
    assert got.dtype == np.uint32 and got.shape == (500,)
    np.testing.assert_array_equal(got, np.asarray(want))
  # Scalars broadcast against arrays, as the counters of a fold do.
  y0, y1 = host_random.threefry2x32(words[0, 5], words[1, 5], 0, words[3])
  z0, z1 = jrandom.threefry2x32_p.bind(*(jnp.broadcast_to(jnp.asarray(w), (500,)) for w in (
      words[0, 5], words[1, 5], np.uint32(0), words[3])))
  np.testing.assert_array_equal(y0, np.asarray(z0))
  np.testing.assert_array_equal(y1, np.asarray(z1))


def test_seed_keys_are_jax_random_keys():
  keys = host_random.seed_keys(SEEDS)
  assert jax.random.key_impl(keys) == jax.random.key_impl(jax.random.key(0))
  np.testing.assert_array_equal(_data(keys), np.stack([_data(jax.random.key(s)) for s in SEEDS]))
  # Seeds outside 0 .. 2^32-1 and no seeds are left to JAX.
  assert host_random.seed_keys([-1]) is None and host_random.seed_keys([2**32]) is None
  assert host_random.seed_keys([]) is None


def test_seed_keys_of_another_default_implementation_are_left_to_jax():
  old = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")
  try:
    assert host_random.seed_keys([3]) is None
  finally:
    jax.config.update("jax_default_prng_impl", old)


@pytest.mark.parametrize("seed", SEEDS)
def test_folds_are_jax_random_fold_in(seed):
  key = jax.random.key(seed)
  for i in MESSAGES:
    folded = host_random.fold_in(key, i)
    assert folded.shape == () and jax.random.key_impl(folded) == jax.random.key_impl(key)
    np.testing.assert_array_equal(_data(folded), _data(jax.random.fold_in(key, np.uint32(i))))


def test_a_fold_it_cannot_make_on_the_host_is_jax_s():
  # A traced key (inside a program), a key of another implementation, and raw key data.
  key = jax.random.key(4)
  traced = jax.jit(lambda k: host_random.fold_in(k, 9))(key)
  np.testing.assert_array_equal(_data(traced), _data(jax.random.fold_in(key, 9)))
  rbg = jax.random.key(4, impl="rbg")
  np.testing.assert_array_equal(_data(host_random.fold_in(rbg, 9)),
                                _data(jax.random.fold_in(rbg, 9)))
  raw = jax.random.PRNGKey(4)
  np.testing.assert_array_equal(np.asarray(host_random.fold_in(raw, 9)),
                                np.asarray(jax.random.fold_in(raw, 9)))
  with pytest.raises(OverflowError):  # as a uint32 conversion refuses it
    host_random.fold_in(key, -1)
  with pytest.raises(ValueError, match="accepts a single key"):  # as JAX refuses key arrays
    host_random.fold_in(jax.random.split(key, 2), 1)


@pytest.mark.parametrize("seed", [0, 5, 2**32 - 1])
def test_permutations_are_jax_random_permutation(seed):
  key = jax.random.key(seed)
  # 1625 is the last length sorted once (1625^3 < 2^32 - 1 < 1626^3); 0 and 1 sort no time.
  for n in (0, 1, 2, 7, 1625, 1626, 5000, 60000):
    got, want = host_random.permutation(key, n), np.asarray(jax.random.permutation(key, n))
    assert got.dtype == want.dtype and got.shape == (n,)
    np.testing.assert_array_equal(got, want)


def test_a_permutation_it_cannot_make_on_the_host_is_none():
  assert host_random.permutation(jax.random.key(1, impl="rbg"), 10) is None
  assert host_random.permutation(jax.random.split(jax.random.key(1), 2), 10) is None
  assert jax.jit(lambda k: jnp.int32(host_random.permutation(k, 10) is None))(
      jax.random.key(1)) == 1  # traced


def test_keys_folds_and_permutations_build_no_program():
  names = helpers.compiled_in_a_new_process("""
      import numpy as np
      from alma_jax.runtime import host_random
  """, """
      keys = host_random.seed_keys((3, 4))
      data = np.asarray(jax.random.key_data(keys))
      key = host_random.fold_in(host_random.fold_in(jax.random.wrap_key_data(data[1]), 5), 2)
      assert len(host_random.permutation(key, 3000)) == 3000
  """)
  assert names == [], names
