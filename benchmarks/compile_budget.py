"""Where compilation goes in whole runs: seconds per program kind, XLA programs, cache hits.

Runs each named run twice as separate processes sharing one fresh persistent
compilation cache: "cold" (an empty cache) and then "warm" (the cache the cold
run wrote). Every process is `alma_jax.main` with listeners added (this file's
`--child` mode), which count per program kind (the run's steps by name:
train, eval, ...; "other" for eager operations and small utilities) the
seconds spent tracing, lowering and compiling or loading, and the XLA
programs built or loaded, and note which programs the persistent cache
missed and why it did not store them. A warm run should load every program
from the cache: its misses are listed by name. `--next_seed=true` adds a
third run with `--config.seed=1` on the same cache, as the next run of a
sweep over seeds (its misses listed too); `--next_flags="--config.stream.wait=10"`
one with those flags added, as the next cell of a grid (row "next"). The traces that only count
FLOPs (the run's Comp accounting) build no program: their seconds are a
column of their own, not compilation.

  python benchmarks/compile_budget.py                          # p3, p4, lm_base, lm_base_unrolled
  python benchmarks/compile_budget.py --runs=p1,p3,p4 --out=/tmp/compile.json
  python benchmarks/compile_budget.py --runs=lm_base,lm_base_unrolled --warm=false
  python benchmarks/compile_budget.py --runs=p4,ff_quick --next_seed=true
  python benchmarks/compile_budget.py --runs=ff_quick --next_flags="--config.stream.wait=10"
  python benchmarks/compile_budget.py --runs=p4 -- --config.method.slots=exact

Named runs (`RUNS`): the timing protocols p1-p4 (configs/bench), the
Switch Transformer presets with the smoke stream (lm_base, lm_large; with
`_unrolled` for the unrolled form): the preset's model and sequence length
(L = 512), 2 sequences per step, 8 steps per call, two stages -- the preset's
programs, with little training; and ff_quick (`configs/mnist_ff.py:quick`
over 50 mega-batches with a stage every 5: nine growths, in `:quick`'s 256 channel
slots from the start; `-- --config.method.min_slots=0` for powers of two alone). Anything after `--` is passed to every run.
It runs unchanged on a GPU (benchmarks/README.md says how).

`--xla_cpu_log=true` (a CPU) also splits the cold run's XLA compiles, per
program kind, into XLA's HLO passes and its code generation, and counts the
LLVM modules compiled (one kernel each; "part": a part of several) with their
seconds by kind (fusions named after their operations, numbers dropped:
"multiply_add_fusion"), read from XLA:CPU's own
log lines (`TF_CPP_VMODULE=cpu_compiler=2,ir_compiler=1`): where a program's
compile goes, e.g. a scanned model's stacking kernels or an optimizer's
per-parameter updates.

  python benchmarks/compile_budget.py --runs=lm_base,lm_base_unrolled --warm=false --xla_cpu_log=true

`--xla_pass_log=true` (any backend) times the cold run's XLA compiles pass by
pass (`TF_CPP_VMODULE=hlo_pass_pipeline=1`): per program kind, the seconds of
its HLO passes and its slowest passes -- on an accelerator, whether a slow
compile is a fusion pass, an autotuner, or neither (then code generation).

  python benchmarks/compile_budget.py --runs=p4 --warm=false --xla_pass_log=true
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LM = ("configs/lm_sm.py:smoke,{preset} --config.data.seq_len=512 --config.train.batch_size=2 "
       "--config.train.steps_per_epoch=8 --config.train.steps_per_call=8 "
       "--config.stream.num_megabatches=2")
RUNS = {
    "p1": "configs/bench/p1_cifar_sm.py",
    "p2": "configs/bench/p2_cifar_ens.py",
    "p3": "configs/bench/p3_mnist_sm.py",
    "p4": "configs/bench/p4_mnist_gmoe.py",
    "lm_base": _LM.format(preset="base"),
    "lm_base_unrolled": _LM.format(preset="base") + " --config.model.scan_layers=False",
    "lm_large": _LM.format(preset="large"),
    "lm_large_unrolled": _LM.format(preset="large") + " --config.model.scan_layers=False",
    # Firefly's growth: MNIST, 50 mega-batches, a stage every 5 (9 growths).
    "ff_quick": ("configs/mnist_ff.py:quick --config.stream.num_megabatches=50 "
                 "--config.stream.wait=5"),
}
DEFAULT_RUNS = "p3,p4,lm_base,lm_base_unrolled"
NEXT_SEED = "seed 1"  # the row of a run with another seed on the cache the first ones wrote
NEXT = "next"  # the row of a run with `--next_flags` added, on that cache too
# Traces that count FLOPs (`timing.counting`): no program, not compilation; reported apart.
ACCOUNTING = "flop_counting"
# The phases of a program's compilation (`jax.monitoring` event names, last part): tracing to a
# jaxpr, lowering to StableHLO, and XLA's compilation (or, on a cache hit, loading the program).
PHASES = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")


# XLA:CPU's log lines of a compile: the HLO passes and the whole compile of a module (its name
# as `jit_<function>`), and every LLVM kernel module compiled in between.
XLA_CPU_LOG = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "cpu_compiler=2,ir_compiler=1"}
# XLA writes a duration in the unit that suits it: "840 us", "9.91 ms", "1.2 s", "1.5 min".
_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_TIME = r"([0-9.]+) (ns|us|ms|s|min|h)"
_HLO_PASSES = re.compile(r"Running HLO passes on \[(\S+)\] for CPU time: " + _TIME + " ")
_COMPILED = re.compile(r"Compiling \[(\S+)\] for CPU using JIT time: " + _TIME + " ")
_KERNEL = re.compile(r"Compiled LLVM module: (\S+) time: " + _TIME + " ")


def kernel_kind(name: str) -> str:
  """An LLVM module's kind: its kernel's name without XLA's prefixes, suffix and numbering
  ("__compute_module_multiply_add_fusion.12_kernel_module" -> "multiply_add_fusion"), or
  "part" for one part of a module whose code generation XLA split (several kernels)."""
  kind = re.sub(r"_kernel_module$", "", re.sub(r"^(?:__compute_module_)+", "", name))
  kind = re.sub(r"\.\d+", "", kind)
  return "part" if re.fullmatch(r"part_\d+", kind) else kind or name


def xla_cpu_compiles(log: str, step_prefix: str) -> dict:
  """Per program kind, from XLA:CPU's log lines (`XLA_CPU_LOG`) in `log`: programs compiled,
  seconds of HLO passes and of the rest of the compile (code generation), LLVM modules
  compiled (a kernel each, or a part of several) and their seconds, and per kind
  (`kernel_kind`) [seconds, modules]. XLA compiles one module at a time:
  a kernel belongs to the module whose HLO passes ran last."""
  out: dict[str, dict] = {}
  current = None
  for line in log.splitlines():
    m = _HLO_PASSES.search(line)
    if m:
      kind = kind_of(m.group(1), step_prefix)
      current = out.setdefault(kind, {"programs": 0, "hlo_passes_s": 0.0, "codegen_s": 0.0,
                                      "kernels": 0, "kernel_s": 0.0, "by_kernel": {}})
      current["programs"] += 1
      current["hlo_passes_s"] += float(m.group(2)) * _UNIT[m.group(3)]
      continue
    m = _KERNEL.search(line)
    if m and current is not None:
      seconds = float(m.group(2)) * _UNIT[m.group(3)]
      current["kernels"] += 1
      current["kernel_s"] += seconds
      entry = current["by_kernel"].setdefault(kernel_kind(m.group(1)), [0.0, 0])
      entry[0] += seconds
      entry[1] += 1
      continue
    m = _COMPILED.search(line)
    if m and current is not None:
      current["codegen_s"] += float(m.group(2)) * _UNIT[m.group(3)]
      current = None
  return out


# XLA's log lines of every HLO pass, on any backend (`hlo_pass_pipeline.cc`): a pipeline
# starting on a module, and each pass's seconds. A pipeline nested in another is itself logged
# as a pass of its parent, with its passes' time inside.
XLA_PASS_LOG = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1"}
# absl's prefix of a log line: level, date, time, thread, file:line.
_LOG_PREFIX = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+(\d+) \S+:\d+\] ")
_PIPELINE = re.compile(r"Running HLO pass pipeline on module (\S+): (.+?)\s*$")
_PASS = re.compile(r"HLO pass: (.+?) time: " + _TIME + r"\b(?: \((\d+) us\))?")


def log_env(xla_cpu_log: bool, xla_pass_log: bool) -> dict:
  """The environment a child process needs for the XLA logs asked for (one TF_CPP_VMODULE)."""
  env, modules = {}, []
  for wanted, extra in ((xla_cpu_log, XLA_CPU_LOG), (xla_pass_log, XLA_PASS_LOG)):
    if wanted:
      env.update(extra)
      modules.append(extra["TF_CPP_VMODULE"])
  if modules:
    env["TF_CPP_VMODULE"] = ",".join(modules)
  return env


def xla_passes(log: str, step_prefix: str) -> dict:
  """Per program kind, from XLA's HLO-pass log lines (`XLA_PASS_LOG`) in `log`: the seconds
  of its HLO passes ("passes_s", nested pipelines counted once, through their passes) and per
  pass name [seconds, runs] ("by_pass"). A pass line belongs to the module whose pipeline
  last started on the same thread (threads are told apart by the log's thread id). Modules
  that XLA compiles inside a pass (an autotuner's candidate kernels) have names of their own:
  their passes count under "other", and inside the pass that compiled them."""
  out: dict[str, dict] = {}
  module_of: dict[str, str] = {}  # thread -> module
  pipelines: dict[str, set] = collections.defaultdict(set)  # module -> its pipelines' names
  for line in log.splitlines():
    if "HLO pass" not in line:
      continue
    m = _LOG_PREFIX.match(line)
    thread = m.group(2) if m else ""
    m = _PIPELINE.search(line)
    if m:
      module_of[thread] = m.group(1)
      pipelines[m.group(1)].add(m.group(2))
      continue
    m = _PASS.search(line)
    if not m or thread not in module_of:
      continue
    module = module_of[thread]
    if m.group(1) in pipelines[module]:  # a nested pipeline: its passes are counted
      continue
    seconds = (int(m.group(4)) * 1e-6 if m.group(4)
               else float(m.group(2)) * _UNIT[m.group(3)])
    kind = kind_of(re.sub(r"\.\d+$", "", module), step_prefix)
    entry = out.setdefault(kind, {"passes_s": 0.0, "by_pass": {}})
    entry["passes_s"] += seconds
    by = entry["by_pass"].setdefault(m.group(1), [0.0, 0])
    by[0] += seconds
    by[1] += 1
  return out


def kind_of(fun_name: str, step_prefix: str) -> str:
  """The program kind of a compile event's function name ("jit(alma_step_train)" -> train)."""
  name = str(fun_name)
  if step_prefix not in name:
    return "other"
  kind = name.split(step_prefix, 1)[1]
  return kind.split(")", 1)[0].split("(", 1)[0].strip("_") or "other"


# -- the child: alma_jax.main with listeners ------------------------------------------------------
class Tally:
  """What a child process compiled, per program kind, kept in `out_path` (JSON) as it goes.

  `kind_of_event(fun_name)` names an event's program kind; `backend_compile` is the event
  that builds or loads an executable (one per XLA program). The run traces its FLOP counts on
  a background thread (`alma_jax.runtime.background`): events arrive from both threads, and
  one thread at a time updates the tallies and rewrites the file.
  """

  def __init__(self, out_path: str, step_prefix: str, kind_of_event: Callable[[str], str],
               backend_compile: str):
    self.out_path, self.step_prefix, self.kind_of_event = out_path, step_prefix, kind_of_event
    self.backend_compile = backend_compile
    self.t0 = time.monotonic()
    self.seconds, self.programs, self.names, self.phases = (
        collections.Counter(), collections.Counter(), collections.Counter(),
        collections.Counter())
    self.name_seconds = collections.Counter()  # a program's tracing, lowering and compile
    self.cache = {"hits": [], "misses": [], "not_written": []}
    self.cpu = {}  # label -> [CPU seconds of the thread that ran it, calls] (`timed_cpu`)
    self.slow = []  # (seconds since start, function, phase, duration) of each phase over 0.5 s
    self._lock = threading.RLock()

  def duration(self, event: str, duration: float, **kwargs) -> None:
    """One compile-path event of `duration` seconds."""
    fun_name = str(kwargs.get("fun_name", ""))
    with self._lock:
      kind = self.kind_of_event(fun_name)
      self.seconds[kind] += duration
      if kind != ACCOUNTING:
        self.phases[event.rsplit("/", 1)[1]] += duration
        self.name_seconds[fun_name] += duration
      if duration > 0.5:
        self.slow.append((round(time.monotonic() - self.t0, 1), fun_name or kind,
                          event.rsplit("/", 1)[1], round(duration, 2)))
      if event == self.backend_compile:
        self.programs[kind] += 1
        self.names[fun_name] += 1
      if duration > 0.5 or event == self.backend_compile:
        self.write()  # what a run cut short had compiled so far stays readable

  def add_cpu(self, label: str, seconds: float) -> None:
    with self._lock:
      entry = self.cpu.setdefault(label, [0.0, 0])
      entry[0] += seconds
      entry[1] += 1

  def note(self, key: str, text: str) -> None:
    """A persistent-cache note (`key`: hits, misses or not_written) about a program."""
    with self._lock:
      self.cache[key].append(text)

  def write(self) -> None:
    with self._lock:
      with open(self.out_path + ".tmp", "w") as f:
        json.dump({"wall_s": time.monotonic() - self.t0, "step_prefix": self.step_prefix,
                   "seconds": dict(self.seconds),
                   "programs": dict(self.programs), "names": dict(self.names.most_common()),
                   "name_seconds": {n: round(s, 3) for n, s in self.name_seconds.most_common()},
                   "phases": dict(self.phases),
                   "slow_phases": self.slow, "cache_write_cpu_s": self.cpu, **self.cache}, f)
      os.replace(self.out_path + ".tmp", self.out_path)


def timed_cpu(owner, name: str, label: str, tally: Tally) -> bool:
  """Replaces `owner.name` (a function or method) by one that adds the CPU seconds of each call
  (its thread's) to `tally` under `label`; False, and nothing replaced, where `owner` has no
  such attribute (another JAX)."""
  real = getattr(owner, name, None)
  if real is None:
    return False

  def timed(*args, **kwargs):
    t0 = time.thread_time()
    try:
      return real(*args, **kwargs)
    finally:
      tally.add_cpu(label, time.thread_time() - t0)

  setattr(owner, name, timed)
  return True


# What a compiled program costs to write down (CPU seconds): JAX's persistent cache entry
# (XLA serialises the executable, then compresses it) and the kept program (`executables`).
CACHE_WRITES = (("jax._src.compilation_cache", "put_executable_and_time", "jax_entry"),
                ("alma_jax.runtime.executables", "_Store.save_program", "kept_program"))


def child(out_path: str, argv: list[str]) -> None:
  """Runs `alma_jax.main` with `argv`, writing what compilation cost to `out_path` at exit."""
  import atexit  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  # This checkout's package, not the installed one: run from a worktree, the script measures
  # the worktree's code.
  sys.path.insert(0, ROOT)
  from alma_jax import main as alma_main  # first: it sets the process's options before JAX starts
  from alma_jax.engine import timing  # pylint: disable=g-import-not-at-top
  from jax import monitoring  # pylint: disable=g-import-not-at-top

  tally = Tally(out_path, timing.STEP_PREFIX,
                lambda fun_name: (ACCOUNTING if timing.counting_now()
                                  else kind_of(fun_name, timing.STEP_PREFIX)),
                timing.BACKEND_COMPILE)

  def on_duration(event: str, duration: float, **kwargs) -> None:
    if event in timing.COMPILE_EVENTS:
      tally.duration(event, duration, **kwargs)

  monitoring.register_event_duration_secs_listener(on_duration)
  import importlib  # pylint: disable=g-import-not-at-top
  for module, attr, label in CACHE_WRITES:
    owner, _, name = attr.rpartition(".")
    try:
      target = importlib.import_module(module)
    except ImportError:
      continue
    timed_cpu(getattr(target, owner) if owner else target, name, label, tally)
  patterns = (("hits", re.compile(r"(?:Persistent compilation cache hit|Kept program loaded) "
                                  r"for '([^']*)'")),
              ("misses", re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']*)'")),
              ("not_written", re.compile(r"Not writing persistent cache entry for '([^']*)' "
                                         r"because (.*)")))

  class Notes(logging.Handler):
    def emit(self, record):
      text = record.getMessage()
      for key, pattern in patterns:
        m = pattern.search(text)
        if m:
          tally.note(key, m.group(1) if key != "not_written" else f"{m.group(1)}: "
                     f"{m.group(2)}")

  for source in ("jax._src.compiler", "alma_jax.runtime.executables"):
    compiler_log = logging.getLogger(source)
    compiler_log.setLevel(logging.DEBUG)
    compiler_log.propagate = False  # its debug lines stay out of the run's output
    compiler_log.addHandler(Notes())

  atexit.register(tally.write)
  sys.argv = ["alma_jax.main", *argv]
  alma_main.console()


# -- the parent -----------------------------------------------------------------------------------
def error_tail(stderr: str, chars: int = 3000) -> str:
  """The end of a failed run's stderr without XLA's informational log lines (which the XLA
  logs asked for would otherwise fill it): the run's own error stays readable."""
  def info(line):
    m = _LOG_PREFIX.match(line)
    return m is not None and m.group(1) == "I"
  return "\n".join(l for l in stderr.splitlines() if not info(l))[-chars:]


# A process past its time limit is sent SIGTERM (a run then saves what it has and exits) and is
# killed if it has not ended this many seconds later.
STOP_GRACE_S = 15.0


def run_child(cmd: list[str], env: dict | None, timeout: float | None
              ) -> tuple[int, str, str, bool]:
  """Runs `cmd` from the repository root in a process group of its own: (exit status, stdout,
  stderr, whether it ran past `timeout` seconds and was stopped: SIGTERM to the group, then
  SIGKILL `STOP_GRACE_S` later, so that no process it started outlives it). None: no limit."""
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, False
  except subprocess.TimeoutExpired:
    _signal_group(proc, signal.SIGTERM)
    try:
      out, err = proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
      _signal_group(proc, signal.SIGKILL)
      out, err = proc.communicate()
    _signal_group(proc, signal.SIGKILL)  # whatever it started and left behind
    return proc.returncode, out, err, True


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def timed_out_row(timeout: float) -> dict:
  """The row of a process stopped at its time limit of `timeout` seconds."""
  return {"error": f"timed out after {timeout:.0f} s", "timed_out_s": timeout}


def _with_totals(tally: dict) -> dict:
  """A child's tally with its totals: FLOP-counting seconds apart (`counting_s`), compile
  seconds and XLA programs summed over the program kinds."""
  tally["counting_s"] = tally["seconds"].pop(ACCOUNTING, 0.0)
  tally["compile_s"] = sum(tally["seconds"].values())
  tally["xla_programs"] = sum(tally["programs"].values())
  return tally


def _tally_so_far(out: str, timeout: float) -> dict:
  """The row of a run stopped at its time limit: what its child had tallied by then."""
  row = timed_out_row(timeout)
  try:
    with open(out) as f:
      row["so_far"] = _with_totals(json.load(f))
  except (OSError, ValueError):
    pass
  return row


def run_one(spec: str, extra: list[str], cache_dir: str, xla_cpu_log: bool = False,
            xla_pass_log: bool = False, timeout: float | None = None) -> dict:
  """One process of run `spec` (a config and its overrides) with the cache `cache_dir`;
  `xla_cpu_log`: with XLA:CPU's compile log, read into `xla_cpu` (`xla_cpu_compiles`);
  `xla_pass_log`: with XLA's HLO-pass log (any backend), read into `xla_passes`.
  `timeout`: seconds after which the process is stopped; its row is then an error with
  `timed_out_s` and, under `so_far`, the compile seconds and programs it had tallied."""
  parts = shlex.split(spec) + list(extra)
  with tempfile.TemporaryDirectory() as workdir:
    out = os.path.join(workdir, "compile.json")
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={out}", "--",
           f"--config={parts[0]}", f"--workdir={os.path.join(workdir, 'run')}",
           f"--compilation_cache_dir={cache_dir}", *parts[1:]]
    t0 = time.monotonic()
    logs = log_env(xla_cpu_log, xla_pass_log)
    env = {**os.environ, **logs} if logs else None
    returncode, _, stderr, timed_out = run_child(cmd, env, timeout)
    wall = time.monotonic() - t0
    if timed_out:
      return _tally_so_far(out, timeout)
    if returncode:
      raise SystemExit(f"compile_budget: {spec} failed (exit {returncode}):\n"
                       f"{error_tail(stderr)}")
    with open(out) as f:
      result = json.load(f)
    with open(os.path.join(workdir, "run", "summary.json")) as f:
      summary = json.load(f)
  result = _with_totals(result)
  result["process_s"] = wall
  result["num_compilations"] = summary.get("num_compilations")
  result["final_error"] = summary.get("final_error")
  result["timings"] = summary.get("timings", {})
  if xla_cpu_log:
    result["xla_cpu"] = xla_cpu_compiles(stderr, result["step_prefix"])
  if xla_pass_log:
    result["xla_passes"] = xla_passes(stderr, result["step_prefix"])
    if not result["xla_passes"]:  # a log format this parser does not know: keep a sample
      result["xla_pass_log_sample"] = [l for l in stderr.splitlines() if "pass" in l][-40:]
  return result


def _kinds(r: dict, top: int = 4) -> str:
  order = sorted(r["seconds"], key=lambda k: -r["seconds"][k])[:top]
  return ", ".join(f"{k} {r['seconds'][k]:.1f} s / {r['programs'].get(k, 0)}" for k in order)


def _writes(r: dict) -> str:
  cpu = r.get("cache_write_cpu_s") or {}
  return " / ".join(f"{cpu[k][0]:.2f}" if k in cpu else "-" for k in ("jax_entry", "kept_program"))


def table(results: dict) -> str:
  lines = ["| run | cache | process s | compile s (share) | trace / lower / compile or load s | "
           "FLOP-counting traces s | XLA programs | cache hits / requests | "
           "writing programs down, CPU s (JAX's entries / kept) | "
           "compile s / programs by kind | warm misses |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, by_cache in results.items():
    for which, r in by_cache.items():
      asked = len(r["hits"]) + len(r["misses"])
      misses = sorted(collections.Counter(r["misses"]).items())
      missed = ("; ".join(f"{m} x{n}" if n > 1 else m for m, n in misses[:6])
                + (f" (+{len(misses) - 6} more)" if len(misses) > 6 else "")
                if which != "cold" else "")
      share = r["compile_s"] / r["process_s"] if r["process_s"] > 0 else 0.0
      ph = r.get("phases", {})
      phases = " / ".join(f"{ph.get(p, 0.0):.1f}" for p in PHASES)
      lines.append(f"| {name} | {which} | {r['process_s']:.1f} | {r['compile_s']:.1f} "
                   f"({share:.0%}) | {phases} | {r.get('counting_s', 0.0):.1f} | "
                   f"{r['xla_programs']} | "
                   f"{len(r['hits'])} / {asked} | {_writes(r)} | {_kinds(r)} | "
                   f"{missed or ('none' if which != 'cold' else '')} |")
  return "\n".join(lines)


def _slowest(by: dict, top: int) -> str:
  """"name s / count" of the `top` largest [seconds, count] entries of `by`."""
  return ", ".join(f"{k} {v[0]:.2f} / {v[1]}"
                   for k, v in sorted(by.items(), key=lambda kv: -kv[1][0])[:top])


def _kind_rows(results: dict, field: str, nothing: str, order, cells) -> list[str]:
  """Table rows per (run, cache, program kind) of the results that hold `field` (a dict per
  kind), ordered by `order(result, kind, entry)`; `nothing`: the cells of a result whose log
  had none; `cells(result, kind, entry)`: the cells after the kind."""
  rows = []
  for name, by_cache in results.items():
    for which, r in by_cache.items():
      if field not in r:
        continue
      if not r[field]:
        rows.append(f"| {name} | {which} | {nothing} |")
      for kind, c in sorted(r[field].items(), key=lambda kv, r=r: order(r, *kv)):
        rows.append(f"| {name} | {which} | {kind} | {cells(r, kind, c)} |")
  return rows


def xla_cpu_table(results: dict, top: int = 5) -> str:
  """The runs' XLA:CPU compiles per program kind (`xla_cpu_compiles`), largest first."""
  return "\n".join(
      ["| run | cache | program kind | programs | HLO passes s | code generation s | "
       "LLVM modules | their s by kind (s / modules) |", "|---|---|---|---|---|---|---|---|"]
      + _kind_rows(results, "xla_cpu", "(no XLA:CPU compile in its log) | | | | |",
                   lambda r, kind, c: -(c["hlo_passes_s"] + c["codegen_s"]),
                   lambda r, kind, c: (f"{c['programs']} | {c['hlo_passes_s']:.2f} | "
                                       f"{c['codegen_s']:.2f} | {c['kernels']} | "
                                       + _slowest(c["by_kernel"], top))))


def xla_pass_table(results: dict, top: int = 5) -> str:
  """The runs' HLO passes per program kind (`xla_passes`), the kinds with most XLA compile
  first; `results`: {run: {cache: result}} as `main` builds it."""
  return "\n".join(
      ["| run | cache | program kind | compile s (programs) | HLO passes s | "
       "slowest passes (s / runs) |", "|---|---|---|---|---|---|"]
      + _kind_rows(results, "xla_passes", "(no HLO pass in its log) | | |",
                   lambda r, kind, c: -r["seconds"].get(kind, c["passes_s"]),
                   lambda r, kind, c: (f"{r['seconds'].get(kind, 0.0):.2f} "
                                       f"({r['programs'].get(kind, 0)}) | {c['passes_s']:.2f} | "
                                       + _slowest(c["by_pass"], top))))


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1].startswith("--child="):
    rest = sys.argv[2:]
    child(sys.argv[1].split("=", 1)[1], rest[1:] if rest[:1] == ["--"] else rest)
    return
  argv, extra = sys.argv[1:], []
  if "--" in argv:
    argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", default=DEFAULT_RUNS,
                  help=f"comma-separated names of {sorted(RUNS)}")
  ap.add_argument("--warm", default="true", choices=("true", "false"),
                  help="run each a second time on the cache the first one wrote")
  ap.add_argument("--next_seed", default="false", choices=("true", "false"),
                  help="then run each with --config.seed=1 on the same cache (the next run of "
                       "a sweep over seeds)")
  ap.add_argument("--next_flags", default="",
                  help="then run each with these flags added on the same cache (the next cell "
                       "of a grid, e.g. \"--config.stream.wait=10\")")
  ap.add_argument("--xla_cpu_log", default="false", choices=("true", "false"),
                  help="split the cold run's XLA:CPU compiles into HLO passes and code "
                       "generation per program kind, with the kernels generated")
  ap.add_argument("--xla_pass_log", default="false", choices=("true", "false"),
                  help="time the cold run's XLA compiles pass by pass (any backend: where an "
                       "accelerator's compile goes), per program kind")
  ap.add_argument("--out", default=None, help="also write the results as JSON here")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)  # this checkout's package
  from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top
  io_utils.check_output_file(ap, "--out", args.out)  # before measuring
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  # Here, not at the top: a child process imports alma_jax.main before anything else.
  import peer  # pylint: disable=g-import-not-at-top
  started = peer.start_stamp()
  names = [n for n in args.runs.split(",") if n]
  unknown = [n for n in names if n not in RUNS]
  if unknown or not names:
    ap.error(f"--runs={args.runs}: " + (f"unknown runs {unknown}" if unknown else "no run")
             + f"; valid: {sorted(RUNS)}")
  nexts = ([(NEXT_SEED, ["--config.seed=1"])] if args.next_seed == "true" else []) + (
      [(NEXT, shlex.split(args.next_flags))] if args.next_flags else [])
  results = {}
  for name in names:
    with tempfile.TemporaryDirectory() as cache_dir:
      results[name] = {"cold": run_one(RUNS[name], extra, cache_dir,
                                       xla_cpu_log=args.xla_cpu_log == "true",
                                       xla_pass_log=args.xla_pass_log == "true")}
      print(f"{name} cold: {results[name]['cold']['process_s']:.1f} s", file=sys.stderr,
            flush=True)
      if args.warm == "true":
        results[name]["warm"] = run_one(RUNS[name], extra, cache_dir)
        print(f"{name} warm: {results[name]['warm']['process_s']:.1f} s", file=sys.stderr,
              flush=True)
      for row, flags in nexts:
        results[name][row] = run_one(RUNS[name], extra + flags, cache_dir)
        print(f"{name} {row}: {results[name][row]['process_s']:.1f} s", file=sys.stderr,
              flush=True)
  print(table(results))
  if args.xla_cpu_log == "true":
    print()
    print(xla_cpu_table(results))
  if args.xla_pass_log == "true":
    print()
    print(xla_pass_table(results))
  if args.out:
    from alma_jax.observers import summary  # pylint: disable=g-import-not-at-top
    with open(args.out, "w") as f:
      json.dump({"runs": {n: RUNS[n] for n in names}, "extra": extra,
                 "next_flags": args.next_flags, "results": results,
                 # what measured it: the package's commit, the CPU, the versions, the command,
                 # when it started and the load average over the minute before
                 "provenance": {**summary.provenance(), **started}}, f, indent=1)


if __name__ == "__main__":
  main()
