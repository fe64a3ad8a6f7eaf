"""Whole runs on an accelerator against the released code, cold and warm caches, in one command.

For each timing protocol (P3, P1, P4 by default) it runs alma_jax twice on one
fresh persistent compilation cache ("cold", then "warm": `compile_budget.py`'s
processes, which count compile seconds and XLA programs) and the released
PyTorch code once (`--peer_cmd <protocol>` must print the peer's JSON result
line: `bash .gpu_carry/peer_gpu.sh` on a GPU machine, see benchmarks/README.md).
Then, for the Switch Transformer presets (`--lm`), one cold run each with the
compile seconds of its train step and evaluation; and with `--interrupt_at=S`,
a cold base-model run sent SIGTERM after S seconds (while XLA compiles): how
long it took to exit, and its exit status.

Every result is written to `--out_dir`/results.json as soon as it is measured
(one file, rewritten whole: a run cut short keeps what it finished, and a
machine that returns few files returns it); `--from_dir` prints the table
again from there. `--xla_dump=REGEX` also dumps the HLO of alma_jax's programs
whose module names match (XLA's `--xla_dump_to`) into one archive there,
`xla_dump.tgz`, to see on another machine what a slow compile compiled;
`--xla_pass_log=true` times alma_jax's cold compiles pass by pass (a table
per program kind: its slowest XLA passes).

  python benchmarks/accelerator_table.py --peer_cmd="bash .gpu_carry/peer_gpu.sh" \\
      --out_dir=/tmp/table --lm=lm_base,lm_base_unrolled --interrupt_at=25
  python benchmarks/accelerator_table.py --only=P4 --xla_dump='.*step_eval.*' --out_dir=/tmp/p4
  python benchmarks/accelerator_table.py --from_dir=/tmp/table

Anything after `--` is passed to every alma_jax run. On a CPU it runs the same
way (the released code through `../shared/peer/run_peer.sh --repeat 1`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_budget  # pylint: disable=wrong-import-position
import peer  # pylint: disable=wrong-import-position

ROOT = compile_budget.ROOT


def device_name() -> str:
  """The accelerator's name (nvidia-smi) or else the CPU's (lscpu)."""
  for cmd in (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], ["lscpu"]):
    try:
      text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
      continue
    return text.strip().splitlines()[0] if cmd[0] == "nvidia-smi" else peer.cpu_model(text)
  return "unknown device"


RESULTS = "results.json"


def _save(out_dir: str, results: dict) -> None:
  """Writes every result so far to `out_dir`/results.json (replaced whole)."""
  path = os.path.join(out_dir, RESULTS)
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=1)
  os.replace(path + ".tmp", path)


def read_results(out_dir: str) -> dict:
  """The results of an `--out_dir`: its results.json, or the one file per result that
  earlier versions of this script wrote."""
  path = os.path.join(out_dir, RESULTS)
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  results = {}
  for name in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
    with open(name) as f:
      results[os.path.basename(name)[:-5]] = json.load(f)
  return results


def dump_flags(out_dir: str, regex: str) -> str:
  """`XLA_FLAGS` with XLA's HLO dump of the modules matching `regex` into out_dir/xla_dump."""
  return " ".join([os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={out_dir}/xla_dump",
                   f"--xla_dump_hlo_module_re={regex}", "--xla_dump_hlo_as_text"]).strip()


def _ours(spec: str, extra: list[str], cache_dir: str, xla_pass_log: bool = False) -> dict:
  try:
    return compile_budget.run_one(spec, extra, cache_dir, xla_pass_log=xla_pass_log)
  except SystemExit as e:  # a failed run is a row with its error, not the end of the table
    return {"error": str(e)[-1500:]}


def measure_protocol(protocol: str, peer_cmd: str, extra: list[str],
                     xla_pass_log: bool = False) -> dict:
  """alma_jax cold and warm on one fresh cache, then the released code once; `xla_pass_log`:
  the cold run's XLA compiles timed pass by pass (`compile_budget.xla_passes`)."""
  spec = compile_budget.RUNS[protocol.lower()]
  result = {"protocol": protocol}
  with tempfile.TemporaryDirectory() as cache_dir:
    result["cold"] = _ours(spec, extra, cache_dir, xla_pass_log)
    result["warm"] = _ours(spec, extra, cache_dir)
  if peer_cmd:
    proc = subprocess.run(shlex.split(peer_cmd) + [protocol], capture_output=True, text=True,
                          check=False)
    lines = [l for l in peer.parse_peer_lines(proc.stdout) if "wall_s" in l or "error" in l]
    result["released"] = lines[-1] if lines else {
        "error": f"no result (exit {proc.returncode}): {proc.stderr[-1500:]}"}
  return result


def measure_interrupt(seconds: float, extra: list[str]) -> dict:
  """A cold base Switch Transformer run sent SIGTERM after `seconds`: exit delay and status."""
  parts = shlex.split(compile_budget.RUNS["lm_base"]) + list(extra)
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "alma_jax.main", f"--config={parts[0]}",
           f"--workdir={os.path.join(tmp, 'run')}", "--compilation_cache_dir=none", *parts[1:]]
    with open(os.path.join(tmp, "log"), "w+") as log:
      proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
      time.sleep(seconds)
      finished_before = proc.poll() is not None
      t0 = time.monotonic()
      proc.send_signal(signal.SIGTERM)
      try:
        rc = proc.wait(timeout=300)
      except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
      log.seek(0)
      tail = log.read()[-1500:]
  return {"sigterm_at_s": seconds, "exit_after_s": time.monotonic() - t0, "rc": rc,
          "finished_before_signal": finished_before, "log_tail": tail}


def _wall(r: dict | None, key: str = "process_s") -> str:
  if not r:
    return "-"
  if "error" in r:
    return "failed"
  return f"{r[key]:.1f}"


def _compile(r: dict | None) -> str:
  return f" ({r['compile_s']:.1f})" if r and "error" not in r else ""


def _ratio(theirs: dict | None, ours: dict | None) -> str:
  if not theirs or not ours or "error" in theirs or "error" in ours:
    return "-"
  return f"{theirs['wall_s'] / ours['process_s']:.2f}x"


def table(results: dict[str, dict], device: str) -> str:
  """The Markdown tables of the measured `results` (file name -> result)."""
  lines = [f"# alma_jax and the released code on {device}",
           "| run | alma_jax cold s (compile s) | alma_jax warm s (compile s) | XLA programs "
           "(warm hits) | released code s | ratio cold / warm | final accuracy (ours / theirs) |",
           "|---|---|---|---|---|---|---|"]
  for name in sorted(results):
    r = results[name]
    if "protocol" not in r:
      continue
    cold, warm, theirs = r.get("cold"), r.get("warm"), r.get("released")
    both = cold and warm and "error" not in cold and "error" not in warm
    programs = f"{warm['xla_programs']} ({len(warm['hits'])})" if both else "-"
    ours_acc = (f"{1 - warm['final_error']:.3f}" if both and warm.get("final_error") is not None
                else "-")
    theirs_acc = (f"{theirs['final_test_acc']:.3f}" if theirs and theirs.get("final_test_acc")
                  is not None else "-")
    lines.append(f"| {r['protocol']} | {_wall(cold)}{_compile(cold)} | "
                 f"{_wall(warm)}{_compile(warm)} | {programs} | {_wall(theirs, 'wall_s')} | "
                 f"{_ratio(theirs, cold)} / {_ratio(theirs, warm)} | {ours_acc} / {theirs_acc} |")
  lm = {n: r for n, r in results.items() if n.startswith("lm_")}
  if lm:
    lines += ["", "| run (cold cache) | process s | compile s | train step compile s | "
              "evaluation compile s | XLA programs |", "|---|---|---|---|---|---|"]
    for name, r in sorted(lm.items()):
      if "error" in r:
        lines.append(f"| {name} | failed | | | | |")
        continue
      sec = r["seconds"]
      lines.append(f"| {name} | {r['process_s']:.1f} | {r['compile_s']:.1f} | "
                   f"{sec.get('train', 0.0):.1f} | {sec.get('eval', 0.0):.1f} | "
                   f"{r['xla_programs']} |")
  passes = {name: {"cold": r.get("cold", r)} for name, r in sorted(results.items())
            if isinstance(r, dict) and "xla_passes" in r.get("cold", r)}
  if passes:
    lines += ["", "Where the cold runs' XLA compiles go, pass by pass:", "",
              compile_budget.xla_pass_table(passes)]
  stop = results.get("interrupt")
  if stop:
    lines += ["", f"SIGTERM {stop['sigterm_at_s']:.0f} s into a cold lm_base run"
              f"{' (it had already ended)' if stop['finished_before_signal'] else ''}: exited "
              f"{stop['exit_after_s']:.1f} s later with status {stop['rc']}."]
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = []
  if "--" in argv:
    argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", default="P3,P1,P4", help="protocols, in the order to run them")
  ap.add_argument("--peer_cmd", default="",
                  help="command that runs the released code on one protocol (given last)")
  lm_runs = sorted(n for n in compile_budget.RUNS if n.startswith("lm_"))
  ap.add_argument("--lm", default="", help=f"Switch Transformer runs of {lm_runs}")
  ap.add_argument("--interrupt_at", type=float, default=0.0,
                  help="also send SIGTERM to a cold lm_base run after this many seconds")
  ap.add_argument("--out_dir", default="", help="results.json here, rewritten as results come")
  ap.add_argument("--from_dir", default="", help="print the table of an earlier --out_dir")
  ap.add_argument("--xla_pass_log", default="false", choices=("true", "false"),
                  help="time alma_jax's cold compiles pass by pass (XLA's own log)")
  ap.add_argument("--xla_dump", default="",
                  help="dump the HLO of alma_jax's programs matching this into xla_dump.tgz")
  args = ap.parse_args(argv)
  if args.from_dir:
    results = read_results(args.from_dir)
    print(table(results, results.get("device", {}).get("name", "unknown device")))
    return 0
  protocols = [p.strip().upper() for p in args.only.split(",") if p.strip()]
  lms = [n for n in args.lm.split(",") if n]
  unknown = ([p for p in protocols if p.lower() not in compile_budget.RUNS]
             + [n for n in lms if not n.startswith("lm_") or n not in compile_budget.RUNS])
  if unknown:
    raise SystemExit(f"accelerator_table: error: unknown runs {unknown}; protocols: P1-P4, "
                     f"--lm: {lm_runs}")
  out_dir = args.out_dir or tempfile.mkdtemp(prefix="accelerator_table_")
  os.makedirs(out_dir, exist_ok=True)
  device = device_name()
  results = {"device": {"name": device}}
  if args.xla_dump:  # alma_jax's processes inherit it (the released code has no XLA)
    os.environ["XLA_FLAGS"] = dump_flags(out_dir, args.xla_dump)
  _save(out_dir, results)
  for p in protocols:
    results[p] = measure_protocol(p, args.peer_cmd, extra, args.xla_pass_log == "true")
    _save(out_dir, results)
    print(f"{p}: cold {_wall(results[p]['cold'])} s, warm {_wall(results[p]['warm'])} s, "
          f"released {_wall(results[p].get('released'), 'wall_s')} s", file=sys.stderr, flush=True)
  for name in lms:
    with tempfile.TemporaryDirectory() as cache_dir:
      results[name] = _ours(compile_budget.RUNS[name], extra, cache_dir,
                            args.xla_pass_log == "true")
    _save(out_dir, results)
    print(f"{name}: cold {_wall(results[name])} s", file=sys.stderr, flush=True)
  if args.interrupt_at > 0:
    results["interrupt"] = measure_interrupt(args.interrupt_at, extra)
    _save(out_dir, results)
  if args.xla_dump and os.path.isdir(os.path.join(out_dir, "xla_dump")):
    subprocess.run(["tar", "-czf", "xla_dump.tgz", "xla_dump"], cwd=out_dir, check=False)
    shutil.rmtree(os.path.join(out_dir, "xla_dump"), ignore_errors=True)
  print(table(results, device))
  print(f"(results in {out_dir})", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
