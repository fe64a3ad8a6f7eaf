"""S seeds as one vmapped program versus S separate runs, whole runs timed.

Runs a config (default `configs/mnist_sm.py:quick`) once with
`--config.num_seeds=S` and S times separately with seeds 0 ... S-1, each as
its own process as a user would, and prints the wall times, their ratio and
each seed's final error and CER in both settings (they agree up to the
order of floating-point sums). Repeats the pair `--repeats` times and reports
medians.

  python benchmarks/seeds.py                          # S=5, MNIST :quick
  python benchmarks/seeds.py --seeds=3 --config=configs/mnist_ens.py:quick --out=seeds.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from end_to_end import ROOT, run_once  # pylint: disable=g-import-not-at-top,wrong-import-position


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/mnist_sm.py:quick")
  p.add_argument("--seeds", type=int, default=5)
  p.add_argument("--repeats", type=int, default=1, help="timed pairs (median)")
  p.add_argument("--out", help="write the results as JSON here")
  p.add_argument("extra", nargs="*", help="flags passed to every run (after --)")
  args = p.parse_args(argv)
  sys.path.insert(0, ROOT)  # this checkout's package
  from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top
  io_utils.check_output_file(p, "--out", args.out)  # before measuring
  config = os.path.join(ROOT, args.config)
  together, separate, last = [], [], {}
  for _ in range(args.repeats):
    wall, summary = run_once(config, [f"--config.num_seeds={args.seeds}", *args.extra])
    together.append(wall)
    runs = [run_once(config, [f"--config.seed={s}", *args.extra]) for s in range(args.seeds)]
    separate.append(sum(w for w, _ in runs))
    last = {"together": summary, "separate": [s for _, s in runs]}
  t, s = statistics.median(together), statistics.median(separate)
  print(f"{args.config}, S={args.seeds} seeds, {args.repeats} repeat(s)\n")
  print("| setting | wall s (median) | per seed |")
  print("|---|---|---|")
  print(f"| one program, num_seeds={args.seeds} | {t:.1f} | {t / args.seeds:.1f} |")
  print(f"| {args.seeds} separate runs | {s:.1f} | {s / args.seeds:.1f} |")
  print(f"\nspeed-up: {s / t:.2f}x\n")
  print("| seed | final error (one program / separate) | CER (one program / separate) |")
  print("|---|---|---|")
  for i, (a, b) in enumerate(zip(last["together"]["per_seed"], last["separate"])):
    print(f"| {i} | {a['final_error']:.4f} / {b['final_error']:.4f} | "
          f"{a['cer']:.2f} / {b['cer']:.2f} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"config": args.config, "seeds": args.seeds, "together_s": together,
                 "separate_s": separate, "summaries": last}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
