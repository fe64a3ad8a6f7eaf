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

`--deadline_s=S` fits the table into S seconds of machine time (a lent
accelerator's session is short): every process is stopped at the deadline
(SIGTERM, then killed), a run stopped so is a row "> N s" with what it had
compiled by then, and what has not started with `MIN_START_S` left is listed
as not started. `--continue_from=DIR` keeps the complete results of an
earlier `--out_dir` on the same device and measures only the rest, so that a
table longer than one session's command limit is finished by a second
command:

  python benchmarks/accelerator_table.py --deadline_s=480 --out_dir=$OUT/table ...
  python benchmarks/accelerator_table.py --deadline_s=480 --out_dir=$OUT/table \\
      --continue_from=.gpu_carry/table_before ...

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
# Under `--deadline_s`, a measurement does not start with less than this many seconds left.
MIN_START_S = 30.0


class Deadline:
  """The seconds left before a deadline `seconds` from now (None: no deadline)."""

  def __init__(self, seconds: float | None, clock=time.monotonic):
    self._clock = clock
    self._end = clock() + seconds if seconds else None

  def left(self) -> float | None:
    return None if self._end is None else max(0.0, self._end - self._clock())

  def allows(self, seconds: float = MIN_START_S) -> bool:
    """Whether `seconds` are left (always, without a deadline)."""
    left = self.left()
    return left is None or left >= seconds


NO_DEADLINE = Deadline(None)


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


def kept_results(folder: str, device: str, released: bool) -> dict:
  """The complete results (`complete`) of an earlier `--out_dir` `folder`, refused unless
  they were measured on `device`; `released`: a protocol without the released code's time
  is not complete."""
  if not os.path.isdir(folder):
    raise SystemExit(f"accelerator_table: error: --continue_from={folder}: no such folder")
  before = read_results(folder)
  theirs = before.get("device", {}).get("name")
  if theirs != device:
    raise SystemExit(f"accelerator_table: error: --continue_from={folder} was measured on "
                     f"{theirs!r}, not on this machine's {device!r}: its times do not compare")
  return {name: r for name, r in before.items()
          if name not in ("device", "not_started") and complete(r)
          and not (released and "protocol" in r and "released" not in r)}


def dump_flags(out_dir: str, regex: str) -> str:
  """`XLA_FLAGS` with XLA's HLO dump of the modules matching `regex` into out_dir/xla_dump."""
  return " ".join([os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={out_dir}/xla_dump",
                   f"--xla_dump_hlo_module_re={regex}", "--xla_dump_hlo_as_text"]).strip()


def _not_started(why: str = "the deadline was near") -> dict:
  return {"error": f"not started: {why}", "not_started": True}


def _ours(spec: str, extra: list[str], cache_dir: str, xla_pass_log: bool = False,
          deadline: Deadline = NO_DEADLINE) -> dict:
  if not deadline.allows():
    return _not_started()
  try:
    return compile_budget.run_one(spec, extra, cache_dir, xla_pass_log=xla_pass_log,
                                  timeout=deadline.left())
  except SystemExit as e:  # a failed run is a row with its error, not the end of the table
    return {"error": str(e)[-1500:]}


def _released(peer_cmd: str, protocol: str, deadline: Deadline) -> dict:
  """The released code's result line on `protocol` (an error row if it has none)."""
  if not deadline.allows():
    return _not_started()
  timeout = deadline.left()
  rc, out, err, timed_out = compile_budget.run_child(shlex.split(peer_cmd) + [protocol], None,
                                                     timeout)
  if timed_out:
    return compile_budget.timed_out_row(timeout)
  lines = [l for l in peer.parse_peer_lines(out) if "wall_s" in l or "error" in l]
  return lines[-1] if lines else {"error": f"no result (exit {rc}): {err[-1500:]}"}


def measure_protocol(protocol: str, peer_cmd: str, extra: list[str],
                     xla_pass_log: bool = False, deadline: Deadline = NO_DEADLINE) -> dict:
  """alma_jax cold and warm on one fresh cache, then the released code once; `xla_pass_log`:
  the cold run's XLA compiles timed pass by pass (`compile_budget.xla_passes`). Each process
  ends by the `deadline`; a warm run after a cold one that did not finish is not started
  (its cache would be partly cold)."""
  spec = compile_budget.RUNS[protocol.lower()]
  result = {"protocol": protocol}
  with tempfile.TemporaryDirectory() as cache_dir:
    result["cold"] = _ours(spec, extra, cache_dir, xla_pass_log, deadline)
    result["warm"] = (_ours(spec, extra, cache_dir, deadline=deadline)
                      if "error" not in result["cold"] else
                      _not_started("the cold run did not finish"))
  if peer_cmd:
    result["released"] = _released(peer_cmd, protocol, deadline)
  return result


def complete(result) -> bool:
  """Whether an item of a results file was measured whole (no part failed, timed out or was
  left out)."""
  if not isinstance(result, dict) or "error" in result:
    return False
  return all(complete(result[k]) for k in ("cold", "warm", "released") if k in result)


def measure_interrupt(seconds: float, extra: list[str], wait_s: float = 300.0) -> dict:
  """A cold base Switch Transformer run sent SIGTERM after `seconds`: exit delay and status
  (killed if it has not ended `wait_s` seconds after the signal)."""
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
        rc = proc.wait(timeout=wait_s)
      except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
      log.seek(0)
      tail = log.read()[-1500:]
  return {"sigterm_at_s": seconds, "exit_after_s": time.monotonic() - t0, "rc": rc,
          "finished_before_signal": finished_before, "log_tail": tail}


def _wall(r: dict | None, key: str = "process_s") -> str:
  if not r or r.get("not_started"):
    return "-"
  if "timed_out_s" in r:
    return f"> {r['timed_out_s']:.0f}"
  if "error" in r:
    return "failed"
  return f"{r[key]:.1f}"


def _compile(r: dict | None) -> str:
  if r and "so_far" in r:  # stopped at its time limit: what it had compiled by then
    return f" (compile >= {r['so_far']['compile_s']:.1f}, {r['so_far']['xla_programs']} programs)"
  return f" ({r['compile_s']:.1f})" if r and "error" not in r else ""


def _ratio(theirs: dict | None, ours: dict | None) -> str:
  if not theirs or not ours or "error" in theirs or "error" in ours:
    return "-"
  return f"{theirs['wall_s'] / ours['process_s']:.2f}x"


def _progress(r: dict) -> str:
  """One item's line on stderr as it is measured."""
  if "protocol" in r:
    return (f"cold {_wall(r['cold'])} s, warm {_wall(r['warm'])} s, released "
            f"{_wall(r.get('released'), 'wall_s')} s")
  if "sigterm_at_s" in r:
    return f"SIGTERM at {r['sigterm_at_s']:.0f} s, exit {r['exit_after_s']:.1f} s later"
  return f"cold {_wall(r)} s"


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
        lines.append(f"| {name} | {_wall(r)}{_compile(r)} | | | | |")
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
  if stop and "error" not in stop:
    lines += ["", f"SIGTERM {stop['sigterm_at_s']:.0f} s into a cold lm_base run"
              f"{' (it had already ended)' if stop['finished_before_signal'] else ''}: exited "
              f"{stop['exit_after_s']:.1f} s later with status {stop['rc']}."]
  left = results.get("not_started")
  if left:
    lines += ["", f"Not started before the deadline: {', '.join(left)}."]
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
  ap.add_argument("--deadline_s", type=float, default=0.0,
                  help="end every process within this many seconds; what cannot start with "
                       f"{MIN_START_S:.0f} s left is listed as not started (0: no deadline)")
  ap.add_argument("--continue_from", default="",
                  help="an earlier --out_dir on this device: its complete results are kept, "
                       "the rest measured")
  args = ap.parse_args(argv)
  if args.deadline_s < 0:
    raise SystemExit(f"accelerator_table: error: --deadline_s={args.deadline_s:g} must be >= 0")
  deadline = Deadline(args.deadline_s)
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
  kept = (kept_results(args.continue_from, device, bool(args.peer_cmd)) if args.continue_from
          else {})
  if args.xla_dump:  # alma_jax's processes inherit it (the released code has no XLA)
    os.environ["XLA_FLAGS"] = dump_flags(out_dir, args.xla_dump)
  _save(out_dir, results)

  def measured(name: str, measure, needs: float = MIN_START_S) -> None:
    """`results[name]`: kept from `--continue_from`, or measured now if `needs` seconds are
    left before the deadline."""
    if name in kept:
      results[name] = kept[name]
      print(f"{name}: kept from {args.continue_from}", file=sys.stderr, flush=True)
      return
    if deadline.allows(needs):
      results[name] = measure()
      print(f"{name}: {_progress(results[name])}", file=sys.stderr, flush=True)
    else:
      results.setdefault("not_started", []).append(name)
    _save(out_dir, results)

  def lm_run(name: str) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
      return _ours(compile_budget.RUNS[name], extra, cache_dir, args.xla_pass_log == "true",
                   deadline)

  def interrupt() -> dict:
    left = deadline.left()
    return measure_interrupt(args.interrupt_at, extra,
                             300.0 if left is None else max(1.0, left - args.interrupt_at))

  for p in protocols:
    measured(p, lambda p=p: measure_protocol(p, args.peer_cmd, extra,
                                             args.xla_pass_log == "true", deadline))
  for name in lms:
    measured(name, lambda name=name: lm_run(name))
  if args.interrupt_at > 0:
    measured("interrupt", interrupt, args.interrupt_at + MIN_START_S)
  if args.xla_dump and os.path.isdir(os.path.join(out_dir, "xla_dump")):
    subprocess.run(["tar", "-czf", "xla_dump.tgz", "xla_dump"], cwd=out_dir, check=False)
    shutil.rmtree(os.path.join(out_dir, "xla_dump"), ignore_errors=True)
  print(table(results, device))
  print(f"(results in {out_dir})", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
