"""End-to-end runs of the entry point on the real data (smoke configs)."""

import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from alma_jax.engine.metrics import RECORD_KEYS
from alma_jax.stream import config_resolve
from alma_jax.stream import validation
from alma_jax.tuning import autotune
from alma_jax.tuning import cpu_fusion
from tests import helpers
from tests.conftest import requires_cifar10, requires_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A donated train state that XLA cannot reuse is an error in these runs (it warns otherwise).
NO_UNUSED_DONATION = ["-W", "error:Some donated buffers were not usable:UserWarning"]


def run_main(config, workdir, *flags, env=None):
  cmd = [sys.executable, *NO_UNUSED_DONATION, "-m", "alma_jax.main", f"--config={config}", f"--workdir={workdir}",
         "--config.mesh.num_devices=1", helpers.NO_FIGURE, *flags]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def check_outputs(workdir, num_megabatches):
  names = sorted(os.listdir(workdir))
  for f in ("config.json", "log.jsonl", "summary.json"):
    assert f in names
  with open(os.path.join(workdir, "log.jsonl")) as f:
    records = [json.loads(l) for l in f]
  assert [r["t"] for r in records] == list(range(num_megabatches + 1))
  for r in records:
    assert set(r) == set(RECORD_KEYS)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  for k in ("cer", "mean_error", "mem", "comp", "final_error", "num_stages", "wall_s"):
    assert k in summary
  assert summary["cer"] == pytest.approx(sum(r["test_error"] for r in records))
  assert summary["mem"] == sum(r["num_params"] for r in records)
  assert summary["comp"] == pytest.approx(sum(r["train_flops"] for r in records))
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  assert config["stream"]["num_megabatches"] == num_megabatches
  return records, summary


# Runs the entry point in-process; an exit handler reports which heavy modules it imported.
# A finished run ends its process after the exit handlers, without the interpreter's teardown:
# what follows the entry point does not run.
_MAIN_AND_REPORT_IMPORTS = """
import atexit, runpy, sys
sys.argv = ["alma_jax.main"] + sys.argv[1:]
atexit.register(lambda: print("IMPORTED:", sorted(
    m for m in ("tensorflow", "tensorflow_datasets", "matplotlib") if m in sys.modules)))
try:
  runpy.run_module("alma_jax.main", run_name="__main__")
except SystemExit as e:
  if e.code:
    raise
print("AFTER THE ENTRY POINT")
"""


@requires_mnist
def test_mnist_sm_smoke_end_to_end(tmp_path):
  # Warm the decoded-data cache first, so the run below must not import TensorFlow.
  from alma_jax.data import images  # pylint: disable=g-import-not-at-top
  images.load_image_dataset("mnist")
  cmd = [sys.executable, *NO_UNUSED_DONATION, "-c", _MAIN_AND_REPORT_IMPORTS,
         "--config=configs/mnist_sm.py:smoke",
         f"--workdir={tmp_path}", "--config.mesh.num_devices=1"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "IMPORTED: []" in proc.stdout, proc.stdout[-2000:]
  assert "AFTER THE ENTRY POINT" not in proc.stdout
  assert "done: 1 seed(s)" in proc.stderr, proc.stderr[-2000:]  # its closing line, flushed
  # Its log lines are plain, without library notices.
  lines = proc.stderr.splitlines()
  assert any(l.startswith("t=4/4 (100%) ") for l in lines), proc.stderr[-2000:]
  assert any(l.startswith("done: 1 seed(s), CER=") for l in lines)
  assert not any("meter.py:" in l or "summary.py:" in l for l in lines)  # no absl prefix
  assert "Unable to initialize backend" not in proc.stderr
  assert "oneDNN custom operations" not in proc.stderr
  records, summary = check_outputs(tmp_path, 4)
  assert not records[0]["trained"] and all(r["trained"] for r in records[1:])
  assert records[0]["train_flops"] == 0 and records[1]["train_flops"] > 0
  # SM on real MNIST learns: well below chance (0.9) after four tiny stages of
  # two epochs each (~0.6 with the smoke config's 8 hidden units).
  assert summary["final_error"] < min(0.75, records[0]["test_error"] - 0.15)
  assert summary["num_stages"] == 4
  # The timing breakdown covers the run: every part is non-negative, the parts
  # and the unattributed rest add up to wall_s, and the rest is small.
  timings = summary["timings"]
  parts = ("data_s", "compile_s", "train_s", "eval_s", "io_s", "other_s")
  assert all(timings[p] >= 0 for p in parts) and timings["startup_s"] > 0
  assert sum(timings[p] for p in parts) == pytest.approx(summary["wall_s"], rel=1e-6)
  assert timings["compile_s"] > 0 and timings["train_s"] > 0
  assert timings["other_s"] < 0.35 * summary["wall_s"], timings


def test_a_finished_run_under_a_profiler_returns_to_it():
  # A profiler (cProfile) writes its results after the program returns: the process that
  # `alma_jax.main` would end at once after a finished run (see above) goes on under one.
  code = ("import atexit, sys; from alma_jax import main; atexit.register(print, 'EXITING'); "
          "sys.setprofile(lambda *args: None); main._finished(); sys.setprofile(None); "
          "print('RETURNED')")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["RETURNED", "EXITING"]


@requires_cifar10
def test_cifar_sm_smoke_end_to_end_with_waiting(tmp_path):
  # Measured choices are tested in tests/tuning/test_autotune.py and tests/tuning/test_cpu_fusion.py. Here
  # the convolution is set, and the machine's record holds the fusion flags (`ynn`): the run
  # sets them before JAX starts and records the choice in its workdir and summary.
  config, flags = "configs/cifar_sm.py:smoke", ["--config.stream.wait=2",
                                                "--config.model.conv_impl=xla",
                                                "--config.train.step_fusion=same",
                                                "--config.train.eval_fusion=same",
                                                "--config.train.autotune=measure"]
  c = config_resolve.resolve(config, flags + ["--config.mesh.num_devices=1"])
  cache_dir, wd = tmp_path / "cache", tmp_path / "wd"
  # The session's decoded CIFAR-10 (decoded here if no test has yet), linked into this cache:
  # what this test is about is the run's choices, not a fresh decode.
  from alma_jax.data import images  # pylint: disable=g-import-not-at-top
  images.load_image_dataset("cifar10")
  cache_dir.mkdir()
  os.symlink(os.path.join(os.environ["ALMA_JAX_CACHE_DIR"], "cifar10"), cache_dir / "cifar10")
  xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_fast_math=false".strip()
  env = dict(os.environ, ALMA_JAX_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags)
  with mock.patch.dict(os.environ, env):
    key = cpu_fusion.process_key(c, validation.KNOWN_SHAPES["cifar10"][0])
  autotune.remember(str(cache_dir / autotune.FILE), key, "ynn")
  proc = run_main(config, wd, *flags, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (f"train.cpu_fusion: 'ynn' measured earlier on this machine "
          f"({cache_dir / autotune.FILE}); XLA_FLAGS='{xla_flags} {cpu_fusion.FLAG}'") in proc.stderr
  mine = autotune.read(str(wd / autotune.FILE))
  assert mine.pop(key) == "ynn"
  # A convolution-heavy step's steps per call: the rule's one candidate, nothing compiled to
  # measure it; kept in the workdir for a resume like the run's other choices.
  assert "train.steps_per_call: 1 by rule (the only candidate here)" in proc.stderr
  assert [(json.loads(k)["field"], v) for k, v in mine.items()] == [("train.steps_per_call", 1)]
  # A fresh cache decodes the data set, from its prepared files: no TensorFlow notice.
  assert "oneDNN custom operations" not in proc.stderr, proc.stderr[-3000:]
  records, summary = check_outputs(wd, 4)
  assert summary["choices"] == {"train.cpu_allocator": "tuned", "train.cpu_fusion": "ynn",
                                "train.stage_program": "per_epoch", "train.steps_per_call": 1}
  assert [r["trained"] for r in records] == [False, False, True, False, True]
  # While waiting, the model is unchanged: same error, no training compute.
  assert records[1]["test_error"] == records[0]["test_error"]
  assert records[1]["train_flops"] == 0
  assert summary["num_stages"] == 2


@requires_mnist
@requires_cifar10
@pytest.mark.parametrize("config", ["mnist_ens", "mnist_umix", "mnist_gmoe", "cifar_gens",
                                    "cifar_gmoe"])
def test_every_method_config_runs_end_to_end(config, tmp_path):
  # mnist_sm, cifar_sm and mnist_gens have end-to-end tests of their own; the VGG's
  # ensembles are tested in tests/methods/test_ensemble.py, and every config file and variant
  # validates and builds its method in tests/core/test_validation.py.
  proc = run_main(f"configs/{config}.py:smoke", tmp_path, "--config.train.epochs=1",
                  "--config.train.patience=1", "--config.train.autotune=rules")
  assert proc.returncode == 0, proc.stderr[-3000:]
  records, summary = check_outputs(str(tmp_path), 4)
  assert summary["num_stages"] == 4 and all(r["train_flops"] > 0 for r in records[1:])
  arch = [json.loads(l) for l in open(os.path.join(tmp_path, "architecture.jsonl"))]
  assert [a["t"] for a in arch] == [1, 2, 3, 4]
  assert [a["num_params"] for a in arch] == [r["num_params"] for r in records[1:]]


def _cli(*args, cwd=None):
  """The installed `alma-jax` command where there is one (as a user types it), else the
  module; from `cwd` (default: a folder outside the checkout), this checkout first."""
  import shutil  # pylint: disable=g-import-not-at-top
  exe = shutil.which("alma-jax", path=os.path.dirname(sys.executable))
  cmd = [exe] if exe else [sys.executable, "-m", "alma_jax.main"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run(cmd + list(args), cwd=cwd or os.path.dirname(ROOT), capture_output=True,
                        text=True, timeout=300, env=env)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_configs_their_variants_and_the_flags(flag):
  proc = _cli(flag)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert out.startswith("usage: alma-jax --config=NAME")
  for text in ("mnist_sm", "cifar_gmoe", "lm_gmoe", "bench/p3_mnist_sm", "smoke, quick", "iid",
               "--workdir", "--overwrite", "--print_config", "--config.<field>=VALUE"):
    assert text in out, text
  direct = subprocess.run([sys.executable, "-m", "alma_jax.main", flag], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  assert direct.stdout == out  # the module prints the same help


@pytest.mark.parametrize("module, flag, texts", [
    # the help that each command's error messages point to: absl's own, every library's flags
    # (its logging's too), or the module's (the other help flags: the next test)
    ("alma_jax.main", "--helpfull", ("--workdir", "--verbosity")),
    ("alma_jax.reports.report", "--helpshort", ("--workdirs", "--findings")),
])
def test_the_help_flags_print_their_help_and_exit_with_code_0(module, flag, texts):
  proc = subprocess.run([sys.executable, "-m", module, flag], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert all(text in proc.stdout for text in texts), proc.stdout[:2000]


def test_a_help_flag_s_exit_becomes_0_and_other_exits_stay():
  from alma_jax import errors  # pylint: disable=g-import-not-at-top

  def exits(code):
    def parse(argv):
      raise SystemExit(code)
    return parse

  for flag in ("--help", "--helpshort", "--helpfull", "--helpxml", "-?", "-helpfull"):
    with pytest.raises(SystemExit) as info:
      errors.help_succeeds(exits(1), ["prog", "--x=1", flag])
    assert info.value.code == 0
  for code, argv in [(1, ["prog", "--x=1"]), (2, ["prog", "--helpfull"]),
                     (1, ["prog", "--helpfullness"]), (1, ["prog", "helpfull"])]:
    with pytest.raises(SystemExit) as info:
      errors.help_succeeds(exits(code), argv)
    assert info.value.code == code
  assert errors.help_succeeds(lambda argv: argv[1:], ["prog", "--helpshort"]) == ["--helpshort"]
  # The same flags let `alma-jax` skip its check for a --config before absl prints the help.
  assert errors.asks_help(["prog", "-helpxml"]) and errors.asks_help(["prog", "--helpfull=true"])
  assert not any(errors.asks_help(["prog", *a]) for a in (
      ["--workdir=--help"], ["helpfull"], ["--helpfullness"], []))


@pytest.mark.parametrize("argv, said", [
    (["--workdir=/tmp/never"], "missing"), (["--print_config"], "missing"),
    (["--config=", "--workdir=/tmp/never"], "empty"),
    (["--config=mnist_sm:smoke", "--config="], "empty"),  # the last one counts, as for absl
    (["--config", "", "--print_config"], "empty")])
def test_a_missing_or_empty_config_is_said_before_anything_starts(argv, said, capsys):
  from alma_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as info:
    main_lib._parse_flags(["alma-jax", *argv])  # pylint: disable=protected-access
  assert info.value.code == 2
  assert capsys.readouterr().err == (
      f"alma_jax: error: --config is {said}: give a config name or file, e.g. "
      "--config=mnist_sm:quick (alma-jax --help lists them)\n")


def test_a_backend_jax_cannot_start_is_one_line_and_keeps_the_workdir(tmp_path):
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "notes.txt").write_text("kept")
  proc = run_main("configs/mnist_sm.py:smoke", str(wd), "--overwrite",
                  env=dict(os.environ, JAX_PLATFORMS="no_such_platform"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("alma_jax: error: JAX cannot start the backend of "
                         "JAX_PLATFORMS='no_such_platform': ") and "no_such_platform" in last[70:]
  assert last.endswith("install JAX's build for it (README, Setup) or unset JAX_PLATFORMS to "
                       "run on the devices that are here")
  assert "Traceback" not in proc.stderr and os.listdir(wd) == ["notes.txt"]


def test_print_config_resolves_validates_and_prints_without_running(tmp_path):
  proc = _cli("--config=mnist_sm:quick", "--config.model.width=4", "--print_config",
              cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-2000:]
  config = json.loads(proc.stdout)
  assert config["model"]["width"] == 4 and config["stream"]["num_megabatches"] == 500
  assert config == config_resolve.resolved_dict("configs/mnist_sm.py:quick",
                                                ["--config.model.width=4"])
  assert not os.listdir(tmp_path)  # nothing written
  bad = _cli("--config=mnist_sm:quick", "--config.model.width=-4", "--print_config")
  assert bad.returncode == 2 and bad.stdout == ""
  assert bad.stderr.strip().splitlines()[-1] == ("alma_jax: error: config.model.width=-4 must "
                                                 "be >= 1")
  missing = _cli("--config=mnist_sm:quick")
  assert missing.returncode == 2
  assert "--workdir must have a value (or give --print_config)" in missing.stderr


def test_a_flag_file_s_config_name_resolves_as_a_typed_one(tmp_path):
  # A config name and its overrides in a --flagfile (absl's) are read as if typed, from any
  # folder; a flag file that cannot be read is one line and exit code 2.
  flag_file = tmp_path / "run.flags"
  flag_file.write_text("--config=mnist_sm:quick\n--config.model.width=4\n")
  proc = _cli(f"--flagfile={flag_file}", "--print_config", cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout) == config_resolve.resolved_dict("configs/mnist_sm.py:quick",
                                                                 ["--config.model.width=4"])
  nested = tmp_path / "outer.flags"  # names a flag file that is not there
  nested.write_text(f"--flagfile={tmp_path / 'missing.flags'}\n")
  bad = _cli(f"--flagfile={nested}", "--print_config")
  assert bad.returncode == 2 and bad.stdout == "", bad.stderr[-2000:]
  assert bad.stderr.strip().splitlines() == [
      f"alma_jax: error: --flagfile: Unable to open flagfile: [Errno 2] No such file or "
      f"directory: '{tmp_path / 'missing.flags'}'"]


@requires_mnist
def test_the_python_api_prints_progress_and_speaks_of_its_own_arguments(tmp_path):
  # A fresh interpreter, as a notebook or script starts: Python's logging shows WARNING only.
  script = (
      "import sys, alma_jax\n"
      "c = alma_jax.load_config('mnist_sm:smoke')\n"
      "c.mesh.num_devices = 1\n"
      "alma_jax.run(c, sys.argv[1])\n"
      "print('--- quiet', file=sys.stderr, flush=True)\n"
      "alma_jax.run(c, sys.argv[1], log=False)\n"
      "c.model.width = 16\n"
      "try:\n"
      "  alma_jax.run(c, sys.argv[1], log=False)\n"
      "except ValueError as e:\n"
      "  print(type(e).__name__, e)\n")
  proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "wd")], cwd=str(tmp_path),
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  loud, quiet = proc.stderr.split("--- quiet\n")
  assert "t=4/4 (100%)" in loud and "done: 1 seed(s)" in loud
  assert "t=4/4" not in quiet and "done:" not in quiet
  assert proc.stdout.startswith("ConfigError "), proc.stdout
  assert "pass overwrite=True to discard" in proc.stdout and "--overwrite" not in proc.stdout


def timings_and_records(config, workdir, *flags):
  """(summary's timings, log records without their wall-clock field) of a finished run."""
  proc = run_main(config, workdir, *flags)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    timings = json.load(f)["timings"]
  with open(os.path.join(workdir, "log.jsonl")) as f:
    return timings, [helpers.strip_wall_times(json.loads(l)) for l in f]


@requires_mnist
def test_a_second_identical_run_loads_every_program_from_the_persistent_cache(tmp_path):
  # gMoE: the growth path's eager operations and the programs of each slot size too.
  cache = tmp_path / "xla"
  timings, records = zip(*[timings_and_records("configs/mnist_gmoe.py:smoke", tmp_path / name,
                                               f"--compilation_cache_dir={cache}")
                           for name in ("first", "second")])
  first, second = timings
  # The first run compiled afresh and kept its programs whole; the second loaded them without
  # tracing (`alma_jax.runtime.executables`), every step program among them, and they computed
  # the same records.
  assert first["kept_programs_loaded"] == 0
  assert second["kept_programs_loaded"] >= second["step_programs"] > 0, second
  assert records[0] == records[1]
  assert os.listdir(cache / "alma_jax_programs" / "programs")
  assert first["compile_cache_requests"] > 0
  # The growth edits are one program per slot structure and the stage's bookkeeping one per
  # tree of shapes, and the keys are made on the host: 22 XLA programs with jax 0.10.2 (138
  # when they ran as eager operations, one program per operation and leaf shape); a few more
  # allowed for another jax's set-up.
  assert first["xla_programs"] <= 28, first
  assert second["xla_programs"] == first["xla_programs"]
  assert second["compile_cache_hits"] == second["compile_cache_requests"] == (
      first["compile_cache_requests"]), second


@requires_cifar10
def test_a_run_with_the_native_convolutions_is_repeatable_and_loads_its_kept_programs(
    tmp_path):
  # The kept programs call the native kernels by name: the second run registers them before
  # it loads them (conv.resolve_impl) and computes the same records.
  cache = f"--compilation_cache_dir={tmp_path / 'xla'}"
  timings, records = zip(*[timings_and_records("configs/cifar_sm.py:smoke", tmp_path / name,
                                               cache, "--config.model.conv_impl=native")
                           for name in ("first", "second")])
  assert timings[0]["kept_programs_loaded"] == 0
  assert timings[1]["kept_programs_loaded"] >= timings[1]["step_programs"] > 0, timings[1]
  assert records[0] == records[1]


@requires_mnist
def test_the_next_run_of_a_sweep_loads_the_kept_programs_and_computes_its_own_records(tmp_path):
  # The seed, the waiting time and replay reach the programs as values only (keys, the data's
  # order, which examples a stage holds), so a sweep's next run over them loads the programs
  # the first kept, and computes what a run with caches of its own does. On the whole
  # training split: a `data.train_subset` is drawn by seed, and other data are another
  # context.
  config, shared = "configs/mnist_sm.py:smoke", f"--compilation_cache_dir={tmp_path / 'xla'}"
  whole = "--config.data.train_subset=0"
  other = ("--config.seed=1", "--config.stream.wait=2", "--config.stream.replay=0.5")
  timings_and_records(config, tmp_path / "first", shared, whole)
  following, records = timings_and_records(config, tmp_path / "next", shared, whole, *other)
  alone, alone_records = timings_and_records(config, tmp_path / "alone", whole, *other,
                                             f"--compilation_cache_dir={tmp_path / 'own'}")
  assert following["kept_programs_loaded"] >= following["step_programs"] > 0, following
  assert alone["kept_programs_loaded"] == 0, alone
  assert records == alone_records
