"""The benchmarks that build a run's train step themselves (benchmarks/train_speed.py, which
benchmarks/torch_reference.py uses, and benchmarks/ensemble_strategy.py) build it from a
config whose open fields the rules decide."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from tests.conftest import requires_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # they import their neighbours
  try:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  finally:
    sys.path.remove(os.path.join(ROOT, "benchmarks"))


def test_train_speed_builds_and_times_a_row_s_train_call():
  trainer = _load("train_speed").make_trainer("mlp4_sm", 16, jax, np)
  compile_s, first_s = trainer.warm_up()
  assert compile_s > 0 and first_s > 0 and trainer.run(2) > 0
  assert trainer.steps_per_call == trainer.steps.steps_per_call >= 1


def test_ensemble_strategy_builds_the_steps_of_a_setting():
  method, steps = _load("ensemble_strategy").make_steps("mlp", 4, "ens", 2, "vmap")
  assert method.name == "ens" and steps.steps_per_call >= 1


def test_conv_parts_rewrites_are_the_weight_gradient_and_its_network_has_16_layers():
  parts = _load("conv_parts")
  shapes = parts.layer_shapes(4)
  assert len(shapes) == 16 and shapes[0] == (32, 3, True)
  assert [s for s, _, first in shapes if first] == [32, 16, 8, 4, 2]  # one block per side
  rng = np.random.default_rng(0)
  x, kernel, g = (rng.normal(size=s).astype(np.float32)
                  for s in ((2, 4, 4, 3), (3, 3, 3, 5), (2, 4, 4, 5)))
  # By definition, in float64: dW[i, j, c, o] = sum over b, h, w of xpad[b, h+i, w+j, c] g[b, h, w, o].
  xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
  exact = np.stack([np.stack([np.einsum("bhwc,bhwo->co", xp[:, i:i + 4, j:j + 4], g)
                              for j in range(3)]) for i in range(3)])
  # Each entry sums 32 products of N(0, 1) values in float32: round-off far below 1e-4.
  assert "native" in parts.WGRADS  # the package's kernel builds here (it needs a compiler)
  for fn in [parts.wgrad_xla, *parts.WGRADS.values()]:
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, kernel, g)), exact, rtol=0, atol=1e-4)


def test_compile_budget_s_runs_import_the_package_beside_the_script(tmp_path):
  """Run from a worktree, `compile_budget.py` measures that tree's code: its child process
  imports the package of the script's checkout before any other on the path."""
  decoy = tmp_path / "decoy" / "alma_jax"
  decoy.mkdir(parents=True)
  (decoy / "__init__.py").write_text("raise ImportError('the decoy package was imported')\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path / "decoy"))
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "compile_budget.py"),
       f"--child={tmp_path / 'out.json'}", "--", "--config=configs/no_such_config.py"],
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300, check=False)
  assert "decoy" not in proc.stderr, proc.stderr[-2000:]
  assert "no_such_config" in proc.stderr, proc.stderr[-2000:]


def test_compile_budget_s_child_times_the_cpu_of_writing_programs_down(tmp_path):
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  import importlib  # pylint: disable=g-import-not-at-top
  # The functions it times are there (a JAX that renamed one would leave its column empty).
  for module, attr, _ in compile_budget.CACHE_WRITES:
    owner, _, name = attr.rpartition(".")
    target = importlib.import_module(module)
    assert callable(getattr(getattr(target, owner) if owner else target, name)), attr
  tally = compile_budget.Tally(str(tmp_path / "out.json"), "alma_step_", lambda n: "other",
                               "backend_compile")

  class Owner:
    @staticmethod
    def work(n):
      return sum(i * i for i in range(n))

  assert compile_budget.timed_cpu(Owner, "work", "busy", tally)
  assert not compile_budget.timed_cpu(Owner, "absent", "none", tally)
  assert Owner.work(200_000) == sum(i * i for i in range(200_000))
  Owner.work(10)
  seconds, calls = tally.cpu["busy"]
  assert calls == 2 and seconds > 0 and "none" not in tally.cpu
  tally.write()
  written = json.loads((tmp_path / "out.json").read_text())["cache_write_cpu_s"]
  assert written == {"busy": [seconds, 2]}
  row = {"process_s": 2.0, "compile_s": 1.0, "xla_programs": 1, "hits": [], "misses": [],
         "seconds": {"other": 1.0}, "programs": {"other": 1},
         "cache_write_cpu_s": {"jax_entry": [0.25, 3], "kept_program": [0.125, 3]}}
  assert "| 0.25 / 0.12 |" in compile_budget.table({"p4": {"cold": row}})


def test_compile_budget_s_next_runs_run_on_the_same_cache_and_list_their_misses(
    monkeypatch, capsys, tmp_path):
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_run(spec, extra, cache_dir, xla_cpu_log=False, xla_pass_log=False):
    assert not xla_cpu_log and not xla_pass_log  # not asked for
    calls.append((spec, list(extra), cache_dir))
    missed = (["jit_alma_utility_keys"] if "--config.seed=1" in extra else
              ["jit_alma_step_eval"] if "--config.stream.replay=0.5" in extra else [])
    return {"process_s": 2.0, "compile_s": 0.5, "counting_s": 0.0, "xla_programs": 3,
            "seconds": {"train": 0.5}, "programs": {"train": 1}, "phases": {},
            "hits": ["jit_alma_step_train"], "misses": missed}

  monkeypatch.setattr(compile_budget, "run_one", fake_run)
  monkeypatch.setattr(sys, "argv", [
      "compile_budget.py", "--runs=p4", "--next_seed=true", f"--out={tmp_path / 'out.json'}",
      "--next_flags=--config.stream.wait=2 --config.stream.replay=0.5", "--", "--config.x=1"])
  compile_budget.main()
  # The JSON says what measured it: the package's commit, the CPU, the versions, the load.
  with open(tmp_path / "out.json") as f:
    written = json.load(f)
  from alma_jax.observers import summary  # pylint: disable=g-import-not-at-top
  provenance = written["provenance"]
  assert {k: provenance[k] for k in ("commit", "cpu", "jax", "jaxlib")} == {
      k: summary.provenance()[k] for k in ("commit", "cpu", "jax", "jaxlib")}
  # The start stamp that suite_time.py writes too: UTC, and the last minute's load average.
  assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", provenance["started_utc"])
  assert isinstance(provenance["load_before"], float) and provenance["load_before"] >= 0
  assert set(written["results"]["p4"]) == {"cold", "warm", compile_budget.NEXT_SEED,
                                           compile_budget.NEXT}
  assert [c[1] for c in calls] == [["--config.x=1"]] * 2 + [
      ["--config.x=1", "--config.seed=1"],
      ["--config.x=1", "--config.stream.wait=2", "--config.stream.replay=0.5"]]
  assert len({c[2] for c in calls}) == 1  # one cache for the four runs
  rows = {line.split("|")[2].strip(): line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| p4 ")}
  assert set(rows) == {"cold", "warm", compile_budget.NEXT_SEED, compile_budget.NEXT}
  assert rows[compile_budget.NEXT_SEED].rstrip().endswith("| jit_alma_utility_keys |")
  assert rows[compile_budget.NEXT].rstrip().endswith("| jit_alma_step_eval |")
  assert rows["warm"].rstrip().endswith("| none |")


def test_compile_budget_s_tally_takes_events_from_several_threads(tmp_path):
  """The run traces its FLOP counts on a background thread: events of both threads (each
  rewriting the file as it goes) are all counted, and the file stays whole."""
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "compile.json")
  tally = compile_budget.Tally(out, "alma_step_",
                               lambda name: compile_budget.kind_of(name, "alma_step_"),
                               "/jax/core/compile/backend_compile_duration")
  threads, per_thread = 4, 200
  start = threading.Barrier(threads)

  def events(i):
    start.wait()
    for _ in range(per_thread):
      tally.duration("/jax/core/compile/backend_compile_duration", 0.25,
                     fun_name=f"jit(alma_step_kind{i})")
      tally.note("hits", f"jit_alma_step_kind{i}")

  workers = [threading.Thread(target=events, args=(i,)) for i in range(threads)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  tally.write()
  with open(out) as f:
    written = json.load(f)
  assert written["programs"] == {f"kind{i}": per_thread for i in range(threads)}
  assert written["seconds"] == {f"kind{i}": 0.25 * per_thread for i in range(threads)}
  assert written["name_seconds"] == {f"jit(alma_step_kind{i})": 0.25 * per_thread
                                     for i in range(threads)}
  assert len(written["hits"]) == threads * per_thread
  assert not os.path.exists(out + ".tmp")


# XLA:CPU's log lines of two compiles, as jaxlib 0.10 writes them (abridged; the kernel
# lines come from code-generation threads).
_XLA_CPU_LOG = """\
I1202 13:44:01.223103   28508 cpu_compiler.cc:1269] Running HLO passes on [jit_alma_step_eval] for CPU time: 9.91 ms (9912 us) (cumulative: 278 ms, max: 65 ms, #called: 13)
I1202 13:44:01.223233   28508 cpu_compiler.cc:2091] Compiling: jit_alma_step_eval
I1202 13:44:01.305333   28508 cpu_compiler.cc:1215] CpuCompiler - Running LLVM verifier time: 10 us (10 us) (cumulative: 16 ms, max: 866 us, #called: 321)
I1202 13:44:01.335278   28371 ir_compiler.cc:293] Compiled LLVM module: __compute_module_multiply_add_fusion.9_kernel_module time: 5.43 ms (5428 us) (cumulative: 22.1 ms, max: 13.1 ms, #called: 3)
I1202 13:44:01.340128   28371 ir_compiler.cc:293] Compiled LLVM module: __compute_module_multiply_add_fusion_kernel_module time: 4.5 ms (4500 us) (cumulative: 26.6 ms, max: 13.1 ms, #called: 4)
I1202 13:44:01.345142   28372 ir_compiler.cc:293] Compiled LLVM module: __compute_module_wrapped_broadcast_kernel_module time: 1.2 s (1200000 us) (cumulative: 1.23 s, max: 1.2 s, #called: 5)
I1202 13:44:01.346000   28372 ir_compiler.cc:293] Compiled LLVM module: __compute_module___compute_module_wrapped_is-finite.4 time: 2 ms (2000 us) (cumulative: 1.23 s, max: 1.2 s, #called: 6)
I1202 13:44:01.347000   28372 ir_compiler.cc:293] Compiled LLVM module: __compute_module_part_05 time: 3 ms (3000 us) (cumulative: 1.24 s, max: 1.2 s, #called: 7)
I1202 13:44:01.437631   28508 cpu_compiler.cc:2094] Compiling [jit_alma_step_eval] for CPU using JIT time: 214 ms (214380 us) (cumulative: 4.83 s, max: 1.04 s, #called: 13)
I1202 13:44:02.000000   28508 cpu_compiler.cc:1269] Running HLO passes on [jit__threefry_split] for CPU time: 900 us (900 us) (cumulative: 279 ms, max: 65 ms, #called: 14)
I1202 13:44:02.100000   28371 ir_compiler.cc:293] Compiled LLVM module: __compute_module_wrapped_broadcast_kernel_module time: 800 us (800 us) (cumulative: 1.23 s, max: 1.2 s, #called: 6)
I1202 13:44:02.200000   28508 cpu_compiler.cc:2094] Compiling [jit__threefry_split] for CPU using JIT time: 1.5 s (1500000 us) (cumulative: 6.33 s, max: 1.5 s, #called: 14)
I1202 13:44:02.300000   28371 ir_compiler.cc:293] Compiled LLVM module: __compute_module_late_fusion_kernel_module time: 3 ms (3000 us) (cumulative: 1.23 s, max: 1.2 s, #called: 7)
"""


def test_compile_budget_reads_xla_cpu_s_log_per_program_kind():
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  got = compile_budget.xla_cpu_compiles(_XLA_CPU_LOG, "alma_step_")
  assert set(got) == {"eval", "other"}  # a kernel after its module's compile belongs to none
  ev, other = got["eval"], got["other"]
  assert (ev["programs"], ev["kernels"], other["programs"], other["kernels"]) == (1, 5, 1, 1)
  np.testing.assert_allclose([ev["hlo_passes_s"], ev["codegen_s"], ev["kernel_s"]],
                             [9.91e-3, 0.214, 5.43e-3 + 4.5e-3 + 1.2 + 2e-3 + 3e-3], rtol=1e-12)
  np.testing.assert_allclose([other["hlo_passes_s"], other["codegen_s"]], [900e-6, 1.5],
                             rtol=1e-12)
  assert ev["by_kernel"].keys() == {"multiply_add_fusion", "wrapped_broadcast",
                                    "wrapped_is-finite", "part"}
  np.testing.assert_allclose(ev["by_kernel"]["multiply_add_fusion"], [9.93e-3, 2], rtol=1e-12)
  rows = compile_budget.xla_cpu_table({"p4": {"cold": {"xla_cpu": got}, "warm": {}}})
  rows = rows.splitlines()[2:]
  assert [r.split("|")[3].strip() for r in rows] == ["other", "eval"]  # largest compile first
  assert rows[1].endswith("| 5 | wrapped_broadcast 1.20 / 1, multiply_add_fusion 0.01 / 2, "
                         "part 0.00 / 1, wrapped_is-finite 0.00 / 1 |")


# XLA's HLO-pass log lines of two compiles on two threads, as jaxlib 0.10 writes them
# (abridged): a nested pipeline ("simplification") is logged as a pass of its parent too.
_XLA_PASS_LOG = """\
I1202 16:51:35.900000   32110 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_alma_step_eval: HLO passes through layout assignment
I1202 16:51:35.900100   32110 hlo_pass_pipeline.cc:181]   HLO pass algsimp
I1202 16:51:35.900200   32110 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 2.5 ms (2500 us) (cumulative: 2.5 ms, max: 2.5 ms, #called: 1)
I1202 16:51:35.900300   32110 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_alma_step_eval: simplification
I1202 16:51:35.900400   32111 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_grow: simplification
I1202 16:51:35.900500   32110 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 1 ms (1000 us) (cumulative: 3.5 ms, max: 2.5 ms, #called: 2)
I1202 16:51:35.900600   32111 hlo_pass_pipeline.cc:176] HLO pass: cse time: 40 us (40 us) (cumulative: 3.54 ms, max: 2.5 ms, #called: 3)
I1202 16:51:35.900700   32110 hlo_pass_pipeline.cc:176] HLO pass: dce time: 500 us (500 us) (cumulative: 4.04 ms, max: 2.5 ms, #called: 4)
I1202 16:51:35.900800   32110 hlo_pass_pipeline.cc:176] HLO pass: simplification time: 1.6 ms (1600 us) (cumulative: 5.64 ms, max: 2.5 ms, #called: 5)
I1202 16:51:35.900900   32110 hlo_pass_pipeline.cc:176] HLO pass: gemm-fusion-autotuner time: 2.1 s (2100000 us) (cumulative: 2.11 s, max: 2.1 s, #called: 6)
I1202 16:51:35.901000   32111 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 1.5 s (cumulative: 3.6 s, max: 2.1 s, #called: 7)
I1202 16:51:37.000000   32111 hlo_pass_pipeline.cc:176] HLO pass: gemm-fusion-autotuner time: 1.5 min (90000000 us) (cumulative: 1.56 min, max: 1.5 min, #called: 8)
HLO pass: orphan time: 1 ms (1000 us)
"""


def test_compile_budget_reads_xla_s_pass_log_per_program_kind():
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  got = compile_budget.xla_passes(_XLA_PASS_LOG, "alma_step_")
  assert set(got) == {"eval", "other"}  # a line on no pipeline's thread belongs to none
  ev, grow = got["eval"], got["other"]
  # The nested pipeline's 1.6 ms is that of its passes (algsimp 1 ms, dce 0.5 ms): not again.
  np.testing.assert_allclose(ev["passes_s"], 2.5e-3 + 1e-3 + 5e-4 + 2.1, rtol=1e-12)
  assert ev["by_pass"].keys() == {"algsimp", "dce", "gemm-fusion-autotuner"}
  np.testing.assert_allclose(ev["by_pass"]["algsimp"], [3.5e-3, 2], rtol=1e-12)
  np.testing.assert_allclose(grow["passes_s"], 40e-6 + 1.5 + 90, rtol=1e-12)  # "1.5 s" alone
  result = {"seconds": {"eval": 2.5, "other": 95.0}, "programs": {"eval": 1, "other": 1},
            "xla_passes": got}
  rows = compile_budget.xla_pass_table({"p4": {"cold": result, "warm": {}}}).splitlines()[2:]
  assert [r.split("|")[3].strip() for r in rows] == ["other", "eval"]  # most compile first
  assert rows[1] == ("| p4 | cold | eval | 2.50 (1) | 2.10 | gemm-fusion-autotuner 2.10 / 1, "
                     "algsimp 0.00 / 2, dce 0.00 / 1 |")


def test_a_failed_run_s_error_is_not_buried_under_xla_s_log():
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  stderr = ("W1202 16:51:35.800000   32110 cpu_feature.cc:1] a warning stays\n"
            + _XLA_PASS_LOG * 50 + "alma_jax: error: config.stream.wait=-1 is not allowed\n")
  tail = compile_budget.error_tail(stderr)
  assert tail == ("W1202 16:51:35.800000   32110 cpu_feature.cc:1] a warning stays\n"
                  + "HLO pass: orphan time: 1 ms (1000 us)\n" * 50
                  + "alma_jax: error: config.stream.wait=-1 is not allowed")[-3000:]
  assert tail.endswith("is not allowed") and "hlo_pass_pipeline.cc" not in tail


def _probe_compile_log(log_env: dict) -> str:
  """The stderr of a process that compiles one program, `jit(alma_step_probe)`, on the CPU
  with the XLA log environment `log_env`."""
  code = ("import jax, jax.numpy as jnp\n"
          "def alma_step_probe(x):\n  return jnp.tanh(x) * 2 + jnp.sin(x).sum()\n"
          "jax.jit(alma_step_probe)(jnp.ones((64, 64))).block_until_ready()\n")
  env = {**os.environ, **log_env, "JAX_ENABLE_COMPILATION_CACHE": "false",
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=300, check=True).stderr


def test_xla_s_pass_log_of_a_real_compile_is_read():
  """The pass lines `compile_budget.py --xla_pass_log` reads are those this jaxlib writes, with
  both logs asked for in one process: the passes' seconds fit in XLA:CPU's own total of them
  (the nesting of pipelines is the recorded log's test)."""
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  stderr = _probe_compile_log(compile_budget.log_env(True, True))
  probe = compile_budget.xla_passes(stderr, "alma_step_")["probe"]
  total = compile_budget.xla_cpu_compiles(stderr, "alma_step_")["probe"]["hlo_passes_s"]
  runs = sum(n for _, n in probe["by_pass"].values())
  assert runs > 10 and "algsimp" in probe["by_pass"], stderr[-3000:]
  # Each pass's time is logged in whole microseconds, inside the passes' total.
  assert 0 < probe["passes_s"] <= total + runs * 1e-6, (probe["passes_s"], total)


def test_xla_cpu_s_log_of_a_real_compile_is_read():
  """The log lines `compile_budget.py --xla_cpu_log` reads are those this jaxlib writes."""
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  stderr = _probe_compile_log(compile_budget.XLA_CPU_LOG)
  probe = compile_budget.xla_cpu_compiles(stderr, "alma_step_")["probe"]
  assert probe["programs"] == 1 and probe["kernels"] >= 1, stderr[-3000:]
  assert probe["hlo_passes_s"] > 0 and probe["codegen_s"] > 0 and probe["kernel_s"] > 0


def _script(name, *args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *args],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_benchmark_flags_that_would_run_nothing_or_compare_with_nothing_are_refused(tmp_path):
  # Before the first run: an empty --runs, and a --compare folder that is not there (which
  # would be known only after every config had run, as a difference for each).
  proc = _script("compile_budget", "--runs=")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "compile_budget.py: error: --runs=: no run; valid: ['ff_quick', ")
  proc = _script("smoke_records", f"--root={tmp_path}/r", f"--compare={tmp_path}/nothing")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      f"smoke_records.py: error: --compare={tmp_path}/nothing is not a folder of earlier runs "
      "(a --root of this script)")
  assert not os.path.exists(tmp_path / "r")


@requires_mnist
def test_gpu_compile_offline_summary_sets_results_side_by_side(tmp_path):
  offline = _load("gpu_compile_offline")
  # How a program hashes its draws, read from its StableHLO as JAX lowers it.
  kernel = "func.func private @threefry2x32_0(%a) {\n  stablehlo.custom_call @cu_threefry2x32_ffi(%a)"
  assert offline.threefry_lowering(kernel) == "kernel"
  assert offline.threefry_lowering("func.func private @threefry2x32(%a: tensor<2xui32>)") == "xla"
  assert offline.threefry_lowering("func.func public @main(%a) { stablehlo.add }") == ""

  def row(program, seconds, threefry):
    return {"file": f"{program}.mlir", "program": program, "stablehlo_lines": 10,
            "threefry": threefry, "compile_s": seconds, "passes_s": 0.1, "slowest_passes": {}}

  results = tmp_path / "p9_xla.json"
  results.write_text(json.dumps({"dump": {"run": "p9", "commit": "abc1234"}, "rows": [
      row("jit_alma_utility_init", 12.5, "xla"), row("jit_alma_step_eval", 1.25, ""),
      row("jit_alma_step_train", 4.0, "xla")]}))
  proc = _script("gpu_compile_offline", "summary", str(results))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines()[2] == (
      "| p9_xla.json | p9 | abc1234 | xla | 3 | 17.8 | 2 | 16.5 | jit_alma_utility_init 12.5 |")
  proc = _script("gpu_compile_offline", "summary", str(tmp_path / "none.json"))
  assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
      f"gpu_compile_offline.py: error: summary: no such results file: {tmp_path / 'none.json'}")
  proc = _script("gpu_compile_offline", "compile", f"--ir={tmp_path}", "stray")
  assert proc.returncode == 2 and "error: unrecognized arguments: stray" in proc.stderr


def test_gpu_compile_offline_names_a_program_that_cannot_be_lowered_for_cuda(monkeypatch,
                                                                             tmp_path):
  # dump's child lowers every program its run compiles for CUDA too; one that fails is named
  # with its error, and the run goes on.
  offline = _load("gpu_compile_offline")
  from jax._src import pjit  # pylint: disable=g-import-not-at-top
  original = pjit._resolve_and_lower  # pylint: disable=protected-access

  def refusing_halve(*args, **kwargs):
    if kwargs.get("lowering_platforms") == ("cuda",) and kwargs["name"] == "halve":
      raise NotImplementedError("no CUDA lowering")
    return original(*args, **kwargs)

  def triple(v):
    return v * 3.0

  def halve(v):
    return v / 2.0

  monkeypatch.setattr(pjit, "_resolve_and_lower",
                      offline.lowering_also_for_cuda(refusing_halve, str(tmp_path)))
  x = np.arange(3.0, dtype=np.float32)
  np.testing.assert_array_equal(jax.jit(triple)(x), x * 3.0)
  np.testing.assert_array_equal(jax.jit(halve)(x), x / 2.0)  # runs on the CPU all the same
  assert [name for name, _ in offline.dumped_programs(str(tmp_path))] == ["jit_triple"]
  with open(tmp_path / offline.NOT_LOWERED) as f:
    assert [json.loads(line) for line in f] == [
        {"program": "halve", "error": "NotImplementedError: no CUDA lowering"}]


def test_gpu_compile_offline_writes_down_a_run_s_programs_and_asks_for_the_cuda_plugin(tmp_path):
  # The first step runs on any machine: the run's programs as JAX lowered them, with what
  # ran. The second needs JAX's CUDA plugin (not in this environment): refused before any
  # compile, with the command that installs it.
  offline = _load("gpu_compile_offline")
  ir = tmp_path / "ir"
  proc = _script("gpu_compile_offline", "dump", "--run=configs/mnist_sm.py:smoke", f"--ir={ir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  names = [name for name, _ in offline.dumped_programs(str(ir))]
  assert "jit_alma_step_eval" in names, names
  assert {"jit_alma_step_train", "jit_alma_step_stage"} & set(names), names  # call or stage
  with open(ir / offline.DUMP_INFO) as f:
    info = json.load(f)
  assert info["run"] == "configs/mnist_sm.py:smoke" and info["returncode"] == 0
  assert "--compilation_cache_dir=none" in info["command"] and info["commit"]
  assert set(offline.PORTABLE) <= set(info["command"])  # no measuring; XLA's convolutions
  # The Switch Transformer has no convolutions, and its task refuses the field.
  assert offline.portable_flags("configs/lm_sm.py:smoke") == ("--config.train.autotune=rules",)
  assert info["lowered_for"] == "cuda" and info["not_lowered"] == []
  # Lowered as a GPU run lowers them: the initialisation's Threefry hash is jaxlib's CUDA
  # kernel (`train.gpu_threefry=kernel`), where the CPU's program loops over the rounds.
  programs = dict(offline.dumped_programs(str(ir)))
  with open(programs["jit_alma_utility_init"]) as f:
    init = f.read()
  assert "custom_call @cu_threefry2x32_ffi(" in init and "stablehlo.while" not in init
  proc = _script("gpu_compile_offline", "dump", "--run=p4", f"--ir={ir}")  # not over a dump
  assert proc.returncode == 1 and "already holds programs" in proc.stderr
  proc = _script("gpu_compile_offline", "compile", f"--ir={ir}", "--iR=typo")
  assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
      "gpu_compile_offline.py: error: unrecognized arguments: --iR=typo (flags after `--` go "
      "to `dump`'s run)")
  proc = _script("gpu_compile_offline", "compile", f"--ir={ir}")
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.splitlines()[-1] == (
      "gpu_compile_offline.py: error: compile: compiling for a GPU needs JAX's CUDA plugin in "
      "this Python, of its JAX's version: pip install \"jax[cuda13]=="
      f"{jax.__version__}\" in a virtualenv of its own (no GPU is needed)")


# Every benchmark that writes its results as JSON when it ends: the flag that names the file.
_JSON_FLAGS = {"compile_budget": "--out", "peer": "--out", "end_to_end": "--out", "seeds": "--out",
               "ensemble_strategy": "--out", "growth_programs": "--out", "conv_parts": "--json",
               "torch_reference": "--json", "train_speed": "--json", "suite_time": "--out",
               "gpu_compile_offline": "--out"}


@pytest.mark.parametrize("name", sorted(_JSON_FLAGS))
def test_a_results_file_that_cannot_be_written_is_refused_before_anything_is_measured(name,
                                                                                      tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  flag = _JSON_FLAGS[name]
  args = {"growth_programs": ["--runs=configs/mnist_sm.py:smoke"],
          "gpu_compile_offline": ["compile", f"--ir={tmp_path}"]}.get(name, [])
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *args,
                         f"{flag}={blocker}/results.json"], cwd=str(tmp_path),
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.splitlines()[-1] == (
      f"{name}.py: error: {flag}={blocker}/results.json: its folder {blocker} cannot be made: "
      f"{blocker} is a file")
  assert proc.stdout == "" and sorted(os.listdir(tmp_path)) == ["a_file"]


# -- the suite's time ------------------------------------------------------------------------------
_DURATIONS = """\
============================= slowest durations ==============================
12.50s call     tests/a/test_x.py::test_one[p-1]
2.25s setup    tests/a/test_x.py::test_one[p-1]
0.75s call     tests/test_y.py::test_two
0.01s teardown tests/a/test_x.py::test_three
(40 durations < 0.005s hidden.  Use -vv to show these durations.)
=========================== short test summary info ============================
FAILED tests/test_y.py::test_two - AssertionError
======= 1 failed, 41 passed, 2 skipped, 3 warnings, 1 error in 84.20s (0:01:24) ========
"""


def test_suite_time_reads_pytest_s_durations_per_file_and_its_outcome():
  parsed = _load("suite_time").parse(_DURATIONS)
  assert parsed["pytest_s"] == 84.2
  assert parsed["outcome"] == {"failed": 1, "passed": 41, "skipped": 2, "errors": 1}
  assert parsed["files"] == {"tests/a/test_x.py": 14.76, "tests/test_y.py": 0.75}
  assert parsed["worker_s"] == 15.51
  assert parsed["slowest"][0] == [12.5, "call", "tests/a/test_x.py::test_one[p-1]"]
  assert [p[0] for p in parsed["slowest"]] == [12.5, 2.25, 0.75, 0.01]


def test_suite_time_runs_pytest_between_probes_and_compares_two_results(tmp_path):
  tests = tmp_path / "tiny"
  tests.mkdir()
  (tests / "test_tiny.py").write_text(
      "import time\n\ndef test_slow():\n  time.sleep(0.3)\n\n"
      "def test_fails():\n  time.sleep(0.1)\n  assert False\n")
  out = tmp_path / "r" / "suite.json"
  proc = _script("suite_time", f"--out={out}", "--probe_runs=1", "--", str(tests))
  assert proc.returncode == 1, proc.stderr[-3000:]  # a test failed
  result = json.loads(out.read_text())
  assert result["outcome"] == {"failed": 1, "passed": 1}
  assert result["returncode"] == 1 and "assert False" in result["output_tail"]
  (file_s,) = result["files"].values()
  assert 0.4 <= file_s < 10 and result["worker_s"] == pytest.approx(file_s)
  assert result["wall_s"] >= result["pytest_s"] > 0.4
  assert len(result["probe_before_s"]) == len(result["probe_after_s"]) == 1
  assert all(s > 0 for s in result["probe_before_s"] + result["probe_after_s"])
  assert result["command"].endswith(f"--durations=0 {tests}") and result["cpu"]
  # The suite's CPU seconds: at least pytest's import and collection in its process, and
  # at most every core over the wall time; the CPUs' busy share before it, a fraction.
  assert 0 < result["cpu_s"] <= result["wall_s"] * os.cpu_count() + 0.5
  assert result["cpu_share"] == pytest.approx(
      result["cpu_s"] / (result["wall_s"] * os.cpu_count()), abs=1e-3)
  assert 0 <= result["busy_before"] <= 1
  assert "workers' seconds" in proc.stdout and "% of the cores over the wall time" in proc.stdout
  assert "probe before:" in proc.stderr and "1 failed, 1 passed" in proc.stderr  # as it runs
  # Two results files compared, nothing run.
  other = dict(result, files={n: 2 * s for n, s in result["files"].items()}, commit="c2")
  (tmp_path / "other.json").write_text(json.dumps(other))
  proc = _script("suite_time", f"--compare={out}", f"--read={tmp_path}/other.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "median ratio of the files of a second or more" in proc.stdout
  assert "2.00" in proc.stdout.splitlines()[-1]
  assert "old CPU " in proc.stdout and "new CPU " in proc.stdout
  # A file written before the CPUs' use was recorded still compares.
  older = {k: v for k, v in result.items() if k not in ("cpu_s", "cpu_share", "busy_before")}
  (tmp_path / "older.json").write_text(json.dumps(older))
  proc = _script("suite_time", f"--compare={tmp_path}/older.json", f"--read={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "old CPU seconds not recorded" in proc.stdout
  # The probe alone.
  proc = _script("suite_time", "--probe_only", "--probe_runs=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (seconds,) = json.loads(proc.stdout)["probe_s"]
  assert seconds > 0


def _kept_run(folder, name, text):
  folder.mkdir(exist_ok=True)
  (folder / name).write_text(text)


def test_suite_time_s_history_lists_the_kept_whole_suite_runs_per_cpu(tmp_path):
  st = _load("suite_time")
  epyc, xeon = tmp_path / "epyc25m17_2026-12-06", tmp_path / "xeon167_2026-12-04"
  _kept_run(epyc, "suite_abcdef1_clone.txt",
            "# CI=true bash .ci/run in a fresh clone\n"
            'probe_before {"probe_s": [1.5, 1.25]}\n'
            "12 passed, 3 warnings in 700.40s (0:11:40)\n"
            'probe_after {"probe_s": [1.75]}\n')
  _kept_run(epyc, "suite_1234567.json", json.dumps(
      {"pytest_s": 760.0, "outcome": {"passed": 12}, "probe_before_s": [1.3],
       "probe_after_s": [1.4], "files": {}}))
  _kept_run(epyc, "suite_7654321_durations.txt",  # a test failed: listed, not summarised
            "============ 1 failed, 11 passed in 1000.00s (0:16:40) ============\n")
  _kept_run(epyc, "suite_abcdef1_vocab_durations.txt",  # an experiment: not a commit's run
            "12 passed in 10.00s\n")
  _kept_run(epyc, "suite_abcdef2_clone.txt", "# stopped before its closing line\n")
  _kept_run(xeon, "suite_0000000_clone.txt", "12 passed in 725.00s (0:12:05)\n")
  _kept_run(tmp_path / "h200_2026-11-27", "suite_1111111.txt", "12 passed in 9.00s\n")
  hosts = st.history(str(tmp_path))
  assert sorted(hosts) == ["AMD EPYC, family 25 model 17", "Intel Xeon, family 6 model 167"]
  runs = hosts["AMD EPYC, family 25 model 17"]
  assert [(r["commit"], r["clone"], r["pytest_s"], r["probes"]) for r in runs] == [
      ("1234567", False, 760.0, [1.3, 1.4]),
      ("7654321", False, 1000.0, []),
      ("abcdef1", True, 700.4, [1.5, 1.25, 1.75])]
  assert runs[1]["outcome"] == {"failed": 1, "passed": 11}
  table = st.history_text(hosts).splitlines()
  assert table[2:] == [
      "| AMD EPYC, family 25 model 17 | 2 | 2026-12-06 | 11 min 40 s | 12 min 10 s | "
      "12 min 40 s |",
      "| Intel Xeon, family 6 model 167 | 1 | 2026-12-04 | 12 min 5 s | 12 min 5 s | "
      "12 min 5 s |"]
  every = st.history_text(hosts, runs=True)
  assert ("| AMD EPYC, family 25 model 17 | 2026-12-06 | 7654321 | checkout | 16 min 40 s | "
          "1 failed, 11 passed |  | `") in every
  assert "| fresh clone | 11 min 40 s | 12 passed | 1.25-1.75 |" in every
  assert st.host_of("epyc25_2026-11-28") == ("AMD EPYC, family 25", "2026-11-28")
  assert st.host_of("xeon_2026-11-28") == ("Intel Xeon", "2026-11-28")
  # A damaged kept run is named, not skipped.
  _kept_run(epyc, "suite_2222222.json", "{")
  with pytest.raises(ValueError, match=r"epyc25m17_2026-12-06/suite_2222222\.json is not a "
                                       r"kept run of the suite \(JSONDecodeError"):
    st.history(str(tmp_path))


def test_contributing_quotes_the_suite_s_times_of_the_kept_runs():
  # The table in CONTRIBUTING.md is what `suite_time.py --history` prints from the files
  # under benchmarks/results: a run kept there changes it.
  with open(os.path.join(ROOT, "CONTRIBUTING.md")) as f:
    text = f.read()
  quoted = text.split("<!-- suite_time.py --history -->\n", 1)[1].split("\n<!-- end -->", 1)[0]
  st = _load("suite_time")
  assert quoted == st.history_text(st.history())


def test_suite_time_flags_that_would_measure_nothing_are_refused(tmp_path):
  for args, error in [
      ((f"--read={tmp_path}/a.json",), f"--read={tmp_path}/a.json: nothing to compare it with; "
                                        "give --compare"),
      ((), "--out is missing: the file that keeps the results of the run"),
      ((f"--out={tmp_path}/o.json", "--probe_runs=-1"), "--probe_runs=-1: must be 0 or more"),
      (("--probe_only", "--probe_runs=0"), "--probe_only runs the probe alone: give "
                                           "--probe_runs of 1 or more and no other flag"),
      ((f"--out={tmp_path}/o.json", f"--compare={tmp_path}/none.json"),
       f"--compare={tmp_path}/none.json is not a results file of this script (FileNotFoundError"),
      (("--runs",), "--runs lists the kept runs: give it with --history"),
      (("--history", f"--out={tmp_path}/o.json"), "--history reads the kept runs and runs "
                                                  "nothing: give no other flag but --runs")]:
    proc = _script("suite_time", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith(f"suite_time.py: error: {error}")
  assert not os.listdir(tmp_path)
