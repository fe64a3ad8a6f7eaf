"""Runs every `:smoke` config and compares the records of two such sets of runs.

A change meant to preserve behaviour proves it here: the `log.jsonl`,
`summary.json` and `architecture.jsonl` of every smoke config (all methods on
both image data sets, the four language-model configs, and two seeds in one
program) must be identical record for record before and after it, wall-clock
fields aside.

  # before the change (e.g. in a worktree of the old commit), then after it:
  python benchmarks/smoke_records.py --root=/tmp/smoke_before
  python benchmarks/smoke_records.py --root=/tmp/smoke_after --compare=/tmp/smoke_before

With `--compare`, each run is given the speed choices its earlier run measured
(`summary.json`'s `choices`: convolution gradient, fusion flags, ensemble
strategy), since timing on a busy machine may choose otherwise and some
choices change float summation order. Runs one config after another
(`--only=mnist_sm,lm_gmoe` for a subset; `--set=stream.wait=2` runs them with
`--config.stream.wait=2`, and may be repeated); the
data are found as for any run (TFDS_DATA_DIR, ALMA_JAX_BPE_DIR). Exit code 1
when a compared run differs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fields that measure the machine, not the learner.
WALL_FIELDS = ("wall_s", "wall_s_std", "timings", "choices", "provenance")
EXTRA_RUNS = {"mnist_sm_2seeds": ("mnist_sm", ["--config.num_seeds=2"])}


def runs() -> dict[str, tuple[str, list[str]]]:
  names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py")))
  out = {n: (n, []) for n in names}
  out.update(EXTRA_RUNS)
  return out


def _strip(d):
  if isinstance(d, dict):
    return {k: _strip(v) for k, v in d.items() if k not in WALL_FIELDS}
  if isinstance(d, list):
    return [_strip(v) for v in d]
  return d


def _jsonl(path: str) -> list:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def outputs(wd: str) -> dict:
  """The records of a run (and of each seed folder), wall-clock fields removed."""
  out = {}
  for d in [wd] + sorted(glob.glob(os.path.join(wd, "seed_*"))):
    rel = os.path.relpath(d, wd)
    out[f"{rel}/log.jsonl"] = _strip(_jsonl(os.path.join(d, "log.jsonl")))
    out[f"{rel}/architecture.jsonl"] = _jsonl(os.path.join(d, "architecture.jsonl"))
    summary = os.path.join(d, "summary.json")
    if os.path.exists(summary):
      with open(summary) as f:
        out[f"{rel}/summary.json"] = _strip(json.load(f))
  return out


def _choices(wd: str) -> dict:
  """The fields a run chose by measuring (its summary's `choices`)."""
  try:
    with open(os.path.join(wd, "summary.json")) as f:
      return dict(json.load(f).get("choices", {}))
  except (OSError, ValueError):
    return {}


def _first_difference(a, b, where="") -> str | None:
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      if k not in a or k not in b:
        return f"{where}.{k}: only in {'after' if k not in a else 'before'}"
      d = _first_difference(a[k], b[k], f"{where}.{k}")
      if d:
        return d
    return None
  if isinstance(a, list) and isinstance(b, list):
    if len(a) != len(b):
      return f"{where}: {len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
      d = _first_difference(x, y, f"{where}[{i}]")
      if d:
        return d
    return None
  same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
  return None if same else f"{where}: {a!r} vs {b!r}"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--root", required=True, help="folder for the runs (one workdir per config)")
  ap.add_argument("--compare", help="a --root of earlier runs to compare with")
  ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
  ap.add_argument("--no-run", action="store_true", help="only compare existing runs")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="run every config with --config.FIELD=VALUE (repeatable)")
  args = ap.parse_args()
  malformed = [s for s in args.set if "=" not in s or s.startswith("=")]
  if malformed:
    ap.error(f"--set: expected FIELD=VALUE (e.g. stream.wait=2), got {malformed}")
  if args.compare and not os.path.isdir(args.compare):
    ap.error(f"--compare={args.compare} is not a folder of earlier runs (a --root of this "
             "script)")
  if os.path.exists(args.root) and not os.path.isdir(args.root):
    ap.error(f"--root={args.root} exists and is not a folder")
  todo = runs()
  if args.only:
    unknown = sorted(set(args.only.split(",")) - set(todo))
    if unknown:
      ap.error(f"--only: unknown run(s) {unknown}; known: {sorted(todo)}")
    todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
  failed = 0
  for name, (config, extra) in todo.items():
    wd = os.path.join(os.path.abspath(args.root), name)
    if not args.no_run:
      start = time.monotonic()
      cmd = [sys.executable, "-m", "alma_jax.main", f"--config=configs/{config}.py:smoke",
             f"--workdir={wd}", "--overwrite", *extra, *(f"--config.{s}" for s in args.set)]
      if args.compare:  # the speed choices measured then (a loaded machine may time otherwise)
        cmd += [f"--config.{k}={v}" for k, v in _choices(os.path.join(args.compare, name)).items()]
      proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
      status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
      print(f"{name:18s} {status} in {time.monotonic() - start:.1f}s", flush=True)
      if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        failed += 1
        continue
    if args.compare:
      before = outputs(os.path.join(os.path.abspath(args.compare), name))
      diff = _first_difference(before, outputs(wd))
      print(f"{name:18s} {'identical' if diff is None else 'DIFFERS: ' + diff}", flush=True)
      failed += diff is not None
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
