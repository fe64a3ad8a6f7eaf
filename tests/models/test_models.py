"""Initialisation schemes of the backbones and mixtures (`config.model.init`), and the
fidelity options declared beside them (SGD's `nesterov`, `train.patience_delta`)."""

import hashlib
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from absl import flags
from ml_collections import config_flags

from alma_jax import models
from alma_jax.configuration import config_lib
from alma_jax.engine import optim
from alma_jax.errors import ConfigError
from alma_jax.models import moe
from alma_jax.runtime import fused_draws
from alma_jax.stream import validation
from tests import helpers

ROOT = helpers.ROOT
MNIST_SHAPE = (28, 28, 1)
CIFAR_SHAPE = (32, 32, 3)


def model_config(name, width, init=None):
  c = {"name": name, "width": width, "conv_impl": "xla"}
  if init is not None:
    c["init"] = init
  return ml_collections.ConfigDict(c)


def _jit(fn):
  """`fn` jitted; compiled as a run compiles it (its fusion emitters) where a test turned XLA's
  optimisations back on (`optimized_compilation`)."""
  if jax.config.values["jax_disable_most_optimizations"]:
    return jax.jit(fn)
  return helpers.jit_as_runs(fn)


def backbone_variables(name, width, shape, init=None, key=0):
  """As a method initialises its backbone (`Method.init_backbone`): the draws hashed together."""
  net = models.make_backbone(model_config(name, width, init), 10)
  dummy = np.zeros((1,) + shape, np.float32)
  return _jit(fused_draws.fuse_draws(lambda k: net.init(k, dummy, train=False)))(
      jax.random.key(key))


def moe_variables(name, width, shape, init=None, flat=False, experts=3, key=0):
  net = moe.make_net(model_config(name, width, init), 10)
  tree = moe.balanced_tree(experts, flat=flat)
  structure = tuple((f, tree) for f in net.gate_feature_dims(shape))
  params, state = _jit(moe.jitted_init(net, structure, shape))(jax.random.key(key))
  # The gating tree as routing arrays is bookkeeping, not an initialised variable.
  return params, {k: v for k, v in state.items() if k != "routing"}


def digest(tree) -> str:
  """Bitwise fingerprint of a pytree of float32 arrays: paths, shapes and bytes."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  for path, leaf in sorted(leaves, key=lambda x: jax.tree_util.keystr(x[0])):
    a = np.asarray(leaf)
    h.update(jax.tree_util.keystr(path).encode())
    h.update(str(a.shape).encode())
    h.update(a.astype(np.float32).tobytes())
  return h.hexdigest()[:16]


# -- "lecun" is the initialisation the code had before the option existed ------------------------
# These fingerprints were computed by running the same constructions (key 0, jitted init, CPU,
# jax 0.10.2) with the code of commit bbd346f, before `config.model.init` existed. A change of
# any parameter bit under "lecun" (the default) fails the test.
LECUN_DIGESTS = {
    "mlp": "dd86d892c380baa1",
    "vgg": "9de9c114fa3e6455",
    "moe_mlp": "77eb1d1cb0501697",
    "moe_vgg": "25d173b271760209",
    "moe_flat_mlp": "470a09ebdf38c0d9",
    "moe_flat_vgg": "475f15773be2ec27",
}
WIDTHS = {"mlp": (16, MNIST_SHAPE), "vgg": (4, CIFAR_SHAPE)}


@pytest.fixture
def optimized_compilation():
  """XLA's default optimisations, as when the fingerprints were computed (the suite turns most
  of them off: tests/conftest.py); they change the last bits of the initialisers' floats."""
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


@pytest.mark.usefixtures("optimized_compilation")
@pytest.mark.parametrize("init", [None, "lecun"])  # None: a model config without the field
@pytest.mark.parametrize("name", ["mlp", "vgg"])
def test_lecun_parameters_are_bitwise_those_of_the_code_before_the_option(name, init):
  width, shape = WIDTHS[name]
  assert digest(backbone_variables(name, width, shape, init)) == LECUN_DIGESTS[name]
  assert digest(moe_variables(name, width, shape, init)) == LECUN_DIGESTS["moe_" + name]
  assert digest(moe_variables(name, width, shape, init, flat=True)) == (
      LECUN_DIGESTS["moe_flat_" + name])


def test_lecun_dense_layers_are_plain_flax_dense_layers():
  """The MLP's first layer is exactly `nn.Dense(64)` initialised from the same key."""
  class Plain(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = x.reshape((x.shape[0], -1))
      return nn.Dense(64, name="dense0")(x)

  x = np.zeros((1,) + MNIST_SHAPE, np.float32)
  want = Plain().init(jax.random.key(3), x)["params"]["dense0"]
  got = backbone_variables("mlp", 64, MNIST_SHAPE, "lecun", key=3)["params"]["dense0"]
  for k in ("kernel", "bias"):
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
  assert not np.any(np.asarray(got["bias"]))


# -- "torch": PyTorch's defaults --------------------------------------------------------------
def assert_uniform(values, bound, what):
  """`values` look like n i.i.d. draws of U(-bound, bound).

  Every check holds for such draws except with probability below ~1e-6:
    * support: all |v| <= bound (exact for the distribution);
    * reach: max |v| >= (1 - d) bound, d chosen so that P(all |v| < (1 - d) bound) =
      (1 - d)^n = 1e-9;
    * spread: the sample standard deviation is bound/sqrt(3) (that of the uniform) within
      5 standard errors. For a uniform, Var(s^2) ~ (mu4 - sigma^4)/n = bound^4 (1/5 - 1/9)/n,
      so s^2 has relative standard error sqrt(0.8/n) and s half of that;
    * shape, for n >= 1000: the empirical CDF is within the Dvoretzky-Kiefer-Wolfowitz band
      eps = sqrt(ln(2/alpha)/(2n)), alpha = 1e-6, of the uniform CDF. A normal law of the
      same variance (or LeCun's truncated normal) is far outside it for n in the thousands.
  """
  v = np.asarray(values, np.float64).ravel()
  n = v.size
  a = np.abs(v)
  assert a.max() <= bound * (1 + 1e-6), f"{what}: max |v| = {a.max()} > bound {bound}"
  d = 1.0 - 1e-9 ** (1.0 / n)
  assert a.max() >= (1 - d) * bound, f"{what}: max |v| = {a.max()} << bound {bound}"
  rel_se = 0.5 * math.sqrt(0.8 / n)
  std = v.std()
  assert abs(std / (bound / math.sqrt(3)) - 1) < 5 * rel_se, (
      f"{what}: std {std}, expected {bound / math.sqrt(3)} within {5 * rel_se:.3%}")
  if n >= 1000:
    ecdf = np.arange(1, n + 1) / n
    cdf = (np.sort(v) + bound) / (2 * bound)
    dev = max(np.max(np.abs(ecdf - cdf)), np.max(np.abs(ecdf - 1 / n - cdf)))
    eps = math.sqrt(math.log(2 / 1e-6) / (2 * n))
    assert dev < eps, f"{what}: Kolmogorov distance {dev} from the uniform, band {eps}"


def test_torch_dense_784_to_64_is_uniform_within_one_over_sqrt_fan_in():
  p = backbone_variables("mlp", 64, MNIST_SHAPE, "torch")["params"]
  bound = 1 / math.sqrt(784)
  assert p["dense0"]["kernel"].shape == (784, 64)
  assert_uniform(p["dense0"]["kernel"], bound, "dense0 kernel")  # n = 50,176 draws
  bias = np.asarray(p["dense0"]["bias"])
  assert np.all(bias != 0) and np.all(np.abs(bias) <= bound)
  assert_uniform(bias, bound, "dense0 bias")  # 64 draws: support, reach, spread
  # Later layers: fan_in = H.
  assert_uniform(p["dense1"]["kernel"], 1 / 8, "dense1 kernel")
  assert_uniform(p["head"]["kernel"], 1 / 8, "head kernel")
  assert np.all(np.abs(np.asarray(p["head"]["bias"])) <= 1 / 8)


def test_lecun_dense_fails_the_uniformity_check():
  """The check above can fail: LeCun-normal kernels (std 1/sqrt(fan_in), i.e. sqrt(3) times
  the uniform's) are rejected."""
  p = backbone_variables("mlp", 64, MNIST_SHAPE, "lecun")["params"]
  with pytest.raises(AssertionError):
    assert_uniform(p["dense0"]["kernel"], 1 / math.sqrt(784), "lecun kernel")


def test_torch_convolutions_have_fan_in_nine_times_input_channels():
  v = backbone_variables("vgg", 16, CIFAR_SHAPE, "torch")
  p = v["params"]
  first = p["block0"]["conv0"]["kernel"]  # (3, 3, 3, 16): fan_in 27 (fan_out would be 144)
  assert first.shape == (3, 3, 3, 16) and set(p["block0"]["conv0"]) == {"kernel"}
  assert_uniform(first, 1 / math.sqrt(9 * 3), "first conv kernel")
  for b in range(5):
    assert_uniform(p[f"block{b}"]["conv1"]["kernel"], 1 / math.sqrt(9 * 16), f"block{b} conv1")
  assert_uniform(p["head"]["kernel"], 1 / 4, "head kernel")  # 1x1x16 features
  # BatchNorm starts at scale 1, bias 0, as in PyTorch.
  bn = p["block2"]["bn3"]
  np.testing.assert_array_equal(np.asarray(bn["scale"]), np.ones(16))
  np.testing.assert_array_equal(np.asarray(bn["bias"]), np.zeros(16))


def test_torch_mixtures_initialise_experts_head_and_gates_like_pytorch_linear_layers():
  params, _ = moe_variables("mlp", 32, MNIST_SHAPE, "torch", experts=3)
  experts0 = params["mix0"]["experts"]["dense"]
  assert experts0["kernel"].shape == (3, 784, 32)
  assert_uniform(experts0["kernel"], 1 / math.sqrt(784), "experts of layer 0")
  assert_uniform(params["mix1"]["experts"]["dense"]["kernel"], 1 / math.sqrt(32), "layer 1")
  assert_uniform(params["head"]["dense"]["kernel"], 1 / math.sqrt(32), "head")
  # Two gates (3 experts) of fan_in 784, then 32; kernels and biases are random.
  gates = params["mix0"]["gates"]
  assert gates["kernel"].shape == (2, 784, 2) and gates["bias"].shape == (2, 2)
  assert_uniform(gates["kernel"], 1 / math.sqrt(784), "gates of layer 0")
  for layer, fan_in in (("mix0", 784), ("mix1", 32)):
    bias = np.asarray(params[layer]["gates"]["bias"])
    assert np.all(bias != 0) and np.all(np.abs(bias) <= 1 / math.sqrt(fan_in))
  # Different gates get different draws.
  assert not np.array_equal(np.asarray(gates["kernel"][0]), np.asarray(gates["kernel"][1]))


def test_torch_vgg_mixture_gates_have_fan_in_of_the_pooled_features():
  params, stats = moe_variables("vgg", 8, CIFAR_SHAPE, "torch", experts=2)
  assert_uniform(params["stem"]["conv0"]["kernel"], 1 / math.sqrt(27), "stem conv0")
  assert_uniform(params["mix0"]["experts"]["conv0"]["kernel"], 1 / math.sqrt(72), "mix0 conv0")
  # Block 1's input is 16x16x8, pooled to 4x4x8: F = 128.
  g = params["mix0"]["gates"]
  assert g["kernel"].shape == (1, 128, 2)
  assert_uniform(g["kernel"], 1 / math.sqrt(128), "gate of mix0")
  assert np.all(np.abs(np.asarray(g["bias"])) <= 1 / math.sqrt(128))
  assert np.all(np.asarray(g["bias"]) != 0)
  np.testing.assert_array_equal(np.asarray(stats["batch_stats"]["stem"]["bn0"]["var"]),
                                np.ones(8))


def test_init_gate_lecun_is_the_old_kernel_and_a_zero_bias():
  kernel, bias = moe.init_gate(jax.random.key(1), 20, 2)
  np.testing.assert_array_equal(np.asarray(kernel),
                                np.asarray(moe.init_gate_kernel(jax.random.key(1), 20, 2)))
  np.testing.assert_array_equal(np.asarray(bias), np.zeros(2))
  kernel, bias = moe.init_gate(jax.random.key(1), 20, 2, "torch")
  assert np.all(np.abs(np.asarray(kernel)) <= 1 / math.sqrt(20))
  assert np.all(np.asarray(bias) != 0) and np.all(np.abs(np.asarray(bias)) <= 1 / math.sqrt(20))


def test_an_unknown_scheme_is_rejected_with_the_valid_values():
  with pytest.raises(ValueError, match=r"config\.model\.init='xavier'.*\['lecun', 'torch'\]"):
    models.make_backbone(model_config("mlp", 8, "xavier"), 10)
  with pytest.raises(ValueError, match="valid values"):
    moe.make_net(model_config("vgg", 8, "xavier"), 10)
  c = config_lib.base_config("mnist", "sm")
  c.model.init = "xavier"
  with pytest.raises(ConfigError, match=r"config\.model\.init='xavier' is unknown"):
    validation.validate(c)


# -- optimizer and early-stopping options -----------------------------------------------------------
def test_cifar_sgd_declares_nesterov_false_and_behaves_as_plain_momentum():
  c = config_lib.base_config("cifar10", "sm")
  assert c.optimizer.kwargs.to_dict() == {"learning_rate": 0.01, "momentum": 0.9,
                                          "nesterov": False}
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  grads = [{"w": jnp.array([0.5, 0.1, -0.3])}, {"w": jnp.array([-0.2, 0.4, 0.6])}]

  def updates(tx):
    state, out = tx.init(params), []
    for g in grads:
      u, state = tx.update(g, state, params)
      out.append(np.asarray(u["w"]))
    return np.stack(out)

  ref = updates(optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.01, momentum=0.9)))
  np.testing.assert_array_equal(updates(optim.make_optimizer(c.optimizer)), ref)
  c.optimizer.kwargs.nesterov = True
  nesterov = updates(optim.make_optimizer(c.optimizer))
  assert not np.allclose(nesterov[1], ref[1])  # the second step sees the momentum


def test_nesterov_can_be_set_on_the_command_line_of_a_locked_config():
  argv = ["prog", f"--config={os.path.join(ROOT, 'configs', 'cifar_gmoe.py')}",
          "--config.optimizer.kwargs.nesterov=True", "--config.model.init=torch",
          "--config.train.patience_delta=0.001"]
  fv = flags.FlagValues()
  # As alma_jax.main declares it (a locked config); the overrides are read from `sys_argv`.
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv,
                                  lock_config=True, sys_argv=argv)
  fv(argv)
  assert fv.config.optimizer.kwargs.nesterov is True
  assert fv.config.model.init == "torch"
  assert fv.config.train.patience_delta == 0.001


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_patience_delta_defaults_to_zero_and_must_be_non_negative(dataset):
  c = config_lib.base_config(dataset, "sm")
  assert c.train.patience_delta == 0.0 and c.model.init == "lecun"
  c.train.patience_delta = -0.01
  with pytest.raises(ConfigError, match=r"config\.train\.patience_delta=-0\.01 must be in"):
    validation.validate(c)
