"""Training and evaluation speed of every backbone and method, per device.

For each row (backbone, width, method, convolution implementation) it builds
the real compiled train call of `alma_jax.engine.steps.Steps` (a population of one
learner, `config.train.steps_per_call` steps per call) on synthetic data and
reports:
  * train img/s: median and min-max over repeats after a warm-up (an image is
    one example seen by one trained member: an Ens step of batch 128 with 5
    members counts 640);
  * compile s: the first call's tracing and compilation;
  * eval img/s;
  * GFLOP/s achieved, from XLA's FLOP count of the train step, and its
    fraction of this device's peak as measured here (a large f32 matmul);
  * compilations: all programs in the run's compile cache (`Steps.
    num_compilations`) after one stage of the structure (the train call and
    the evaluation program, which serves the validation and the test split
    alike), and the number added by a second stage of the same structure
    (must be 0).

Usage:
  python benchmarks/train_speed.py                  # every row, Markdown + JSON
  python benchmarks/train_speed.py --rows=vgg16_sm,vgg16_sm_xla --repeats=7
  python benchmarks/train_speed.py --quick          # fewer repeats and rows
  python benchmarks/train_speed.py --xla_ynn        # with XLA:CPU's YNN fusions
  python benchmarks/train_speed.py --rows=mlp64_sm --fusion=elemental   # per-program options
  python benchmarks/train_speed.py --compute_dtype=bfloat16   # mixed precision
It runs unchanged on GPU/TPU (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from alma_jax.outputs import io_utils  # pylint: disable=wrong-import-position
from alma_jax.tuning import cpu_tuning  # pylint: disable=wrong-import-position
from alma_jax.tuning import tune  # pylint: disable=wrong-import-position  (no backend yet)

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"

# name -> (backbone, width, method, method overrides, model overrides)
ROWS = {
    "mlp4_sm": ("mlp", 4, "sm", {}, {}),
    "mlp64_sm": ("mlp", 64, "sm", {}, {}),
    "mlp64_ens5": ("mlp", 64, "ens", {"num_members": 5}, {}),
    "mlp64_umix5": ("mlp", 64, "umix", {"num_members": 5}, {}),
    "mlp64_gmoe4": ("mlp", 64, "gmoe", {"initial_experts": 4}, {}),
    "vgg4_sm": ("vgg", 4, "sm", {}, {"conv_impl": "auto"}),
    "vgg4_sm_xla": ("vgg", 4, "sm", {}, {"conv_impl": "xla"}),
    "vgg4_sm_chunked": ("vgg", 4, "sm", {}, {"conv_impl": "chunked_dw"}),
    "vgg4_sm_native_dw": ("vgg", 4, "sm", {}, {"conv_impl": "native_dw"}),
    "vgg4_sm_native": ("vgg", 4, "sm", {}, {"conv_impl": "native"}),
    "vgg16_sm": ("vgg", 16, "sm", {}, {"conv_impl": "auto"}),
    "vgg16_sm_xla": ("vgg", 16, "sm", {}, {"conv_impl": "xla"}),
    "vgg16_sm_chunked": ("vgg", 16, "sm", {}, {"conv_impl": "chunked_dw"}),
    "vgg16_sm_native_dw": ("vgg", 16, "sm", {}, {"conv_impl": "native_dw"}),
    "vgg16_sm_native": ("vgg", 16, "sm", {}, {"conv_impl": "native"}),
    "vgg32_sm_xla": ("vgg", 32, "sm", {}, {"conv_impl": "xla"}),
    "vgg32_sm_chunked": ("vgg", 32, "sm", {}, {"conv_impl": "chunked_dw"}),
    "vgg32_sm_native_dw": ("vgg", 32, "sm", {}, {"conv_impl": "native_dw"}),
    "vgg32_sm_native": ("vgg", 32, "sm", {}, {"conv_impl": "native"}),
    "vgg64_sm": ("vgg", 64, "sm", {}, {"conv_impl": "auto"}),
    "vgg64_sm_xla": ("vgg", 64, "sm", {}, {"conv_impl": "xla"}),
    "vgg64_sm_chunked": ("vgg", 64, "sm", {}, {"conv_impl": "chunked_dw"}),
    "vgg64_sm_native_dw": ("vgg", 64, "sm", {}, {"conv_impl": "native_dw"}),
    "vgg64_sm_native": ("vgg", 64, "sm", {}, {"conv_impl": "native"}),
    "vgg16_ens5": ("vgg", 16, "ens", {"num_members": 5}, {}),
    "vgg16_umix5": ("vgg", 16, "umix", {"num_members": 5}, {}),
    "vgg16_gmoe4": ("vgg", 16, "gmoe", {"initial_experts": 4}, {}),
    "vgg64_ens5": ("vgg", 64, "ens", {"num_members": 5}, {}),
    "vgg64_umix5": ("vgg", 64, "umix", {"num_members": 5}, {}),
    "vgg64_gmoe4": ("vgg", 64, "gmoe", {"initial_experts": 4}, {}),
}
QUICK_ROWS = ("mlp4_sm", "mlp64_sm", "mlp64_ens5", "vgg4_sm", "vgg16_sm_xla", "vgg16_sm_chunked",
              "vgg16_ens5")


def _parse():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--rows", default="", help=f"comma-separated rows (default all): {list(ROWS)}")
  p.add_argument("--quick", action="store_true", help=f"only {QUICK_ROWS}, 3 repeats")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--seconds_per_repeat", type=float, default=2.0)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--xla_ynn", action="store_true", help=f"set XLA_FLAGS={YNN_FLAG} (CPU)")
  p.add_argument("--compute_dtype", default="float32", choices=("float32", "bfloat16"),
                 help="train.compute_dtype of every row")
  p.add_argument("--fusion", default="",
                 help="train.step_fusion and train.eval_fusion of every row (XLA:CPU's options "
                      "of the train step and the evaluation, alma_jax.engine.programs.FUSIONS; "
                      "default: the rule's, same)")
  p.add_argument("--allocator", default="auto", choices=("auto", "tuned", "glibc"),
                 help="glibc's allocator as train.cpu_allocator (auto: tuned when every row's "
                      "backbone is convolution-heavy, as their runs are)")
  p.add_argument("--json", default="", help="write the results here as JSON")
  args = p.parse_args()
  io_utils.check_output_file(p, "--json", args.json)  # before measuring
  return args


def _peak_gflops(jax, jnp, n=2048, repeats=5) -> float:
  """f32 matmul rate of this device: the yardstick for 'fraction of peak'."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / statistics.median(times) / 1e9


def _synthetic(np, shape, n_train=512, n_test=1000):
  rng = np.random.default_rng(0)
  return types.SimpleNamespace(
      train_x=rng.integers(0, 256, (n_train,) + shape).astype(np.uint8),
      train_y=rng.integers(0, 10, n_train).astype(np.int32),
      test_x=rng.integers(0, 256, (n_test,) + shape).astype(np.uint8),
      test_y=rng.integers(0, 10, n_test).astype(np.int32),
      mean=np.full(shape[-1:], 0.45, np.float32), std=np.full(shape[-1:], 0.25, np.float32),
      num_classes=10)


def make_trainer(name, batch_size, jax, np, compute_dtype="float32", fusion=""):
  """The real compiled train call of row `name` on synthetic data: a namespace with
  `run(calls) -> seconds` (after `warm_up()`, which compiles), `images_per_call` and the
  parts a row reports (method, steps, learner, data); `fusion`: the per-program XLA options
  of its train step and evaluation (empty: the rule's)."""
  # pylint: disable=g-import-not-at-top
  from alma_jax.configuration import config_lib
  from alma_jax import methods
  from alma_jax.engine import optim, population, sharding, timing
  from alma_jax.stream import validation
  from alma_jax.engine.steps import Batch, Steps
  from alma_jax.tasks import images as image_task
  from alma_jax.tuning import autotune
  # pylint: enable=g-import-not-at-top
  backbone, width, method_name, method_kw, model_kw = ROWS[name]
  if method_name not in methods.names():
    return None
  c = config_lib.base_config("mnist" if backbone == "mlp" else "cifar10", method_name)
  c.model.width = width
  for k, v in model_kw.items():
    c.model[k] = v
  for k, v in method_kw.items():
    c.method[k] = v
  c.train.batch_size = batch_size
  c.train.eval_batch_size = 500
  c.train.compute_dtype = compute_dtype
  c.train.epochs, c.train.patience = 1, 1  # the two short stages counting compilations
  c.mesh.num_devices = 1
  if fusion:
    c.train.step_fusion = c.train.eval_fusion = fusion
  c = autotune.by_rules(validation.complete(c))  # the rules decide what the row leaves open
  shape = (28, 28, 1) if backbone == "mlp" else (32, 32, 3)
  ds = _synthetic(np, shape)
  mesh = sharding.make_mesh(1)
  method = methods.make(c, shape, ds.num_classes)
  steps = Steps.from_config(c, method, image_task.ImageTask.from_config(c),
                            optim.make_optimizer(c.optimizer), image_task.device_data(ds), mesh)
  learner = method.init(jax.random.key(0))
  stacked = population.stack([learner])  # a population of one (S = 1)
  structure = learner.structure
  d = method.num_data_orders(structure)
  k = steps.steps_per_call
  keys = population.stack_keys([jax.random.key(0)])
  mask = np.ones((1, k, d, batch_size), bool)
  rng = np.random.default_rng(1)
  box = {"state": steps.init_state(stacked), "i": 0}  # a copy: the train call donates it

  def run(calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
      idx = rng.integers(0, len(ds.train_y), (1, k, d, batch_size)).astype(np.int32)
      box["state"], loss, _ = steps.train_call(structure, box["state"],
                                               Batch(idx, mask), keys,
                                               np.uint32(box["i"]))
      box["i"] += 1
    jax.block_until_ready(loss)
    return time.perf_counter() - t0

  def warm_up() -> tuple[float, float]:
    """(compile seconds, first call seconds)."""
    c0 = timing.compile_seconds()
    first = run(1)
    return timing.compile_seconds() - c0, first

  return types.SimpleNamespace(run=run, warm_up=warm_up, images_per_call=k * batch_size * d,
                               method=method, steps=steps, learner=learner, stacked=stacked,
                               ds=ds, members=d, steps_per_call=k)


def bench_row(name, args, jax, jnp, np):
  del jnp
  # pylint: disable=g-import-not-at-top
  from alma_jax.engine.train import fit_one
  # pylint: enable=g-import-not-at-top
  tr = make_trainer(name, args.batch_size, jax, np, args.compute_dtype, args.fusion)
  if tr is None:
    return {"row": name, "skipped": f"method {ROWS[name][2]!r} is not available"}
  backbone, width, method_name = ROWS[name][:3]
  method, steps, learner, stacked, ds = tr.method, tr.steps, tr.learner, tr.stacked, tr.ds
  d, k, b = tr.members, tr.steps_per_call, args.batch_size
  flops = steps.flops(learner)
  compile_s, first_call_s = tr.warm_up()
  call_s = tr.run(1)
  calls = max(1, int(args.seconds_per_repeat / max(call_s, 1e-4)))
  rates = [calls * tr.images_per_call / tr.run(calls) for _ in range(args.repeats)]
  med = statistics.median(rates)

  # evaluation
  idx = np.arange(len(ds.test_y), dtype=np.int32)
  steps.evaluate(stacked, "test", idx)  # compiles
  t0 = time.perf_counter()
  for _ in range(2):
    steps.evaluate(stacked, "test", idx)
  eval_rate = 2 * len(idx) / (time.perf_counter() - t0)

  # compilations per stage: two short stages of the same structure
  tr_idx, val_idx = np.arange(b, dtype=np.int32), np.arange(b, b + 64, dtype=np.int32)
  out, _, _ = fit_one(steps, learner, tr_idx, val_idx, jax.random.key(2), t=1)
  first_stage = steps.num_compilations
  before = steps.num_compilations
  fit_one(steps, out, tr_idx, val_idx, jax.random.key(3), t=2)
  second_stage = steps.num_compilations - before

  gflops = flops["train_step"] * med / (b * d) / 1e9
  return {"row": name, "backbone": backbone, "width": width, "method": method_name,
          "conv_impl": getattr(getattr(method, "backbone", None), "conv_impl", None), "members": d,
          "train_img_s": med, "train_img_s_min": min(rates), "train_img_s_max": max(rates),
          "repeats": len(rates), "steps_per_repeat": calls * k, "steps_per_call": k,
          "compile_s": compile_s, "first_call_s": first_call_s, "eval_img_s": eval_rate,
          "train_step_gflop": flops["train_step"] / 1e9, "gflop_s": gflops,
          "compilations_first_stage": first_stage, "compilations_second_stage": second_stage,
          "compiled": [str(key[0]) for key in steps.compiled]}


def main():
  args = _parse()
  if args.xla_ynn:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + YNN_FLAG).strip()
  if args.quick:
    args.repeats = min(args.repeats, 3)
  names = ([r for r in args.rows.split(",") if r] if args.rows else
           list(QUICK_ROWS if args.quick else ROWS))
  for n in names:
    if n not in ROWS:
      raise SystemExit(f"--rows: unknown row {n!r}; valid rows: {list(ROWS)}")
  tune.allocator_for([ROWS[n][0] for n in names], args.allocator)  # before JAX starts
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  peak = _peak_gflops(jax, jnp)
  env = {"backend": jax.default_backend(), "devices": str(jax.devices()),
         "jax": jax.__version__, "malloc_tuned": cpu_tuning.is_applied(),
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "peak_matmul_gflop_s": peak,
         "compute_dtype": args.compute_dtype, "fusion": args.fusion or "rule"}
  print(f"# train speed on {env['backend']} ({env['devices']}), jax {env['jax']}, allocator tuned: "
        f"{env['malloc_tuned']}, compute dtype {args.compute_dtype}, per-program options "
        f"{env['fusion']}, "
        f"XLA_FLAGS={env['xla_flags']!r}, matmul peak {peak:.1f} GFLOP/s",
        flush=True)
  print("| row | conv | train img/s (median, min-max) | compile s | eval img/s | GFLOP/s | "
        "% peak | compiled functions / added by a 2nd stage |")
  print("|---|---|---|---|---|---|---|---|", flush=True)
  results = []
  for n in names:
    r = bench_row(n, args, jax, jnp, np)
    results.append(r)
    if "skipped" in r:
      print(f"| {n} | skipped: {r['skipped']} |||||||", flush=True)
      continue
    print(f"| {n} | {r['conv_impl'] or '-'} | {r['train_img_s']:,.0f} ({r['train_img_s_min']:,.0f}-"
          f"{r['train_img_s_max']:,.0f}) | {r['compile_s']:.1f} | {r['eval_img_s']:,.0f} | "
          f"{r['gflop_s']:.1f} | {100 * r['gflop_s'] / peak:.0f}% | "
          f"{r['compilations_first_stage']}/{r['compilations_second_stage']} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
