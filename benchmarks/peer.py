"""Whole runs of alma_jax and of the released PyTorch code, back to back, and their ratios.

For each timing protocol (P1-P4: `configs/bench/p*.py` here, the same
protocols in the released code through `../shared/peer/run_peer.sh`, see its
README), runs alma_jax and then the released code, `--repeat` times
alternately, each as a whole process from the shell prompt, and prints a
table: median wall seconds of each party (min-max), their ratio (released /
alma_jax: above 1 means alma_jax is faster), alma_jax's own time breakdown
and the final test accuracy of each party. The header names the CPU (model
name, family, model, stepping and instruction sets, `alma_jax.runtime.host`)
and the load average; a busy machine is warned about, since PyTorch's
spinning OpenMP threads make its timings collapse when anything else runs.

  python benchmarks/peer.py                      # P1-P4, 3 times each
  python benchmarks/peer.py --repeat 1 --only=P3 --out=/tmp/peer.json

The peer's virtual environment and data must be set up first
(`run_peer.sh --setup-only`); `PEER_SRC`, `VENV` and the other variables of
its README pass through.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import end_to_end  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from alma_jax.outputs import io_utils  # pylint: disable=wrong-import-position
from alma_jax.runtime import host  # pylint: disable=wrong-import-position

PROTOCOLS = ("P1", "P2", "P3", "P4")
DEFAULT_PEER_SCRIPT = os.path.join(os.path.dirname(ROOT), "shared", "peer", "run_peer.sh")
# Share of all cores busy in the second before a run (when none of the benchmark's own runs is
# going) above which its timing is not trusted. The load average cannot say it: it still counts
# the previous run for a minute after it ends.
BUSY_SHARE = 0.15


def cpu_model(lscpu_text: str, cpuinfo_text: str = "") -> str:
  """The CPU as the speed choices name it (`alma_jax.runtime.host.describe` of the
  /proc/cpuinfo text: model name, family, model, stepping, instruction sets; `lscpu`'s model
  name where that text names none) and the logical CPU count from `lscpu`'s output. A VM's
  model name alone ("AMD EPYC") is the same for hosts that rank the two parties differently."""
  fields = {}
  for line in lscpu_text.splitlines():
    if ":" in line:
      key, value = line.split(":", 1)
      fields.setdefault(key.strip(), value.strip())
  name = host.describe(cpuinfo_text, fields.get("Model name", ""))
  return f"{name}, {fields['CPU(s)']} CPUs" if "CPU(s)" in fields else name


def this_cpu() -> str:
  """`cpu_model` of this host."""
  lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
  return cpu_model(lscpu, host.read_cpuinfo())


def _cpu_times() -> tuple[int, int]:
  """(busy, total) jiffies of all CPUs since boot (/proc/stat)."""
  with open("/proc/stat") as f:
    values = [int(v) for v in f.readline().split()[1:]]
  idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
  return sum(values) - idle, sum(values)


def start_stamp() -> dict:
  """When a measurement started (UTC) and the host's load average over the minute before it
  (None where the system keeps none): what a results file records beside its figures."""
  try:
    load = os.getloadavg()[0]
  except (AttributeError, OSError):
    load = None
  return {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "load_before": load}


def busy_share(seconds: float = 1.0) -> float:
  """The share of all CPUs busy over the next `seconds` (0: idle; 1: every core busy)."""
  try:
    busy0, total0 = _cpu_times()
    time.sleep(seconds)
    busy1, total1 = _cpu_times()
  except (OSError, ValueError, IndexError):
    return 0.0
  return (busy1 - busy0) / max(1, total1 - total0)


def parse_peer_lines(stdout: str) -> list[dict]:
  """The JSON result lines of `run_peer.sh` (other lines are skipped)."""
  out = []
  for line in stdout.splitlines():
    line = line.strip()
    if line.startswith("{"):
      try:
        out.append(json.loads(line))
      except ValueError:
        continue
  return out


def _median_range(values: list[float]) -> str:
  if not values:
    return "-"
  return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _accuracy(values: list[float | None]) -> str:
  values = [v for v in values if v is not None]
  return f"{statistics.median(values):.3f}" if values else "-"


def _breakdown(summaries: list[dict]) -> str:
  """Median seconds of each part of the runs' own timings (`summary.json`)."""
  keys = sorted({k for s in summaries for k in s.get("timings", {}) if k.endswith("_s")})
  return ", ".join(f"{k.removesuffix('_s')} "
                   f"{statistics.median(s['timings'].get(k, 0.0) for s in summaries):.1f}"
                   for k in keys)


def row(protocol: str, ours: list[dict], theirs: list[dict]) -> dict:
  """The figures of one protocol: `ours` are {"wall_s", "summary"}, `theirs` the peer's
  JSON lines. Failed peer runs (an "error" field) are left out of its figures."""
  ok = [r for r in theirs if "error" not in r and r.get("wall_s") is not None]
  our_walls = [r["wall_s"] for r in ours]
  their_walls = [r["wall_s"] for r in ok]
  ratio = (statistics.median(their_walls) / statistics.median(our_walls)
           if our_walls and their_walls else None)
  return {
      "protocol": protocol,
      "ours_wall_s": our_walls, "theirs_wall_s": their_walls, "ratio": ratio,
      "ours_final_acc": [1.0 - r["summary"]["final_error"] for r in ours],
      "theirs_final_acc": [r.get("final_test_acc") for r in ok],
      "ours_breakdown": _breakdown([r["summary"] for r in ours]),
      "peer_failures": len(theirs) - len(ok),
      "max_busy": max([r.get("busy_before", 0.0) for r in ours]
                      + [r.get("busy_before", 0.0) for r in theirs], default=0.0),
  }


def table(rows: list[dict], cpu: str, load: tuple[float, ...]) -> str:
  """The Markdown table of `rows` (`row`), with the CPU and load average above it."""
  lines = [f"# alma_jax vs the released code on {cpu}; load average before: "
           f"{', '.join(f'{x:.2f}' for x in load)}"]
  busy = [r["protocol"] for r in rows if r["max_busy"] > BUSY_SHARE]
  if busy:
    lines.append(f"WARNING: other work kept more than {BUSY_SHARE:.0%} of the CPUs busy just "
                 f"before a run of {', '.join(busy)}: the released code's timings are inflated; "
                 "re-measure on an idle machine.")
  lines += ["| protocol | alma_jax s (median, min-max) | released code s | ratio | "
            "final accuracy (ours / theirs) | alma_jax breakdown (median s) |",
            "|---|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
    failed = f" ({r['peer_failures']} failed)" if r["peer_failures"] else ""
    lines.append(f"| {r['protocol']} | {_median_range(r['ours_wall_s'])} | "
                 f"{_median_range(r['theirs_wall_s'])}{failed} | {ratio} | "
                 f"{_accuracy(r['ours_final_acc'])} / {_accuracy(r['theirs_final_acc'])} | "
                 f"{r['ours_breakdown']} |")
  return "\n".join(lines)


def run_ours(protocol: str, extra: list[str]) -> dict:
  path = end_to_end.protocol_files([protocol.lower()])[protocol.lower()]
  busy = busy_share()
  wall, summary = end_to_end.run_once(path, extra)
  return {"wall_s": wall, "summary": summary, "busy_before": busy}


def run_theirs(protocol: str, script: str) -> list[dict]:
  busy = busy_share()
  proc = subprocess.run(["bash", script, "--repeat", "1", protocol], capture_output=True,
                        text=True, check=False)
  lines = parse_peer_lines(proc.stdout)
  if not lines:
    raise SystemExit(f"peer: {script} {protocol} printed no result (exit {proc.returncode}):\n"
                     f"{proc.stderr[-2000:]}")
  return [dict(line, busy_before=busy) for line in lines]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repeat", type=int, default=3, help="runs of each party per protocol")
  p.add_argument("--only", default=",".join(PROTOCOLS), help="comma-separated protocols")
  p.add_argument("--peer-script", default=os.environ.get("PEER_SCRIPT", DEFAULT_PEER_SCRIPT))
  p.add_argument("--out", help="write every run's figures here as JSON")
  p.add_argument("extra", nargs="*", help="flags passed to every alma_jax run (after --)")
  args = p.parse_args(argv)
  io_utils.check_output_file(p, "--out", args.out)  # before measuring
  protocols = [x.strip().upper() for x in args.only.split(",") if x.strip()]
  unknown = sorted(set(protocols) - set(PROTOCOLS))
  if unknown or args.repeat < 1:
    p.error(f"--only: unknown protocols {unknown}; valid: {list(PROTOCOLS)}" if unknown
            else f"--repeat={args.repeat} must be >= 1")
  if not os.path.exists(args.peer_script):
    p.error(f"--peer-script={args.peer_script} does not exist: give the harness that runs the "
            "released code (--peer-script or PEER_SCRIPT; what it must print: "
            "benchmarks/README.md)")
  cpu = this_cpu()
  load = os.getloadavg()
  rows, runs = [], {}
  for protocol in protocols:
    ours, theirs = [], []
    for i in range(args.repeat):  # alternately: both parties see the same machine state
      print(f"[peer] {protocol} run {i + 1}/{args.repeat}: alma_jax", file=sys.stderr, flush=True)
      ours.append(run_ours(protocol, args.extra))
      print(f"[peer] {protocol} run {i + 1}/{args.repeat}: released code", file=sys.stderr,
            flush=True)
      theirs += run_theirs(protocol, args.peer_script)
    rows.append(row(protocol, ours, theirs))
    runs[protocol] = {"ours": ours, "theirs": theirs}
  print(table(rows, cpu, load))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"cpu": cpu, "load": load, "rows": rows, "runs": runs}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
