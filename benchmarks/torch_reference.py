"""The project's train step against the same model trained the same way in PyTorch, in one process.

Ratios between frameworks are only meaningful when measured on one machine at
one time: CPUs of the same name differ by host, and a figure quoted from
elsewhere compares machines, not code. This script builds, in one process,
  * the project's real compiled train call (`benchmarks/train_speed.py`'s
    `make_trainer`, synthetic data of the real shapes), once per convolution
    implementation for the VGG, so the row shows what `model.conv_impl=auto`
    would choose by measurement; and
  * the same backbone in PyTorch: the reduced VGG19 (16 conv3x3 of width C
    without bias, BatchNorm, ReLU, 2x2 max-pools after blocks of 2, 2, 4, 4,
    4, a linear head) trained with SGD (lr 0.01, momentum 0.9, weight decay
    1e-4) on random 4-pixel-padded crops and flips done on the batch, or the
    MLP 784-H-H-10 trained with Adadelta (lr 1.0); batch 128, uint8 images
    normalised in the step, as the project does;
then alternates timed blocks of the two (JAX, torch, JAX, torch, ...) and
reports median images per second and the ratio of the medians (> 1: the
project is faster), with the range of the per-block ratios.

PyTorch is not a dependency of the package: install it beside the project
for benchmarking (e.g. `pip install torch --index-url
https://download.pytorch.org/whl/cpu` in a separate venv that also sees the
project's requirements).

Usage:
  python benchmarks/torch_reference.py                    # vgg16, vgg64, mlp64
  python benchmarks/torch_reference.py --rows=vgg16 --repeats=7 --json=out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from alma_jax import cpu_tuning  # pylint: disable=wrong-import-position
from alma_jax.models import vgg  # pylint: disable=wrong-import-position
from benchmarks import train_speed  # pylint: disable=wrong-import-position

# row -> (torch backbone, width, the project's rows of train_speed.ROWS for the same step)
ROWS = {
    "vgg16": ("vgg", 16, ("vgg16_sm_xla", "vgg16_sm_chunked")),
    "vgg64": ("vgg", 64, ("vgg64_sm_xla", "vgg64_sm_chunked")),
    "mlp64": ("mlp", 64, ("mlp64_sm",)),
}


def _parse():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
  p.add_argument("--repeats", type=int, default=5, help="timed blocks per framework")
  p.add_argument("--seconds_per_repeat", type=float, default=3.0)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--no_malloc_tuning", action="store_true")
  p.add_argument("--json", default="", help="write the results here as JSON")
  return p.parse_args()


def torch_trainer(torch, backbone: str, width: int, batch_size: int, seed: int = 0):
  """(run(steps) -> seconds, images per step) of the PyTorch twin of a project backbone."""
  nn, functional = torch.nn, torch.nn.functional
  torch.manual_seed(seed)
  if backbone == "vgg":
    layers, c_in = [], 3
    for n in vgg.BLOCKS:
      for _ in range(n):
        layers += [nn.Conv2d(c_in, width, 3, padding=1, bias=False),
                   nn.BatchNorm2d(width, momentum=0.1, eps=1e-5), nn.ReLU(inplace=True)]
        c_in = width
      layers.append(nn.MaxPool2d(2))
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    shape, augment = (3, 32, 32), True
  else:
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, 10))
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    shape, augment = (1, 28, 28), False
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model.to(device).train()
  gen = torch.Generator(device=device).manual_seed(seed)
  images = torch.randint(0, 256, (512,) + shape, dtype=torch.uint8, generator=gen, device=device)
  labels = torch.randint(0, 10, (512,), generator=gen, device=device)
  mean, std = 0.45, 0.25
  span = torch.arange(shape[-1], device=device)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def crop_flip(x):
    n = x.shape[0]
    padded = functional.pad(x, (4, 4, 4, 4))
    oy, ox = (torch.randint(0, 9, (n,), generator=gen, device=device) for _ in range(2))
    rows = (oy[:, None] + span)[:, None, :, None]
    cols = (ox[:, None] + span)[:, None, None, :]
    x = padded[torch.arange(n, device=device)[:, None, None, None],
               torch.arange(x.shape[1], device=device)[None, :, None, None], rows, cols]
    flip = torch.rand(n, generator=gen, device=device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)

  def run(steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
      idx = torch.randint(0, len(labels), (batch_size,), generator=gen, device=device)
      x = (images[idx].float() / 255.0 - mean) / std
      if augment:
        x = crop_flip(x)
      loss = functional.cross_entropy(model(x), labels[idx])
      opt.zero_grad(set_to_none=True)
      loss.backward()
      opt.step()
    sync()
    return time.perf_counter() - t0

  return run, batch_size


def bench(name, args, jax, np, torch) -> dict:
  backbone, width, jax_rows = ROWS[name]
  jax_trainers = {}
  for row in jax_rows:
    tr = train_speed.make_trainer(row, args.batch_size, jax, np)
    compile_s, _ = tr.warm_up()
    tr.run(1)
    jax_trainers[row] = (tr, compile_s)
  t_run, t_images = torch_trainer(torch, backbone, width, args.batch_size)
  t_run(2)  # warm-up
  per_step = t_run(2) / 2
  t_steps = max(1, int(args.seconds_per_repeat / max(per_step, 1e-4)))
  rates = {row: [] for row in jax_rows}
  rates["torch"] = []
  calls = {}
  for row, (tr, _) in jax_trainers.items():
    per_call = tr.run(2) / 2
    calls[row] = max(1, int(args.seconds_per_repeat / max(per_call, 1e-4)))
  for _ in range(args.repeats):  # alternate: drifts of the machine hit both alike
    for row, (tr, _) in jax_trainers.items():
      rates[row].append(calls[row] * tr.images_per_call / tr.run(calls[row]))
    rates["torch"].append(t_steps * t_images / t_run(t_steps))
  best = max(jax_rows, key=lambda r: statistics.median(rates[r]))
  med = {k: statistics.median(v) for k, v in rates.items()}
  block_ratios = [a / b for a, b in zip(rates[best], rates["torch"])]
  return {"row": name, "backbone": backbone, "width": width, "batch_size": args.batch_size,
          "jax_img_s": {k: med[k] for k in jax_rows}, "jax_best": best,
          "jax_compile_s": {k: v[1] for k, v in jax_trainers.items()},
          "torch_img_s": med["torch"], "ratio": med[best] / med["torch"],
          "ratio_min": min(block_ratios), "ratio_max": max(block_ratios),
          "rates": rates, "repeats": args.repeats}


def main():
  args = _parse()
  names = [r for r in args.rows.split(",") if r]
  for n in names:
    if n not in ROWS:
      raise SystemExit(f"--rows: unknown row {n!r}; valid rows: {list(ROWS)}")
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise SystemExit("torch_reference.py needs PyTorch: pip install torch (see the docstring)")
  if not args.no_malloc_tuning:
    cpu_tuning.apply()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  env = {"jax": jax.__version__, "torch": torch.__version__, "backend": jax.default_backend(),
         "torch_device": "cuda" if torch.cuda.is_available() else "cpu",
         "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
         "malloc_tuned": cpu_tuning.is_applied()}
  print(f"# one process: jax {env['jax']} ({env['backend']}), torch {env['torch']} "
        f"({env['torch_threads']} threads), {env['cpus']} CPUs, allocator tuned: "
        f"{env['malloc_tuned']}; {args.repeats} alternating blocks of ~{args.seconds_per_repeat} s",
        flush=True)
  print("| row | project img/s (per conv impl) | torch img/s | project / torch (block range) |")
  print("|---|---|---|---|", flush=True)
  results = []
  for n in names:
    r = bench(n, args, jax, np, torch)
    results.append(r)
    impls = ", ".join(f"{k.split('_')[-1]} {v:,.0f}" for k, v in r["jax_img_s"].items())
    print(f"| {n} | {impls} | {r['torch_img_s']:,.0f} | {r['ratio']:.2f}x "
          f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
