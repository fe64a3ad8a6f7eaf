"""Compiled programs, compile time and records of growing runs, with and without slots.

Runs each given config as a separate process with a cold compilation cache (a
fresh cache folder per run), once per `method.slots` value asked for, and
prints per run the step programs (`summary.json`'s `num_compilations`, the
steps' cache), the compile and wall seconds, the compile share of wall time,
Mem, Comp (`comp`, `comp_forward`, `comp_paper`, `comp_growth`) and the
final error. Program counts are exact; times move with the machine's load.
Mem and Comp count active parts only, so they must not depend on the slots.

  python benchmarks/growth_programs.py \\
      --runs="mnist_ff.py:quick --config.stream.num_megabatches=50 --config.stream.wait=5
              --config.method.min_slots=0" --slots=exact,pow2 --out=/tmp/growth.json
  python benchmarks/growth_programs.py --runs=cifar_ff.py:smoke,mnist_gmoe.py:quick

`--runs` is a comma-separated list of `config[:variant] [--config.x=y ...]`;
`--slots=""` runs each config as it is. (`mnist_ff.py:quick` holds its layers in at least
256 slots, which `exact` refuses: `--config.method.min_slots=0` compares the slots alone.)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("num_compilations", "compile_s", "wall_s", "compile_share", "mem", "comp",
           "comp_forward", "comp_paper", "comp_growth", "final_error")


def run_one(spec: str, slots: str, workdir: str) -> dict:
  """Runs `spec` (with `method.slots=slots` unless empty) in `workdir`; summary numbers."""
  parts = shlex.split(spec)
  config, extra = parts[0], parts[1:]
  if slots:
    extra.append(f"--config.method.slots={slots}")
  cache = os.path.join(workdir, "xla_cache")  # cold: a new folder for every run
  cmd = [sys.executable, "-m", "alma_jax.main", f"--config={os.path.join(ROOT, 'configs', config)}",
         f"--workdir={os.path.join(workdir, 'run')}", f"--compilation_cache_dir={cache}"] + extra
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
  elapsed = time.perf_counter() - start
  if proc.returncode:
    raise SystemExit(f"growth_programs: {spec} (slots={slots!r}) failed:\n{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "run", "summary.json")) as f:
    summary = json.load(f)
  t = summary["timings"]
  out = {k: summary[k] for k in COLUMNS if k in summary}
  out.update(compile_s=t["compile_s"], step_programs=t["step_programs"],
             xla_programs=t["xla_programs"], process_s=elapsed)
  out["compile_share"] = t["compile_s"] / summary["wall_s"]
  with open(os.path.join(workdir, "run", "architecture.jsonl")) as f:
    arch = [json.loads(line) for line in f if line.strip()]
  out["last_architecture"] = {k: v for k, v in arch[-1].items() if k != "t"} if arch else {}
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", required=True, help="comma-separated 'config[:variant] [flags]'")
  ap.add_argument("--slots", default="exact,pow2",
                  help="comma-separated method.slots values ('' : as configured)")
  ap.add_argument("--out", default="", help="a JSON file for the results")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)  # this checkout's package
  from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top
  io_utils.check_output_file(ap, "--out", args.out)  # before measuring
  specs = [s.strip() for s in args.runs.split(",") if s.strip()]
  slot_values = [s.strip() for s in args.slots.split(",")] if args.slots else [""]
  results = []
  for spec in specs:
    for slots in slot_values:
      with tempfile.TemporaryDirectory(prefix="growth_programs_") as wd:
        row = {"run": spec, "slots": slots or "(config)", **run_one(spec, slots, wd)}
      results.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  print("| run | slots | programs | compile s | wall s | compile share | Mem | comp | "
        "comp_forward | comp_paper | comp_growth | final error |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| `{r['run']}` | {r['slots']} | {r['num_compilations']} | {r['compile_s']:.1f} | "
          f"{r['wall_s']:.1f} | {100 * r['compile_share']:.0f}% | {r['mem']} | "
          f"{r['comp']:.4g} | {r['comp_forward']:.4g} | {r['comp_paper']:.4g} | "
          f"{r['comp_growth']:.4g} | {r['final_error']:.4f} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
