"""Tests of mixed precision (`train.compute_dtype`, alma_jax/engine/precision.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax import errors
from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.engine import population
from alma_jax.engine import precision
from alma_jax.engine import train
from alma_jax.stream import validation
from tests import helpers

# (data set, method, backbone): every backbone; gMoE on the MLP is the mixture of experts.
BACKBONES = [("mnist", "sm", "mlp"), ("cifar10", "sm", "vgg"), ("cifar10", "sm", "resnet"),
             ("mnist", "gmoe", "mlp")]


def _config(dataset, method, backbone, dtype, **train_fields):
  c = helpers.small_config(dataset, method, width=8, batch_size=64, eval_batch_size=64,
                           **train_fields)
  c.model.name = backbone
  c.train.compute_dtype = dtype
  return c


def _contraction(line: str) -> int:
  """How many products a dot_general line sums per output element (1 for a convolution's
  line: not parsed, kept)."""
  m = re.search(r"contracting_dims = \[([0-9, ]*)\] x .*?: \(tensor<([0-9x]+)x[a-z]", line)
  if "stablehlo.convolution" in line or not m:
    return 2
  dims, shape = m.group(1), [int(d) for d in m.group(2).split("x")]
  return int(np.prod([shape[int(d)] for d in dims.split(",") if d.strip()]))


def _products(hlo: str) -> list[str]:
  """The lines of a lowered program that multiply and sum: its convolutions and matrix
  products over more than one term (not a mixture's weighting of its experts' outputs by
  their gate values, a product over one term, which gMoE computes between module calls)."""
  return [l for l in hlo.splitlines()
          if re.search(r"stablehlo\.(dot_general|convolution)", l) and _contraction(l) > 1]


def _train_program_text(steps, learner) -> str:
  """The lowered train program of one (unstacked) learner's structure."""
  stacked = steps.place(population.stack([learner]))
  batch = steps.programs.timing_batch(1, steps.method.num_data_orders(learner.structure))
  keys = population.stack_keys([jax.random.key(0)])
  steps.train_call(learner.structure, steps.init_state(stacked), batch, keys,
                   np.uint32(0))  # builds the program
  (program,) = [p for k, p in steps.programs.cache.items() if k[0] == "train"]
  return program.jitted.lower(steps.init_state(stacked), steps.data, batch, keys,
                              np.uint32(0)).as_text()


def test_float32_runs_the_methods_functions_unchanged():
  f = lambda *a: a  # pylint: disable=unnecessary-lambda-assignment
  assert precision.loss_in("float32", f) is f and precision.evaluate_in("float32", f) is f
  assert config_lib.base_config("mnist", "sm").train.compute_dtype == "float32"


def test_a_bad_compute_dtype_is_a_config_error():
  c = config_lib.base_config("mnist", "sm")
  c.train.compute_dtype = "float16"
  with pytest.raises(errors.ConfigError,
                     match=r"config.train.compute_dtype='float16' is unknown; valid values: "
                           r"\['bfloat16', 'float32'\]"):
    validation.validate(c)


@pytest.mark.parametrize("dataset, method, backbone", BACKBONES)
def test_bfloat16_trains_with_float32_parameters_and_state(dataset, method, backbone):
  shape = (32, 32, 3) if dataset == "cifar10" else (28, 28, 1)
  ds = helpers.synthetic_dataset(n_train=512, n_test=64, shape=shape)
  c = _config(dataset, method, backbone, "bfloat16", epochs=3, patience=3)
  m, steps = helpers.make_steps(c, ds)
  learner = helpers.init(m)
  dtypes = jax.tree.map(lambda a: a.dtype, (learner.params, learner.model_state))
  # The products of the train step take bfloat16 operands (the float32 program has none).
  products = _products(_train_program_text(steps, learner))
  assert products and all("bf16" in l for l in products), products[:3]
  losses = []
  best, opt_state, stats = train.fit_one(
      steps, learner, np.arange(400, dtype=np.int32), np.arange(400, 512, dtype=np.int32),
      jax.random.key(1), on_epoch=lambda epoch, loss, acc, ran: losses.append(float(loss[0])))
  assert stats.epochs_run.tolist() == [3]
  # The learnable synthetic data: the mean loss falls from ~ln(10) = 2.3 epoch after epoch.
  assert losses[0] > losses[1] > losses[2], losses
  assert jax.tree.map(lambda a: a.dtype, (best.params, best.model_state)) == dtypes
  assert {a.dtype for a in jax.tree.leaves(opt_state) if jnp.issubdtype(a.dtype, jnp.floating)
          } == {jnp.dtype(jnp.float32)}


def test_float32_programs_have_no_bfloat16():
  ds = helpers.synthetic_dataset(n_train=128, n_test=64, shape=(32, 32, 3))
  m, steps = helpers.make_steps(_config("cifar10", "sm", "vgg", "float32"), ds)
  products = _products(_train_program_text(steps, helpers.init(m)))
  assert products and not any("bf16" in l for l in products)


def test_bfloat16_switch_transformer_loss_and_gradients():
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"), "smoke")
  c.model.dim, c.model.ffn_dim = 32, 48
  vocab, length = 50257, 16
  method = methods.make(c, (length,), vocab)
  learner = method.init(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 4, length + 1), 0, vocab)
  x, y, mask = tokens[..., :-1], tokens[..., 1:], jnp.ones((1, 4), bool)
  loss32 = precision.loss_in("float32", lambda *a: method.loss(learner.structure, *a))
  loss16 = precision.loss_in("bfloat16", lambda *a: method.loss(learner.structure, *a))
  args = (learner.params, {}, learner.model_state, x, y, mask, jax.random.key(2))
  (v32, _), g32 = jax.jit(jax.value_and_grad(loss32, has_aux=True))(*args)
  (v16, _), g16 = jax.jit(jax.value_and_grad(loss16, has_aux=True))(*args)
  # An untrained model's cross-entropy is near ln(vocab) = 10.8; bfloat16 keeps 8 bits of
  # mantissa (relative rounding 2^-8 = 0.4% per operation), so the two losses agree to ~1%.
  assert v16.dtype == jnp.float32 and float(v16) == pytest.approx(float(v32), rel=0.02)
  assert {a.dtype for a in jax.tree.leaves(g16)} == {jnp.dtype(jnp.float32)}
  jaxpr = str(jax.make_jaxpr(loss16)(*args))
  assert re.search(r"bf16\[[0-9,]*\] = dot_general", jaxpr)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g16))
  assert jax.tree.structure(g16) == jax.tree.structure(g32)
