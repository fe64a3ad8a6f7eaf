"""The benchmarks that build a run's train step themselves (benchmarks/train_speed.py, which
benchmarks/torch_reference.py uses, and benchmarks/ensemble_strategy.py) build it from a
config whose open fields the rules decide."""

import importlib.util
import os
import subprocess
import sys

import jax
import numpy as np

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


def test_compile_budget_s_next_runs_run_on_the_same_cache_and_list_their_misses(
    monkeypatch, capsys):
  from benchmarks import compile_budget  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_run(spec, extra, cache_dir):
    calls.append((spec, list(extra), cache_dir))
    missed = (["jit_alma_utility_keys"] if "--config.seed=1" in extra else
              ["jit_alma_step_eval"] if "--config.stream.replay=0.5" in extra else [])
    return {"process_s": 2.0, "compile_s": 0.5, "counting_s": 0.0, "xla_programs": 3,
            "seconds": {"train": 0.5}, "programs": {"train": 1}, "phases": {},
            "hits": ["jit_alma_step_train"], "misses": missed}

  monkeypatch.setattr(compile_budget, "run_one", fake_run)
  monkeypatch.setattr(sys, "argv", [
      "compile_budget.py", "--runs=p4", "--next_seed=true",
      "--next_flags=--config.stream.wait=2 --config.stream.replay=0.5", "--", "--config.x=1"])
  compile_budget.main()
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
