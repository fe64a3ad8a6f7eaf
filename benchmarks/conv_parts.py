"""Where the reduced VGG's train step and evaluation spend their time, part by part.

For each convolution shape of the VGG at width C (batch 128, NHWC, the 3x3 'SAME'
convolutions of `alma_jax.models.conv`), times alone, as compiled programs:
  * the forward convolution, its input gradient and its weight gradient;
  * the weight gradient written three other ways (the same sum, another order): nine
    shifted dots (one per kernel tap), one dot of the im2col matrix, nine einsums; and the
    three passes with the package's native XLA:CPU kernels (`model.conv_impl=native`,
    `alma_jax/kernels/`), where they build;
  * BatchNorm (batch statistics) + ReLU forward and backward, and the 2x2 max-pool's
    backward;
then sums each part over the network's 16 layers (each pool once per block), and times the
inference forward pass of the project's VGG (batch 1000, BatchNorm on running statistics) as
defined, BatchNorm as its own op, against the form its evaluation programs trace, BatchNorm
folded into the kernel and a bias (the same function up to round-off).

The process tunes glibc's allocator as a run of the VGG does (`train.cpu_allocator=auto`,
`alma_jax/tuning/cpu_tuning.py`; `--allocator=glibc` keeps glibc's defaults): with the
defaults every large temporary buffer is mapped and unmapped at each call, and its page faults
dominate the large layers and the evaluation (the evaluation at batch 1,000 ran about twice as
long that way on a 2-core AMD EPYC).

Each figure is the median of `--repeats` calls after one warm-up; the relative difference of
each weight-gradient variant from XLA's is printed beside its time. A part timed alone
includes its own dispatch, so the sum over-counts small layers; read it for shares, and the
whole step from `benchmarks/torch_reference.py`.

  python benchmarks/conv_parts.py                      # C = 16
  python benchmarks/conv_parts.py --width=64 --json=/tmp/parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer  # pylint: disable=wrong-import-position
from alma_jax.outputs import io_utils  # pylint: disable=wrong-import-position
from alma_jax.kernels import native  # pylint: disable=wrong-import-position
from alma_jax.models import inference  # pylint: disable=wrong-import-position
from alma_jax.models import vgg  # pylint: disable=wrong-import-position
from alma_jax.tuning import cpu_tuning  # pylint: disable=wrong-import-position
from alma_jax.tuning import tune  # pylint: disable=wrong-import-position

BLOCKS = (2, 2, 4, 4, 4)  # alma_jax.models.vgg.BLOCKS
DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")
EPS = 1e-5


def conv(x, kernel):
  return lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                  dimension_numbers=DIMENSION_NUMBERS)


def wgrad_xla(x, kernel, g):
  return jax.vjp(lambda k: conv(x, k), kernel)[1](g)[0]


def _taps(x):
  """The nine shifted views of `x` (padded by one) that a 3x3 kernel's taps read."""
  _, h, w, _ = x.shape
  xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  return [xp[:, i:i + h, j:j + w, :] for i in range(3) for j in range(3)]


def wgrad_shifted_dots(x, kernel, g):
  ci, co = kernel.shape[2:]
  g2 = g.reshape(-1, co)
  return jnp.stack([t.reshape(-1, ci).T @ g2 for t in _taps(x)]).reshape(3, 3, ci, co)


def wgrad_im2col(x, kernel, g):
  ci, co = kernel.shape[2:]
  cols = jnp.concatenate(_taps(x), axis=-1).reshape(-1, 9 * ci)
  return (cols.T @ g.reshape(-1, co)).reshape(3, 3, ci, co)


def wgrad_einsum(x, kernel, g):
  ci, co = kernel.shape[2:]
  return jnp.stack([jnp.einsum("bhwi,bhwo->io", t, g) for t in _taps(x)]).reshape(3, 3, ci, co)


def wgrad_native(x, kernel, g):
  del kernel
  return native.conv3x3_wgrad(x, g)


WGRADS = {"shifted_dots": wgrad_shifted_dots, "im2col": wgrad_im2col, "einsum": wgrad_einsum}
if native.available("cpu")[0]:
  WGRADS["native"] = wgrad_native


def bn_relu(y, scale, bias):
  mean = jnp.mean(y, axis=(0, 1, 2))
  var = jnp.mean(jnp.square(y), axis=(0, 1, 2)) - jnp.square(mean)
  return jnp.maximum((y - mean) * lax.rsqrt(var + EPS) * scale + bias, 0.0)


def pool(x):
  n, h, w, c = x.shape
  return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def median_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def layer_shapes(width: int) -> list[tuple[int, int, bool]]:
  """(side, input channels, first of its block) of each of the 16 convolutions."""
  out, side, cin = [], 32, 3
  for n in BLOCKS:
    for i in range(n):
      out.append((side, cin, i == 0))
      cin = width
    side //= 2
  return out


def train_parts(width: int, batch: int, repeats: int, rng) -> dict:
  rows, totals = [], {}
  counts: dict[tuple[int, int], int] = {}
  for side, cin, _ in layer_shapes(width):
    counts[(side, cin)] = counts.get((side, cin), 0) + 1
  for (side, cin), count in counts.items():
    x = jnp.asarray(rng.normal(size=(batch, side, side, cin)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(3, 3, cin, width)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(batch, side, side, width)), jnp.float32)
    ones, zeros = jnp.ones((width,)), jnp.zeros((width,))
    row = {"side": side, "in": cin, "out": width, "layers": count,
           "forward": median_ms(jax.jit(conv), x, kernel, repeats=repeats),
           "weight_grad": median_ms(jax.jit(wgrad_xla), x, kernel, g, repeats=repeats)}
    if "native" in WGRADS:
      row["forward_native"] = median_ms(jax.jit(native.conv3x3_forward), x, kernel,
                                        repeats=repeats)
    if cin != 3:  # the first layer's input is the data: no gradient is taken
      dgrad = jax.jit(lambda x, k, g: jax.vjp(lambda a: conv(a, k), x)[1](g)[0])
      row["input_grad"] = median_ms(dgrad, x, kernel, g, repeats=repeats)
      if "native" in WGRADS:
        row["input_grad_native"] = median_ms(jax.jit(native.conv3x3_input_grad), g, kernel,
                                             repeats=repeats)
    bn = jax.jit(lambda y, g: jax.vjp(lambda y: bn_relu(y, ones, zeros), y)[1](g)[0])
    row["bn_relu"] = median_ms(bn, g, g, repeats=repeats)
    reference = np.asarray(jax.jit(wgrad_xla)(x, kernel, g), np.float64)
    for name, fn in WGRADS.items():
      jitted = jax.jit(fn)
      got = np.asarray(jitted(x, kernel, g), np.float64)
      row[f"weight_grad_{name}"] = median_ms(jitted, x, kernel, g, repeats=repeats)
      row[f"weight_grad_{name}_rel_diff"] = float(np.max(np.abs(got - reference))
                                                 / np.max(np.abs(reference)))
    for key in ("forward", "input_grad", "weight_grad", "bn_relu", "forward_native",
                "input_grad_native", "weight_grad_native"):
      if key in row or key == "input_grad":
        totals[key] = totals.get(key, 0.0) + row.get(key, 0.0) * count
    rows.append(row)
  for side in sorted({s for s, _, _ in layer_shapes(width)}, reverse=True):  # one per block
    y = jnp.asarray(rng.normal(size=(batch, side, side, width)), jnp.float32)
    backward = jax.jit(lambda y: jax.vjp(pool, y)[1](pool(y))[0])
    totals["pool"] = totals.get("pool", 0.0) + median_ms(backward, y, repeats=repeats)
  return {"layers": rows, "per_step_ms": totals}


def eval_forward(width: int, batch: int, repeats: int, rng) -> dict:
  """The project's VGG at inference, freshly initialised (the values do not change the work):
  as defined (BatchNorm on its running statistics as its own op after each convolution) and in
  the folded form that its evaluation programs trace (`alma_jax.models.inference.evaluation()`).
  """
  model = vgg.VGG(width=width)
  x = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32)
  variables = model.init(jax.random.key(0), x[:2], train=False)
  defined = jax.jit(lambda v, x: model.apply(v, x, train=False))
  with inference.evaluation():  # traced here, at its first call
    folded = jax.jit(lambda v, x: model.apply(v, x, train=False))
    jax.block_until_ready(folded(variables, x))
  out = {"batch": batch}
  for _ in range(3):  # alternately: this host's speed drifts within minutes
    for name, fn in (("bn_affine", defined), ("bn_folded", folded)):
      out.setdefault(f"{name}_ms", []).append(median_ms(fn, variables, x, repeats=repeats))
  out = {k: (float(np.median(v)) if isinstance(v, list) else v) for k, v in out.items()}
  a = np.asarray(defined(variables, x), np.float64)
  b = np.asarray(folded(variables, x), np.float64)
  out["rel_diff"] = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--width", type=int, default=16)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--eval_batch_size", type=int, default=1000)
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--allocator", default="auto", choices=("auto", "tuned", "glibc"),
                 help="glibc's allocator as train.cpu_allocator (auto: tuned, as a VGG run's)")
  p.add_argument("--json", default="", help="write the results here as JSON")
  args = p.parse_args()
  io_utils.check_output_file(p, "--json", args.json)  # before measuring
  tune.allocator_for(["vgg"], args.allocator)  # before JAX starts its backend
  rng = np.random.default_rng(0)
  result = {"cpu": peer.this_cpu(), "jax": jax.__version__,
            "malloc_tuned": cpu_tuning.is_applied(), "width": args.width,
            "train": train_parts(args.width, args.batch_size, args.repeats, rng),
            "eval": eval_forward(args.width, args.eval_batch_size, args.repeats, rng)}
  print(f"# {result['cpu']}, jax {result['jax']}, allocator tuned: {result['malloc_tuned']}; "
        f"VGG C={args.width}, batch {args.batch_size}; median ms of {args.repeats} calls")
  has_native = "native" in WGRADS
  print("| side | in -> out | layers | forward | input grad | weight grad (XLA) | "
        + " | ".join(("shifted dots", "im2col", "einsum", "native")[:len(WGRADS)])
        + (" | forward (native) | input grad (native)" if has_native else "")
        + " | BN+ReLU fwd+bwd |")
  print("|---" * (7 + len(WGRADS) + 2 * has_native) + "|")
  for r in result["train"]["layers"]:
    variants = " | ".join(f"{r[f'weight_grad_{n}']:.2f} ({r[f'weight_grad_{n}_rel_diff']:.0e})"
                          for n in WGRADS)
    natives = (f" | {r['forward_native']:.2f} | {r.get('input_grad_native', 0.0):.2f}"
               if has_native else "")
    print(f"| {r['side']} | {r['in']} -> {r['out']} | {r['layers']} | {r['forward']:.2f} | "
          f"{r.get('input_grad', 0.0):.2f} | {r['weight_grad']:.2f} | {variants}{natives} | "
          f"{r['bn_relu']:.2f} |")
  totals = result["train"]["per_step_ms"]
  xla_parts = ("forward", "input_grad", "weight_grad", "bn_relu", "pool")
  native_parts = ("forward_native", "input_grad_native", "weight_grad_native", "bn_relu", "pool")
  print("per step, summed over the layers (ms): "
        + ", ".join(f"{k} {v:.1f}" for k, v in totals.items())
        + f"; total with XLA's convolutions {sum(totals[k] for k in xla_parts):.1f}"
        + (f", with the native ones {sum(totals[k] for k in native_parts):.1f}"
           if has_native else ""))
  e = result["eval"]
  print(f"the VGG's inference, batch {e['batch']}: as defined (BatchNorm its own op) "
        f"{e['bn_affine_ms']:.1f} ms, as the evaluation programs trace it (BatchNorm folded into "
        f"the kernel) {e['bn_folded_ms']:.1f} ms (relative difference {e['rel_diff']:.1e})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
