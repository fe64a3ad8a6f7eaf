"""The project's train step against the same model trained the same way in PyTorch, in one run.

Ratios between frameworks are only meaningful when measured on one machine at
one time: CPUs of the same name differ by host, and a figure quoted from
elsewhere compares machines, not code. This script times, in one run,
  * the project's real compiled train call (`benchmarks/train_speed.py`'s
    `make_trainer`, synthetic data of the real shapes), once per convolution
    implementation for the VGG and, for the VGG on a CPU, once per setting
    of XLA:CPU's fusion flags (`train.cpu_fusion`: none, ynn), so the row
    shows what the run's choices by measurement would pick; and
  * the same backbone in PyTorch: the reduced VGG19 (16 conv3x3 of width C
    without bias, BatchNorm, ReLU, 2x2 max-pools after blocks of 2, 2, 4, 4,
    4, a linear head) trained with SGD (lr 0.01, momentum 0.9, weight decay
    1e-4) on random 4-pixel-padded crops and flips done on the batch, or the
    MLP 784-H-H-10 trained with Adadelta (lr 1.0); batch 128, uint8 images
    normalised in the step, as the project does;
  PyTorch as its users run it (glibc's default allocator) and with the
    allocator tuning that a run of a convolution-heavy backbone applies to
    itself (`alma_jax/tuning/cpu_tuning.py`; it made PyTorch faster too at width 64
    on one CPU), so the comparison can be read both ways; the project's party
    tunes its allocator as a run of the row's backbone does;
then alternates timed blocks of all of them (each setting's XLA flags and
each allocator need a process of their own: one worker process per party,
started one after another and then driven block by block, so only one runs
at a time) and reports median images per second and the ratios of the
medians (> 1: the project is faster), with the range of the per-block
ratios of the project's fastest variant.

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
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from alma_jax.outputs import io_utils  # pylint: disable=wrong-import-position
from alma_jax.models import vgg  # pylint: disable=wrong-import-position
from alma_jax.tuning import cpu_fusion  # pylint: disable=wrong-import-position
from alma_jax.tuning import cpu_tuning  # pylint: disable=wrong-import-position
from alma_jax.tuning import tune  # pylint: disable=wrong-import-position
from benchmarks import train_speed  # pylint: disable=wrong-import-position

# row -> (torch backbone, width, the project's rows of train_speed.ROWS for the same step)
ROWS = {
    "vgg16": ("vgg", 16, ("vgg16_sm_xla", "vgg16_sm_chunked", "vgg16_sm_native_dw",
                          "vgg16_sm_native")),
    "vgg64": ("vgg", 64, ("vgg64_sm_xla", "vgg64_sm_chunked", "vgg64_sm_native_dw",
                          "vgg64_sm_native")),
    "mlp64": ("mlp", 64, ("mlp64_sm",)),
}


def _parse():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
  p.add_argument("--repeats", type=int, default=5, help="timed blocks per framework")
  p.add_argument("--seconds_per_repeat", type=float, default=3.0)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--json", default="", help="write the results here as JSON")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # a party's process (internal)
  args = p.parse_args()
  io_utils.check_output_file(p, "--json", args.json)  # before measuring
  return args


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


# -- the parties, each in a process of its own --------------------------------------------------
def parties(name: str) -> list[dict]:
  """The worker processes of row `name`: {"label", "kind", "fusion" or "allocator"}."""
  backbone = ROWS[name][0]
  fusions = cpu_fusion.SETTINGS if backbone == "vgg" else ("none",)
  out = [{"label": f"project/{f}", "kind": "project", "fusion": f} for f in fusions]
  out += [{"label": "torch/default malloc", "kind": "torch", "allocator": "default"},
          {"label": "torch/tuned malloc", "kind": "torch", "allocator": "tuned"}]
  return out


def _worker(spec: dict) -> None:
  """A party's process: builds its trainers, then answers `RUN <trainer> <calls>` lines."""
  name, batch = spec["row"], spec["batch_size"]
  if spec["kind"] == "project":
    tune.allocator_for([ROWS[name][0]])  # as a run of the row's backbone, before JAX starts
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    trainers, info = {}, {"jax": jax.__version__, "backend": jax.default_backend()}
    for row in ROWS[name][2]:
      tr = train_speed.make_trainer(row, batch, jax, np)
      compile_s, _ = tr.warm_up()
      tr.run(1)
      trainers[row.split("_sm_", 1)[1]] = (lambda tr=tr: tr.run, tr.images_per_call, compile_s)
  else:
    if spec.get("allocator") == "tuned":
      cpu_tuning.apply()
    import torch  # pylint: disable=g-import-not-at-top
    run, images = torch_trainer(torch, ROWS[name][0], ROWS[name][1], batch)
    run(2)  # warm-up
    trainers = {"torch": (lambda: run, images, 0.0)}
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
  info.update(malloc_tuned=cpu_tuning.is_applied(), xla_flags=os.environ.get("XLA_FLAGS", ""))
  per_call = {k: get()(2) / 2 for k, (get, _, _) in trainers.items()}
  print("READY " + json.dumps({"info": info, "per_call": per_call,
                               "compile_s": {k: v[2] for k, v in trainers.items()}}), flush=True)
  for line in sys.stdin:
    what, trainer, calls = line.split()
    if what != "RUN":
      break
    get, images, _ = trainers[trainer]
    seconds = get()(int(calls))
    print("RATE " + json.dumps(int(calls) * images / seconds), flush=True)


class Party:
  """A running worker process of one party."""

  def __init__(self, spec: dict, name: str, batch_size: int):
    self.spec = dict(spec, row=name, batch_size=batch_size)
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("MALLOC_")]:
      del env[k]  # the allocator is the party's own choice
    env["XLA_FLAGS"] = cpu_fusion.flags_with(spec.get("fusion", "none"),
                                             env.get("XLA_FLAGS", ""))
    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                  f"--worker={json.dumps(self.spec)}"], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.ready = self._reply("READY")

  def _reply(self, tag: str):
    line = self.proc.stdout.readline()
    if not line.startswith(tag + " "):
      self.proc.kill()
      raise SystemExit(f"the worker of {self.spec['label']} failed (exit {self.proc.wait()})")
    return json.loads(line[len(tag) + 1:])

  def rate(self, trainer: str, calls: int) -> float:
    self.proc.stdin.write(f"RUN {trainer} {calls}\n")
    self.proc.stdin.flush()
    return self._reply("RATE")

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def bench(name: str, args) -> dict:
  """Alternating blocks of every party's trainers for row `name`."""
  running = [Party(spec, name, args.batch_size) for spec in parties(name)]  # one at a time
  try:
    series = {}  # "label/trainer" -> (party, trainer, calls per block)
    for p in running:
      for trainer, per_call in p.ready["per_call"].items():
        calls = max(1, int(args.seconds_per_repeat / max(per_call, 1e-4)))
        key = p.spec["label"] if p.spec["kind"] == "torch" else f"{p.spec['label']}/{trainer}"
        series[key] = (p, trainer, calls)
    rates = {k: [] for k in series}
    for _ in range(args.repeats):  # alternate: drifts of the machine hit every party alike
      for k, (p, trainer, calls) in series.items():
        rates[k].append(p.rate(trainer, calls))
  finally:
    for p in running:
      p.close()
  med = {k: statistics.median(v) for k, v in rates.items()}
  project = [k for k in med if k.startswith("project/")]
  best = max(project, key=med.get)
  out = {"row": name, "backbone": ROWS[name][0], "width": ROWS[name][1],
         "batch_size": args.batch_size, "repeats": args.repeats, "img_s": med, "rates": rates,
         "best": best, "info": {p.spec["label"]: p.ready["info"] for p in running},
         "compile_s": {p.spec["label"]: p.ready["compile_s"] for p in running}}
  for torch_label in ("torch/default malloc", "torch/tuned malloc"):
    blocks = [a / b for a, b in zip(rates[best], rates[torch_label])]
    out[f"ratio vs {torch_label}"] = (med[best] / med[torch_label], min(blocks), max(blocks))
  return out


def main():
  args = _parse()
  if args.worker:
    _worker(json.loads(args.worker))
    return
  names = [r for r in args.rows.split(",") if r]
  for n in names:
    if n not in ROWS:
      raise SystemExit(f"--rows: unknown row {n!r}; valid rows: {list(ROWS)}")
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise SystemExit("torch_reference.py needs PyTorch: pip install torch (see the docstring)")
  print(f"# {os.cpu_count()} CPUs; one worker process per party, {args.repeats} alternating "
        f"blocks of ~{args.seconds_per_repeat} s; img/s medians", flush=True)
  print("| row | project img/s (fusion/conv impl) | torch img/s (default / tuned malloc) | "
        "best project / torch default (block range) | / torch tuned |")
  print("|---|---|---|---|---|", flush=True)
  results = []
  for n in names:
    r = bench(n, args)
    results.append(r)
    proj = ", ".join(f"{k[len('project/'):]} {v:,.0f}" for k, v in r["img_s"].items()
                     if k.startswith("project/"))
    (d, dlo, dhi), (t, tlo, thi) = (r["ratio vs torch/default malloc"],
                                    r["ratio vs torch/tuned malloc"])
    print(f"| {n} | {proj} | {r['img_s']['torch/default malloc']:,.0f} / "
          f"{r['img_s']['torch/tuned malloc']:,.0f} | {d:.2f}x ({dlo:.2f}-{dhi:.2f}) | "
          f"{t:.2f}x ({tlo:.2f}-{thi:.2f}) |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"results": results}, f, indent=2)


if __name__ == "__main__":
  main()
