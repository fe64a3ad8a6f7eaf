"""A function's independent random draws hashed together (`alma_jax.runtime.fused_draws`):
the values of `jax.random` to the bit, one Threefry hash instead of one per draw."""

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from alma_jax import models
from alma_jax.engine import population
from alma_jax.runtime import fused_draws
from tests import helpers


def _many(key):
  """Draws of every kind the package makes, from keys derived in every way it derives them."""
  k = jax.random.split(key, 8)
  out = {
      "uniform": jax.random.uniform(k[0], (5, 7), jnp.float32, -0.3, 0.3),
      "normal": 0.5 * jax.random.normal(k[1], (3, 4, 6)),
      "truncated": jax.random.truncated_normal(jax.random.fold_in(k[2], 3), -2.0, 2.0, (33,)),
      "bernoulli": jax.random.bernoulli(k[3], 0.3, (17,)),
      "bits8": jax.random.bits(k[4], (10,), jnp.uint8),
      "bits16": jax.random.bits(k[4], (2, 3), jnp.uint16),
      "scalar": jax.random.normal(k[5], ()),
      # A key array: one draw per key (as under vmap), of a 1-D and a 2-D array of keys.
      "vmapped": jax.vmap(lambda kk: jax.random.uniform(kk, (4, 3)))(jax.random.split(k[6], 5)),
      "grid": jax.vmap(jax.vmap(lambda kk: jax.random.normal(kk, (2,))))(
          jax.random.split(k[7], (2, 3))),
      "constant_key": jax.random.normal(jax.random.key(11), (6,)),
      "dense": nn.Dense(9).init(k[0], jnp.zeros((1, 12)))["params"],
  }
  # A key computed from another draw's bits cannot be hashed with it: drawn on its own.
  later = jax.random.fold_in(k[1], jax.random.bits(k[2], (), jnp.uint32))
  out["dependent"] = jax.random.uniform(later, (8,))
  return out


def _primitives(fn, *args) -> dict[str, int]:
  """How many equations of each primitive `fn` traces to, nested calls included."""
  counts = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # a closed jaxpr
            walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return counts


def _assert_bitwise(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


@pytest.fixture(params=["suite", "runs"])
def compile_as(request):
  """Compiled as the suite compiles (most optimisations off) and as a run does."""
  if request.param == "suite":
    yield jax.jit
    return
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield helpers.jit_as_runs
  jax.config.update("jax_disable_most_optimizations", old)


def test_fused_draws_are_bitwise_those_of_jax_random(compile_as):
  key = jax.random.key(5)
  _assert_bitwise(compile_as(fused_draws.fuse_draws(_many))(key), compile_as(_many)(key))


def test_a_backbone_initialisation_is_bitwise_the_same(compile_as):
  net = models.make_backbone(
      ml_collections.ConfigDict({"name": "vgg", "width": 4, "conv_impl": "xla"}), 10)
  dummy = np.zeros((1, 32, 32, 3), np.float32)

  def init(k):
    return net.init(k, dummy, train=False)

  key = jax.random.key(2)
  _assert_bitwise(compile_as(fused_draws.fuse_draws(init))(key), compile_as(init)(key))


def test_independent_draws_share_one_hash_and_a_dependent_one_keeps_its_own():
  key = jax.random.key(0)
  plain = _primitives(_many, key)
  fused = _primitives(fused_draws.fuse_draws(_many), key)
  assert plain.get("threefry2x32", 0) == 0 and plain["random_bits"] == 13
  assert fused["threefry2x32"] == 1  # the 12 independent draws
  assert fused["random_bits"] == 1  # the draw whose key depends on another draw's bits


def test_draws_beyond_the_group_limit_are_hashed_in_several_groups(monkeypatch):
  monkeypatch.setattr(fused_draws, "MAX_GROUP", 64)
  key = jax.random.key(1)

  def fn(k):
    return [jax.random.normal(jax.random.fold_in(k, i), (40,)) for i in range(5)]

  assert _primitives(fused_draws.fuse_draws(fn), key)["threefry2x32"] == 5  # 40 + 40 > 64
  monkeypatch.setattr(fused_draws, "MAX_GROUP", 80)
  assert _primitives(fused_draws.fuse_draws(fn), key)["threefry2x32"] == 3  # 2 + 2 + 1
  _assert_bitwise(jax.jit(fused_draws.fuse_draws(fn))(key), jax.jit(fn)(key))


def test_what_cannot_be_fused_is_evaluated_as_given():
  # Another key implementation, a single draw, and a function with a side effect.
  rbg = jax.random.key(3, impl="rbg")
  fns = {
      "rbg": (lambda k: [jax.random.normal(k, (4,)), jax.random.uniform(k, (3,))], rbg),
      "single": (lambda k: jax.random.normal(k, (4,)) + 1.0, jax.random.key(3)),
      "effect": (lambda k: (jax.debug.callback(lambda: None),
                            jax.random.normal(k, (4,)), jax.random.uniform(k, (3,)))[1:],
                 jax.random.key(3)),
  }
  for name, (fn, key) in fns.items():
    fused = _primitives(fused_draws.fuse_draws(fn), key)
    assert fused.get("threefry2x32", 0) == 0, name
    assert fused == _primitives(fn, key), name
    _assert_bitwise(jax.jit(fused_draws.fuse_draws(fn))(key), jax.jit(fn)(key))


def test_a_jax_whose_jaxprs_it_cannot_read_gets_the_draws_one_by_one_and_a_warning(
    monkeypatch, caplog):
  # `jax.extend` promises no stability across JAX releases: a name gone or a jaxpr of another
  # shape leaves the values as they are, each draw hashed alone, and says so once.
  key = jax.random.key(5)
  expected = jax.jit(_many)(key)

  def unreadable(*args):
    raise AttributeError("module 'jax.extend.core.primitives' has no attribute 'jit_p'")

  monkeypatch.setattr(fused_draws, "_warned", [])
  monkeypatch.setattr(fused_draws, "_flatten", unreadable)
  with caplog.at_level("WARNING"):
    fused = fused_draws.fuse_draws(_many)
    _assert_bitwise(jax.jit(fused)(key), expected)
    assert _primitives(fused, key) == _primitives(_many, key)  # as `_many` traced
    jax.jit(fused_draws.fuse_draws(lambda k: _many(k)["dense"]))(key)
  warnings = [r.getMessage() for r in caplog.records if "hashed one by one" in r.getMessage()]
  assert len(warnings) == 1 and "has no attribute 'jit_p'" in warnings[0], warnings
  assert f"jax {jax.__version__}'s jaxprs" in warnings[0]
  # A module that could not import its names hands the function back as it is.
  code = ("import sys; sys.modules['jax.extend.core.primitives'] = None; "
          "from alma_jax.runtime import fused_draws; f = lambda k: k; "
          "print(fused_draws._UNAVAILABLE); assert fused_draws.fuse_draws(f) is f")
  proc = subprocess.run([sys.executable, "-c", code], cwd=helpers.ROOT, capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("ModuleNotFoundError: ") and "hashed one by one" in proc.stderr


@pytest.mark.parametrize("dataset,name", [("mnist", "sm"), ("mnist", "gmoe"), ("mnist", "ff"),
                                          ("mnist", "gens"), ("cifar10", "umix")])
def test_a_population_s_initialisation_hashes_its_draws_together(dataset, name):
  """Every method's initial learners (`population.initial`), nested programs included: no
  draw of its own (traced only, nothing compiled)."""
  method = helpers.cached_method(name, dataset)
  init = population._init_members  # pylint: disable=protected-access
  counts = _primitives(lambda k: init(method, k), population.keys([0, 1]))
  assert counts.get("random_bits", 0) == 0, counts
  assert counts["threefry2x32"] >= 1
