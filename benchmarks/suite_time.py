"""Times the test suite as the README runs it, with the host's speed measured beside it.

The suite's wall time on a shared 2-core host moves with the host's speed
from hour to hour (the same commit has taken 12 and 15 minutes an hour
apart), more than most changes to the tests move it. This script runs the
README's test command with `--durations=0` and writes, as JSON: the wall
time, the outcome, the seconds of every test phase summed per test file
(the workers' seconds), the slowest phases, the commit, the CPU, the load
before, and a *probe* of the host's speed: a fixed JAX workload (tracing,
lowering and compiling the gradient of a small network for a few shapes, as
the suite does thousands of times) timed in fresh processes before and after
the suite. The probe does not depend on this package's code or on the
suite's settings, so its seconds compare across commits: a suite that took
longer while the probe took as much longer is the host, not the change.
It also records how busy the CPUs were in the second before the suite (what
the load average, a minute's memory, cannot say) and the CPU seconds the
suite used: their share of the cores over its wall time says how much of
the machine the workers kept busy.

  python benchmarks/suite_time.py --out=benchmarks/results/<host>_<date>/suite_<commit>.json
  # against an earlier file: per test file, the seconds of both and their ratio
  python benchmarks/suite_time.py --out=new.json --compare=old.json
  python benchmarks/suite_time.py --compare=old.json --read=new.json   # no new run
  python benchmarks/suite_time.py --probe_only   # the probe alone (e.g. beside a CI run)
  # every whole-suite run kept under benchmarks/results, per host (CONTRIBUTING.md's table)
  python benchmarks/suite_time.py --history [--runs]

Run it on an idle machine: the suite keeps both cores busy, and anything
beside it is in its time. Arguments after `--` go to pytest in place of
`tests` (e.g. `-- tests/policies`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top,wrong-import-position
import peer  # pylint: disable=g-import-not-at-top,wrong-import-position

WORKERS = 3  # the README's test command: `python -m pytest -q -n 3 tests`
SLOWEST = 60  # slowest test phases kept in the results
_PHASE = re.compile(r"^(\d+(?:\.\d+)?)s (call|setup|teardown)\s+(\S.*)$")
_END = re.compile(r"^=*\s*(.*?) in (\d+(?:\.\d+)?)s(?: \(\S+\))?\s*=*$")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")

# The probe: the gradient of a tanh network of PROBE_DEPTH layers, traced, lowered and compiled
# for each width, with XLA's optimisations off as in the suite's own compiles. Fixed here, so
# that its seconds stay comparable across commits; change it and earlier probes compare no more.
PROBE_WIDTHS = tuple(range(24, 216, 16))  # 12 shapes
PROBE_DEPTH = 16
PROBE_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_ENABLE_COMPILATION_CACHE": "false",
             "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def probe_child() -> None:
  """The probe's workload in this process; prints its seconds (after JAX's import) as JSON."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def loss(weights, x):
    for w in weights:
      x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)

  grad = jax.jit(jax.value_and_grad(loss))
  start = time.perf_counter()
  for width in PROBE_WIDTHS:
    weights = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * PROBE_DEPTH
    grad.lower(weights, jax.ShapeDtypeStruct((8, width), jnp.float32)).compile()
  print(json.dumps({"probe_s": time.perf_counter() - start}))


def probe(runs: int) -> list[float]:
  """The probe's seconds in `runs` fresh processes, one after another."""
  env = {**os.environ, **PROBE_ENV}
  out = []
  for _ in range(runs):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe_child"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
      raise RuntimeError(f"the probe failed (exit code {proc.returncode}): {proc.stderr[-2000:]}")
    out.append(round(json.loads(proc.stdout.strip().splitlines()[-1])["probe_s"], 3))
  return out


def parse(output: str) -> dict:
  """pytest's `--durations=0` output: every phase listed (seconds, phase, test id), the
  seconds summed per test file, the outcome counts and the seconds pytest reports."""
  phases, files = [], collections.Counter()
  counts, pytest_s = {}, None
  for line in output.splitlines():
    line = line.strip()
    m = _PHASE.match(line)
    if m:
      seconds, phase, test = float(m.group(1)), m.group(2), m.group(3)
      phases.append((seconds, phase, test))
      files[test.split("::")[0]] += seconds
      continue
    m = _END.match(line)
    if m and _COUNT.search(m.group(1)):
      pytest_s = float(m.group(2))
      counts = {("errors" if k.startswith("error") else k): int(n)
                for n, k in _COUNT.findall(m.group(1))}
  phases.sort(key=lambda p: -p[0])
  return {"pytest_s": pytest_s, "outcome": counts,
          "worker_s": round(sum(p[0] for p in phases), 2),
          "files": {f: round(s, 2) for f, s in files.items()},
          "slowest": [list(p) for p in phases[:SLOWEST]]}


def _children_cpu_s() -> float:
  """User and system CPU seconds of the ended child processes of this one (and theirs)."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run_suite(pytest_args: list[str], probe_runs: int) -> dict:
  """Runs the suite (`pytest_args` in place of `tests`) between two probes of the host."""
  from alma_jax.observers import summary  # pylint: disable=g-import-not-at-top
  source = summary.provenance()
  command = [sys.executable, "-m", "pytest", "-q", "-n", str(WORKERS), "-p", "no:cacheprovider",
             "--durations=0", *(pytest_args or ["tests"])]
  result = {"commit": source["commit"], "cpu": source["cpu"], "jax": source["jax"],
            "python": source["python"], "command": " ".join(command[1:]), **peer.start_stamp()}
  result["probe_before_s"] = probe(probe_runs)
  result["busy_before"] = round(peer.busy_share(), 3)  # after the probes: their CPU is done
  print(f"probe before: {result['probe_before_s']} s; running {result['command']}",
        file=sys.stderr, flush=True)
  start, used = time.monotonic(), _children_cpu_s()
  lines = []
  with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True) as proc:
    for line in proc.stdout:  # pytest's progress shown as it comes, its durations kept
      lines.append(line)
      if not _PHASE.match(line.strip()):
        sys.stderr.write(line)
        sys.stderr.flush()
  result["wall_s"] = round(time.monotonic() - start, 2)
  result["cpu_s"] = round(_children_cpu_s() - used, 2)  # the suite's processes, all of them
  cores = os.cpu_count() or 1
  result["cpu_share"] = round(result["cpu_s"] / max(result["wall_s"] * cores, 1e-9), 3)
  result["returncode"] = proc.returncode
  output = "".join(lines)
  result.update(parse(output))
  if proc.returncode != 0:
    result["output_tail"] = output[-4000:]
  result["probe_after_s"] = probe(probe_runs)
  return result


def probe_median(result: dict) -> float | None:
  values = result.get("probe_before_s", []) + result.get("probe_after_s", [])
  return statistics.median(values) if values else None


def summary_text(result: dict, top: int = 15) -> str:
  p = probe_median(result)
  lines = [f"{result['commit']} on {result['cpu']}, started {result['started_utc']} "
           f"(load {result['load_before']})",
           f"wall {result['wall_s']:.1f} s ({_minutes(result['wall_s'])}), pytest "
           f"{result['pytest_s']} s, {result['outcome']}, exit code {result['returncode']}",
           f"workers' seconds {result['worker_s']:.1f}; probe {result['probe_before_s']} s "
           f"before, {result['probe_after_s']} s after" +
           (f"; wall / probe median {result['wall_s'] / p:.0f}" if p else ""),
           _cpu_text(result),
           "slowest files (workers' seconds):"]
  slowest = sorted(result["files"].items(), key=lambda kv: -kv[1])[:top]
  lines += [f"  {s:7.1f}  {f}" for f, s in slowest]
  return "\n".join(lines)


def _cpu_text(result: dict) -> str:
  """The CPUs' use, where the file has it (files written before it was recorded do not)."""
  if "cpu_s" not in result:
    return "CPU seconds not recorded"
  return (f"CPU {result['cpu_s']:.0f} s: {100 * result['cpu_share']:.0f}% of the cores over "
          f"the wall time; the CPUs {100 * result['busy_before']:.0f}% busy in the second "
          "before")


def compare_text(old: dict, new: dict, top: int = 25) -> str:
  """Per test file, the workers' seconds of both runs and their ratio, with the totals, the
  median of the files' ratios and the probes' ratio. Where the files' median ratio is near the
  probe's, the host changed; a file is listed by the seconds it moved beyond that median
  (`beyond`: new - old x median), so the files that a change made slower or faster come
  first."""
  names = sorted(set(old["files"]) | set(new["files"]))
  pairs = [(n, old["files"].get(n, 0.0), new["files"].get(n, 0.0)) for n in names]
  ratios = [b / a for _, a, b in pairs if a >= 1.0 and b > 0]  # files of a second or more
  med = statistics.median(ratios) if ratios else 1.0
  po, pn = probe_median(old), probe_median(new)
  lines = [f"old: {old['commit']} {old['started_utc']}  new: {new['commit']} "
           f"{new['started_utc']}",
           f"wall {old['wall_s']:.1f} -> {new['wall_s']:.1f} s "
           f"({new['wall_s'] / old['wall_s']:.2f}x); workers' seconds {old['worker_s']:.1f} -> "
           f"{new['worker_s']:.1f} ({new['worker_s'] / old['worker_s']:.2f}x)",
           "probe median " + (f"{po:.2f} -> {pn:.2f} s ({pn / po:.2f}x)" if po and pn else
                              "missing") +
           f"; median ratio of the files of a second or more {med:.2f}x",
           f"old {_cpu_text(old)}", f"new {_cpu_text(new)}",
           f"{'old s':>8} {'new s':>8} {'ratio':>6} {'beyond':>7}  file"]
  for name, a, b in sorted(pairs, key=lambda p: -abs(p[2] - p[1] * med))[:top]:
    ratio = f"{b / a:.2f}" if a and b else "only"
    lines.append(f"{a:8.1f} {b:8.1f} {ratio:>6} {b - a * med:+7.1f}  {name}")
  return "\n".join(lines)


# -- the runs kept under benchmarks/results ----------------------------------------------------
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# A whole-suite run of a commit's own code: this script's JSON, or the closing lines of
# pytest kept as text: `suite_<commit>` and one of these endings. Files named otherwise hold
# experiments (changed settings, a profiler, some test files only) and are not listed.
_RUN_FILE = re.compile(r"^suite_([0-9a-f]{7})(_clone|_clone_first|_clone_second|_durations|"
                       r"_second|_third|_2)?\.(txt|json)$")
_HOST = re.compile(r"^(xeon|epyc)(\d*?)(?:m(\d+))?_(\d{4}-\d{2}-\d{2})\w*$")
_PROBE_LINE = re.compile(r"^probe_(before|after) (\{.*\})\s*$")


def host_of(folder: str) -> tuple[str, str] | None:
  """(the CPU, as `lscpu` names it, with its family and model; the date) of a results folder
  named `<cpu><family>m<model>_<date>` (the Xeons: `xeon<model>`, family 6), else None."""
  m = _HOST.match(folder)
  if not m:
    return None
  kind, family, model, date = m.groups()
  if kind == "xeon":
    return (f"Intel Xeon, family 6 model {family}" if family else "Intel Xeon"), date
  detail = " ".join(p for p in (family and f"family {family}", model and f"model {model}") if p)
  return (f"AMD EPYC, {detail}" if detail else "AMD EPYC"), date


def read_run(path: str) -> dict | None:
  """A kept run: its commit, whether it ran in a fresh clone (`.ci/run`), pytest's seconds and
  outcome, the probes where the file has them (this script's JSON, or `probe_before` and
  `probe_after` lines of `--probe_only`'s JSON) and the file's path from the checkout; None
  if pytest's closing line is missing."""
  name = os.path.basename(path)
  commit, ending, _ = _RUN_FILE.match(name).groups()
  if name.endswith(".json"):
    result = io_utils.read_json(path)
    probes = {"before": result.get("probe_before_s"), "after": result.get("probe_after_s")}
  else:
    with open(path) as f:
      text = f.read()
    result = parse(text)
    probes = {k: json.loads(v)["probe_s"] for line in text.splitlines()
              for k, v in _PROBE_LINE.findall(line.strip())}
  if result.get("pytest_s") is None:
    return None
  return {"commit": commit, "clone": bool(ending and ending.startswith("_clone")),
          "pytest_s": result["pytest_s"], "outcome": result["outcome"],
          "probes": [s for k in ("before", "after") for s in probes.get(k) or []],
          "file": os.path.relpath(path, ROOT)}


def history(results: str = RESULTS) -> dict[str, list[dict]]:
  """Every kept whole-suite run under `results`, per CPU (`host_of` its folder), in the order
  of their folders' dates and names."""
  folders = sorted((host[1], folder, host[0]) for folder in os.listdir(results)
                   if (host := host_of(folder)) and os.path.isdir(os.path.join(results, folder)))
  hosts: dict[str, list[dict]] = {}
  for date, folder, cpu in folders:
    for name in sorted(os.listdir(os.path.join(results, folder))):
      if _RUN_FILE.match(name):
        path = os.path.join(results, folder, name)
        try:
          run = read_run(path)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
          raise ValueError(f"{os.path.relpath(path, ROOT)} is not a kept run of the suite "
                           f"({type(e).__name__}: {e})") from e
        if run is not None:
          hosts.setdefault(cpu, []).append(dict(run, date=date))
  return hosts


def _passed_only(run: dict) -> bool:
  return run["outcome"].get("passed", 0) > 0 and not any(
      run["outcome"].get(k) for k in ("failed", "errors"))


def history_text(hosts: dict[str, list[dict]], runs: bool = False) -> str:
  """Per CPU, the runs in which every test passed: how many, their dates, and the fastest,
  median and slowest of pytest's times; with `runs`, every run, one line each."""
  lines = ["| CPU (`lscpu`) | runs | dates | fastest | median | slowest |",
           "|---|---|---|---|---|---|"]
  for cpu, kept in sorted(hosts.items()):
    passed = [r for r in kept if _passed_only(r)]
    if not passed:
      continue
    seconds = sorted(r["pytest_s"] for r in passed)
    dates = sorted({r["date"] for r in passed})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    lines.append(f"| {cpu} | {len(passed)} | {span} | {_minutes(seconds[0])} | "
                 f"{_minutes(statistics.median(seconds))} | {_minutes(seconds[-1])} |")
  if runs:
    lines += ["", "| CPU | date | commit | where | pytest | tests | probe s | file |",
              "|---|---|---|---|---|---|---|---|"]
    for cpu, kept in sorted(hosts.items()):
      for r in kept:
        outcome = ", ".join(f"{n} {k}" for k, n in sorted(r["outcome"].items()))
        probes = (f"{min(r['probes']):.2f}-{max(r['probes']):.2f}" if r["probes"] else "")
        lines.append(f"| {cpu} | {r['date']} | {r['commit']} | "
                     f"{'fresh clone' if r['clone'] else 'checkout'} | {_minutes(r['pytest_s'])} "
                     f"| {outcome} | {probes} | `{r['file']}` |")
  return "\n".join(lines)


def _minutes(seconds: float) -> str:
  minutes, rest = divmod(int(round(seconds)), 60)
  return f"{minutes} min {rest} s"


def main() -> None:
  if sys.argv[1:] == ["--probe_child"]:
    probe_child()
    return
  argv, extra = sys.argv[1:], []
  if "--" in argv:
    argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  ap.add_argument("--out", default=None, help="write the results as JSON here")
  ap.add_argument("--compare", default=None, help="an earlier results file to compare with")
  ap.add_argument("--read", default=None,
                  help="compare this results file with --compare instead of running the suite")
  ap.add_argument("--probe_runs", type=int, default=3,
                  help="fresh processes of the probe before and after the suite (0: none)")
  ap.add_argument("--probe_only", action="store_true",
                  help="run the probe alone and print its seconds (no suite, no file)")
  ap.add_argument("--history", action="store_true",
                  help="per CPU, the suite's times of the runs kept under benchmarks/results "
                       "(no suite, no file)")
  ap.add_argument("--runs", action="store_true", help="with --history: every run, one line each")
  args = ap.parse_args(argv)
  if args.runs and not args.history:
    ap.error("--runs lists the kept runs: give it with --history")
  if args.history:
    if args.out or args.compare or args.read or args.probe_only or extra:
      ap.error("--history reads the kept runs and runs nothing: give no other flag but --runs")
    try:
      print(history_text(history(), runs=args.runs))
    except ValueError as e:
      ap.error(str(e))
    return
  if args.probe_only:
    if args.probe_runs < 1 or args.out or args.compare or args.read or extra:
      ap.error("--probe_only runs the probe alone: give --probe_runs of 1 or more and no "
               "other flag")
    print(json.dumps({"probe_s": probe(args.probe_runs)}))
    return
  if args.read and not args.compare:
    ap.error(f"--read={args.read}: nothing to compare it with; give --compare")
  if args.read and (args.out or extra):
    ap.error("--read compares two results files and runs nothing: give no --out and no "
             "pytest arguments with it")
  if not args.read and not args.out:
    ap.error("--out is missing: the file that keeps the results of the run")
  if args.probe_runs < 0:
    ap.error(f"--probe_runs={args.probe_runs}: must be 0 or more")
  earlier = {}
  for flag, path in (("--compare", args.compare), ("--read", args.read)):
    if path:
      try:
        earlier[flag] = io_utils.read_json(path)
        earlier[flag]["files"]  # pylint: disable=pointless-statement
      except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{flag}={path} is not a results file of this script "
                 f"({type(e).__name__}: {e})")
  io_utils.check_output_file(ap, "--out", args.out)  # before the suite runs
  if args.read:
    print(compare_text(earlier["--compare"], earlier["--read"]))
    return
  result = run_suite(extra, args.probe_runs)
  io_utils.write_json_atomic(args.out, result)
  print(summary_text(result))
  if args.compare:
    print()
    print(compare_text(earlier["--compare"], result))
  sys.exit(0 if result["returncode"] == 0 else 1)


if __name__ == "__main__":
  main()
