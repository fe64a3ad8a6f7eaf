"""Wall time of whole runs, from the shell prompt to summary.json.

Runs the reference protocols (configs/bench/p*.py) several times each as
separate processes, exactly as a user would, and prints per protocol the
median wall time (min-max), the median time breakdown that the run itself
wrote into summary.json, and the final test accuracy.

  python benchmarks/end_to_end.py                      # P1-P4, 3 runs each
  python benchmarks/end_to_end.py --protocols=p3,p4 --repeats=5 --out=e2e.json

The first run of a protocol may fill the decoded-data cache; pass --warm to
run each protocol once before timing (a warm cache is what the targets mean).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def protocol_files(selected: list[str] | None) -> dict[str, str]:
  files = sorted(glob.glob(os.path.join(ROOT, "configs", "bench", "p*.py")))
  out = {os.path.basename(f).split("_")[0]: f for f in files}
  if selected:
    unknown = [p for p in selected if p not in out]
    if unknown:
      raise SystemExit(f"end_to_end: error: unknown protocols {unknown}; valid: {sorted(out)}")
    out = {p: out[p] for p in selected}
  return out


def run_once(config: str, extra: list[str]) -> tuple[float, dict]:
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [sys.executable, "-m", "alma_jax.main", f"--config={config}", f"--workdir={workdir}", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode:
      raise SystemExit(f"end_to_end: {config} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
      return wall, json.load(f)


def fmt_breakdown(summaries: list[dict]) -> str:
  keys = sorted({k for s in summaries for k in s.get("timings", {})})
  parts = [f"{k.removesuffix('_s')} {statistics.median(s['timings'].get(k, 0.0) for s in summaries):.1f}"
           for k in keys]
  return ", ".join(parts)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--protocols", help="comma-separated subset, e.g. p1,p3")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--warm", action="store_true", help="one untimed run per protocol first")
  p.add_argument("--out", help="write the results as JSON here")
  p.add_argument("extra", nargs="*", help="flags passed to every run (after --)")
  args = p.parse_args(argv)
  sys.path.insert(0, ROOT)  # this checkout's package
  from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top
  io_utils.check_output_file(p, "--out", args.out)  # before measuring
  results = {}
  print("| protocol | wall s (median, min-max) | breakdown (median s) | final accuracy |")
  print("|---|---|---|---|")
  for name, path in protocol_files(args.protocols.split(",") if args.protocols else None).items():
    if args.warm:
      run_once(path, args.extra)
    runs = [run_once(path, args.extra) for _ in range(args.repeats)]
    walls = [w for w, _ in runs]
    summaries = [s for _, s in runs]
    accs = [1.0 - s["final_error"] for s in summaries]
    results[name] = {"config": os.path.relpath(path, ROOT), "wall_s": walls, "summaries": summaries}
    print(f"| {name} | {statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) | "
          f"{fmt_breakdown(summaries)} | {statistics.median(accs):.4f} |", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
