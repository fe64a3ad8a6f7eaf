"""The convolution implementations agree with XLA's to float tolerance."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax.models import conv
from alma_jax.models.vgg import VGG


@pytest.mark.parametrize("n", [64, 20])  # 20: not a multiple of the chunk, one chunk
def test_chunked_weight_gradient_matches_xla(n):
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (n, 8, 8, 6))
  w = 0.2 * jax.random.normal(kw, (3, 3, 6, 5))
  g = jax.random.normal(kg, (n, 8, 8, 5))

  def loss(impl):
    return lambda x, w: jnp.sum(conv.conv3x3(x, w, impl) * g)

  ref_val, ref_grads = jax.value_and_grad(loss("xla"), (0, 1))(x, w)
  val, grads = jax.jit(jax.value_and_grad(loss("chunked_dw"), (0, 1)))(x, w)
  chex.assert_trees_all_close(val, ref_val, rtol=1e-6)
  # dW sums n*64 products of O(1) values: compare at 1e-6 of its scale.
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6 * n * 64 * 10)


# The native kernels (alma_jax/kernels) sum every pass's products in another order.
@pytest.mark.parametrize("impl", ["chunked_dw", "native_dw", "native"])
def test_vgg_with_either_impl_has_the_same_parameters_and_gradients(impl):
  x = jax.random.normal(jax.random.key(1), (32, 32, 32, 3))
  y = jnp.arange(32) % 10
  models = {name: VGG(width=4, conv_impl=name) for name in ("xla", impl)}
  variables = models["xla"].init(jax.random.key(2), x[:1])
  chex.assert_trees_all_equal_shapes_and_dtypes(
      variables, models[impl].init(jax.random.key(2), x[:1]))

  def grads(model):
    def loss(params):
      logits, _ = model.apply({**variables, "params": params}, x, train=True,
                              mutable=["batch_stats"])
      return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(32), y])
    return jax.jit(jax.grad(loss))(variables["params"])

  chex.assert_trees_all_close(grads(models[impl]), grads(models["xla"]), rtol=1e-4, atol=1e-5)


def test_auto_rule_and_bad_values():
  assert conv.resolve_impl("auto", 64, "cpu") == "chunked_dw"
  assert conv.resolve_impl("auto", 32, "cpu") == "chunked_dw"
  assert conv.resolve_impl("auto", 16, "cpu") == "xla"
  assert conv.resolve_impl("auto", 4, "cpu") == "xla"
  assert conv.resolve_impl("auto", 64, "gpu") == "xla"
  assert conv.resolve_impl("xla", 64, "cpu") == "xla"
  with pytest.raises(ValueError, match=r"config.model.conv_impl='winograd' .* \['auto', 'xla', "
                     r"'chunked_dw', 'native_dw', 'native'\]"):
    conv.resolve_impl("winograd", 16, "cpu")
  with pytest.raises(ValueError, match="resolve 'auto' first"):
    conv.conv3x3(np.zeros((1, 4, 4, 1), np.float32), np.zeros((3, 3, 1, 1), np.float32), "auto")
