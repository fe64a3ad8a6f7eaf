"""XLA:GPU's compile of a run's programs, on a machine without a GPU.

XLA compiles for a GPU on the host: its HLO passes, LLVM and ptxas need no device when the
device is described instead (a `GpuTargetConfigProto`; `gpu_targets/h200.txtpb` here, an
NVIDIA H200 at XLA's autotuning level 0, which needs no device either). This script times
that compile, program by program and pass by pass, in two steps:

  # 1. in this project's environment: the run on the CPU, every program it compiles also
  #    lowered for a GPU and written down (no persistent cache, so that every program is lowered)
  python benchmarks/gpu_compile_offline.py dump --run=p4 --ir=/tmp/p4_ir
  # 2. in an environment with JAX's CUDA plugin of the same JAX version (no GPU needed):
  #    python3 -m venv /tmp/gpu && /tmp/gpu/bin/pip install -r requirements.txt "jax[cuda13]==0.10.2"
  /tmp/gpu/bin/python benchmarks/gpu_compile_offline.py compile --ir=/tmp/p4_ir --out=gpu.json

`--run` names a run of benchmarks/compile_budget.py (p1-p4, lm_base, ff_quick, ...) or is a
config; arguments after `--` go to the run. `dump` writes each program as JAX lowers it for
CUDA (`lowering_platforms`, which needs no plugin), not as the CPU ran it: JAX lowers some
operations per platform (the Threefry hash of random draws is a loop on a CPU, its rounds
written out or jaxlib's kernel on a GPU: `train.gpu_threefry`), so a CPU's programs can
compile far faster for a GPU than a GPU run's own. The run measures no speed choice
(`PORTABLE`: `train.autotune=rules`; measuring compiles candidates in other processes) and
uses XLA's convolutions (`model.conv_impl=xla`, where the model has the field: the
package's native kernels are XLA:CPU's alone); its other choices are the CPU's rules, and
flags after `--` set a GPU run's values (`-- --config.train.gpu_threefry=xla`; gMoE's
default slots, `auto`, are `pow2` on the CPU and `planned` in a short GPU run:
`-- --config.method.slots=planned` dumps the programs of the latter).
`compile --only=eval,train` compiles the programs whose names hold one of those words, and
`summary RESULTS.json...` puts results files side by side: each one's compile seconds in all
and of its programs that draw. Each program compiles in a process of its own, with
XLA's pass log (`compile_budget.XLA_PASS_LOG`): the table gives its compile seconds, the
seconds of its HLO passes and its slowest passes; the rest is code generation (LLVM, ptxas).
A real GPU adds what needs the device (autotuning above level 0) and its host's speed: the
seconds here rank programs and show how a compile grows, not what a GPU machine measures.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "gpu_targets", "h200.txtpb")
PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")  # JAX's CUDA plugins, by CUDA version
NO_PLUGIN = (f"compiling for a GPU needs JAX's CUDA plugin in this Python, of its JAX's "
             f"version: pip install \"jax[cuda13]=={importlib.metadata.version('jax')}\" in "
             f"a virtualenv of its own (no GPU is needed)")
# What `dump` sets before the run's own flags: the choices a CPU would make otherwise that
# build other programs than a GPU's, or that compile candidates in processes of their own.
PORTABLE = ("--config.train.autotune=rules", "--config.model.conv_impl=xla")
DUMP_INFO = "dump.json"  # what `dump` ran, beside the programs: run, command, commit
NOT_LOWERED = "not_lowered.jsonl"  # the programs that JAX could not lower for CUDA, if any
_DUMPED = re.compile(r"^jax_ir(\d+)_(.+)_compile\.mlir$")  # JAX's name of a lowered program


def dumped_programs(ir_dir: str) -> list[tuple[str, str]]:
  """(program name, file) of every program JAX wrote to `ir_dir`, in the order it lowered
  them ("jax_ir0051_jit_alma_step_eval_compile.mlir" -> "jit_alma_step_eval")."""
  found = []
  for path in glob.glob(os.path.join(ir_dir, "*.mlir")):
    m = _DUMPED.match(os.path.basename(path))
    if m:
      found.append((int(m.group(1)), m.group(2), path))
  return [(name, path) for _, name, path in sorted(found)]


def portable_flags(config_arg: str) -> tuple[str, ...]:
  """`PORTABLE` for the config `config_arg` (`--config`'s value), less the choice of XLA's
  convolutions where its task refuses that field (the Switch Transformer has none)."""
  import alma_jax  # pylint: disable=g-import-not-at-top
  from alma_jax import tasks  # pylint: disable=g-import-not-at-top
  from alma_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    config = alma_jax.load_config(config_arg)
  except Exception:  # pylint: disable=broad-except  (the run itself names what is wrong)
    return PORTABLE
  with config.unlocked():
    config.model.conv_impl = "xla"
  try:
    tasks.task_class(config).check(config)
  except ConfigError as e:
    if "model.conv_impl" in str(e):
      return tuple(f for f in PORTABLE if not f.startswith("--config.model.conv_impl="))
  return PORTABLE


def dump(run: str, ir_dir: str, extra: list[str]) -> int:
  """Runs `run` on the CPU, every program it compiles also lowered for CUDA into `ir_dir`."""
  import compile_budget  # pylint: disable=g-import-not-at-top
  config, *flags = compile_budget.RUNS.get(run, run).split()
  os.makedirs(ir_dir, exist_ok=True)
  if dumped_programs(ir_dir):
    sys.exit(f"--ir={ir_dir} already holds programs; give an empty or new folder")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_DUMP_IR_TO", None)  # the CPU's programs are not what is compiled here
  failed = os.path.join(ir_dir, NOT_LOWERED)
  if os.path.exists(failed):
    os.remove(failed)
  with tempfile.TemporaryDirectory() as workdir:
    args = [f"--config={config}", f"--workdir={workdir}", "--compilation_cache_dir=none",
            "--config.log.error_png=False", *portable_flags(config), *flags, *extra]
    cmd = [sys.executable, os.path.abspath(__file__), "_run", ir_dir, *args]
    code = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
  commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                          capture_output=True, text=True, check=False).stdout.strip()
  not_lowered = []
  if os.path.exists(failed):
    with open(failed) as f:
      not_lowered = [json.loads(line) for line in f]
  with open(os.path.join(ir_dir, DUMP_INFO), "w") as f:
    json.dump({"run": run, "command": ["-m", "alma_jax.main", *args], "lowered_for": "cuda",
               "commit": commit, "returncode": code, "not_lowered": not_lowered}, f, indent=1)
  print(f"{len(dumped_programs(ir_dir))} programs lowered for CUDA in {ir_dir}")
  for entry in not_lowered:
    print(f"not lowered for CUDA: {entry['program']}: {entry['error']}", file=sys.stderr)
  return code or (1 if not_lowered else 0)


def lowering_also_for_cuda(lower: Callable, ir_dir: str) -> Callable:
  """`lower` (JAX's `pjit._resolve_and_lower`) that also lowers every program this process
  compiles for CUDA, in the same trace context, and writes it to `ir_dir` under JAX's own
  dump name (`jax_ir0007_jit_alma_step_eval_compile.mlir`). A program that cannot be lowered
  for CUDA is named, with the error, in `ir_dir`'s NOT_LOWERED; the process goes on."""
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  counter = itertools.count()

  def lower_also_for_cuda(*args, **kwargs):
    lowered = lower(*args, **kwargs)
    if kwargs.get("lowering_platforms") is None:  # a program for this process's backend
      name = kwargs.get("name", "program")
      try:
        module = lower(*args, **dict(kwargs, lowering_platforms=("cuda",),
                                     pgle_profiler=None)).stablehlo()
        text = mlir.module_to_string(module)
        name = ir.StringAttr(module.operation.attributes["sym_name"]).value
      except Exception as e:  # pylint: disable=broad-except  (named in the dump's record)
        with open(os.path.join(ir_dir, NOT_LOWERED), "a") as f:
          f.write(json.dumps({"program": name, "error": f"{type(e).__name__}: {e}"[:500]}) + "\n")
        return lowered
      safe = re.sub(r"[^\w.)( -]", "", name)
      with open(os.path.join(ir_dir, f"jax_ir{next(counter):04d}_{safe}_compile.mlir"), "w") as f:
        f.write(text)
    return lowered

  return lower_also_for_cuda


def run_lowering_for_cuda(ir_dir: str, main_args: list[str]) -> None:
  """(child) Runs `alma_jax.main` with `main_args`, its programs lowered for CUDA too
  (`lowering_also_for_cuda`)."""
  import runpy  # pylint: disable=g-import-not-at-top
  from jax._src import pjit  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top

  lower = getattr(pjit, "_resolve_and_lower", None)
  if lower is None or not hasattr(mlir, "module_to_string"):
    sys.exit("this JAX has no jax._src.pjit._resolve_and_lower (or mlir.module_to_string): "
             "dump cannot lower the run's programs for CUDA; use the JAX of requirements.txt")
  pjit._resolve_and_lower = lowering_also_for_cuda(lower, ir_dir)  # pylint: disable=protected-access
  sys.argv = ["alma_jax.main", *main_args]
  runpy.run_module("alma_jax.main", run_name="__main__", alter_sys=True)


def compile_one(path: str, target: str) -> float:
  """(child) Compiles the StableHLO in `path` for the GPU `target` describes; its seconds."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax._src import compiler  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jaxlib import _jax  # pylint: disable=g-import-not-at-top

  with open(target) as f:
    config = f.read()
  try:
    devices = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                           target_config=config).devices
  except NotImplementedError:
    sys.exit(NO_PLUGIN)
  options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                         device_assignment=np.array([[0]]))
  with open(path) as f:
    text = f.read()
  start = time.perf_counter()
  with mlir.make_ir_context():
    devices[0].client.compile(ir.Module.parse(text), executable_devices=_jax.DeviceList(
        tuple(devices[:1])), compile_options=options)
  return time.perf_counter() - start


def compile_all(ir_dir: str, target: str, only: list[str], top: int) -> list[dict]:
  """Compiles every program of `ir_dir` (those named with a word of `only`, if any), each in
  a child process with XLA's pass log; one row per program."""
  import compile_budget  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, **compile_budget.XLA_PASS_LOG, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
             JAX_PLATFORMS="cuda")
  env.setdefault("XLA_FLAGS", "")
  if "xla_gpu_autotune_level" not in env["XLA_FLAGS"]:  # level 0 needs no device
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_gpu_autotune_level=0".strip()
  rows = []
  for name, path in dumped_programs(ir_dir):
    if only and not any(word in name for word in only):
      continue
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_child", path,
                           f"--target={target}"], capture_output=True, text=True, env=env,
                          check=False)
    if proc.returncode:
      sys.exit(f"{os.path.basename(path)}: {proc.stderr.strip().splitlines()[-1]}")
    # One program per process: no step prefix, so all its passes count under "other".
    passes = compile_budget.xla_passes(proc.stderr, step_prefix="\0").get("other", {})
    slowest = sorted(passes.get("by_pass", {}).items(), key=lambda kv: -kv[1][0])[:top]
    with open(path) as f:
      text = f.read()
    rows.append({"file": os.path.basename(path), "program": name,
                 "stablehlo_lines": text.count("\n"), "threefry": threefry_lowering(text),
                 "compile_s": float(proc.stdout.split()[-1]),
                 "passes_s": passes.get("passes_s", 0.0),
                 "slowest_passes": {p: round(s, 3) for p, (s, _) in slowest}})
    print(table_row(rows[-1]), flush=True)
  return rows


def threefry_lowering(text: str) -> str:
  """How a program's StableHLO computes the Threefry hash of its random draws: "kernel"
  (jaxlib's GPU kernel, `train.gpu_threefry=kernel`), "xla" (its rounds written out, or a
  CPU's loop), "" (it draws nothing). JAX lowers the hash as a function of that name."""
  if "threefry2x32_ffi" in text:
    return "kernel"
  return "xla" if re.search(r"func\.func private @threefry2x32(_\d+)?\(", text) else ""


TABLE_HEAD = ("| program (as JAX wrote it) | StableHLO lines | Threefry hash | compile s | "
              "HLO passes s | slowest passes s |\n|---|---|---|---|---|---|")


def table_row(r: dict) -> str:
  slow = ", ".join(f"{p} {s:.2f}" for p, s in r["slowest_passes"].items())
  return (f"| {r['file']} | {r['stablehlo_lines']} | {r['threefry'] or '-'} | "
          f"{r['compile_s']:.2f} | {r['passes_s']:.2f} | {slow} |")


SUMMARY_HEAD = ("| results file | run | commit | Threefry hash | programs | compile s | "
                "programs that draw | their compile s | slowest program s |\n"
                "|---|---|---|---|---|---|---|---|---|")


def summary_row(path: str) -> str:
  """One line of `summary`: a results file of `compile --out`, its programs' compile seconds
  in all and of those that draw (whose Threefry hash the GPU lowering decides)."""
  with open(path) as f:
    results = json.load(f)
  rows, dump_info = results["rows"], results.get("dump", {})
  drawing = [r for r in rows if r.get("threefry")]
  hashes = "/".join(sorted({r["threefry"] for r in drawing})) or "-"
  slowest = max(rows, key=lambda r: r["compile_s"])
  return (f"| {os.path.basename(path)} | {dump_info.get('run', '?')} | "
          f"{dump_info.get('commit', '?')} | {hashes} | {len(rows)} | "
          f"{sum(r['compile_s'] for r in rows):.1f} | {len(drawing)} | "
          f"{sum(r['compile_s'] for r in drawing):.1f} | "
          f"{slowest['program']} {slowest['compile_s']:.1f} |")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  if sys.argv[1:2] == ["_run"]:  # dump's child: the run, its programs lowered for CUDA too
    sys.path.insert(0, ROOT)
    run_lowering_for_cuda(sys.argv[2], sys.argv[3:])
    return
  ap.add_argument("mode", choices=("dump", "compile", "summary", "_child"))
  # _child: the program's file; summary: results files of `compile --out`
  ap.add_argument("path", nargs="*", help=argparse.SUPPRESS)
  ap.add_argument("--run", default="p4", help="a run of compile_budget.py, or a config")
  ap.add_argument("--ir", help="the folder of the programs' StableHLO (dump writes it)")
  ap.add_argument("--target", default=TARGET, help="the GPU, as a GpuTargetConfigProto text")
  ap.add_argument("--only", default="", help="compile only programs whose names hold one of "
                  "these comma-separated words")
  ap.add_argument("--top", type=int, default=2, help="slowest passes shown per program")
  ap.add_argument("--out", help="also write the rows as JSON here")
  args, extra = ap.parse_known_args()
  extra = [a for a in extra if a != "--"]
  sys.path.insert(0, ROOT)
  sys.path.insert(0, HERE)
  if args.mode == "_child":
    print(f"{compile_one(args.path[0], args.target):.4f}")
    return
  if args.path and args.mode != "summary":
    ap.error(f"unrecognized arguments: {' '.join(args.path)}")
  if args.mode == "summary":
    if not args.path or extra:
      ap.error("summary: give the results files of `compile --out` (and no other flags)")
    missing = [p for p in args.path if not os.path.isfile(p)]
    if missing:
      ap.error(f"summary: no such results file: {', '.join(missing)}")
    print(SUMMARY_HEAD)
    for path in args.path:
      print(summary_row(path))
    return
  from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top
  io_utils.check_output_file(ap, "--out", args.out)  # before compiling
  if not args.ir:
    ap.error("--ir is needed")
  if extra and args.mode != "dump":  # only a run takes flags of its own
    ap.error(f"unrecognized arguments: {' '.join(extra)} (flags after `--` go to `dump`'s run)")
  if args.mode == "dump":
    sys.exit(dump(args.run, args.ir, extra))
  if not dumped_programs(args.ir):
    sys.exit(f"--ir={args.ir} holds no programs (`dump` writes them)")
  if not any(importlib.util.find_spec(p) for p in PLUGINS):
    ap.error(f"compile: {NO_PLUGIN}")
  print(TABLE_HEAD)
  rows = compile_all(args.ir, args.target, [w for w in args.only.split(",") if w], args.top)
  if args.out:
    import jax  # pylint: disable=g-import-not-at-top
    import peer  # pylint: disable=g-import-not-at-top
    info = {}
    if os.path.exists(os.path.join(args.ir, DUMP_INFO)):
      with open(os.path.join(args.ir, DUMP_INFO)) as f:
        info = json.load(f)
    with open(args.out, "w") as f:
      json.dump({"target": os.path.relpath(args.target, ROOT), "jax": jax.__version__,
                 "cpu": peer.this_cpu(), "dump": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
