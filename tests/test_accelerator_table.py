"""Tests of the accelerator table's results files and table (benchmarks/accelerator_table.py),
on canned results."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def table_lib():
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # it imports its neighbours
  try:
    spec = importlib.util.spec_from_file_location(
        "accelerator_table", os.path.join(ROOT, "benchmarks", "accelerator_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(os.path.join(ROOT, "benchmarks"))
  return module


def _ours(process_s, compile_s, programs=9, final_error=0.03):
  return {"process_s": process_s, "compile_s": compile_s, "xla_programs": programs,
          "hits": ["p"] * programs, "misses": [], "final_error": final_error,
          "seconds": {"train": compile_s / 2, "eval": compile_s / 4}}


RESULTS = {
    "device": {"name": "Some GPU"},
    "P3": {"protocol": "P3", "cold": _ours(13.0, 5.0), "warm": _ours(8.0, 1.0),
           "released": {"wall_s": 20.8, "final_test_acc": 0.97}},
    "P4": {"protocol": "P4", "cold": {"error": "killed"}, "warm": _ours(16.0, 4.0, 40),
           "released": {"error": "no result"}},
    "lm_base": _ours(38.0, 30.0),
    "interrupt": {"sigterm_at_s": 10, "exit_after_s": 2.4, "rc": 143,
                  "finished_before_signal": False},
}


def test_the_table_gives_ratios_compiles_and_failures(table_lib):
  text = table_lib.table(RESULTS, "Some GPU")
  lines = text.splitlines()
  assert lines[0] == "# alma_jax and the released code on Some GPU"
  # 20.8 / 13.0 = 1.60x from a cold cache, 20.8 / 8.0 = 2.60x from a warm one.
  assert "| P3 | 13.0 (5.0) | 8.0 (1.0) | 9 (9) | 20.8 | 1.60x / 2.60x | 0.970 / 0.970 |" in lines
  assert "| P4 | failed | 16.0 (4.0) | - | failed | - / - | - / - |" in lines
  assert "| lm_base | 38.0 | 30.0 | 15.0 | 7.5 | 9 |" in lines
  assert lines[-1] == ("SIGTERM 10 s into a cold lm_base run: exited 2.4 s later with "
                       "status 143.")


def test_the_cold_runs_passes_are_tabled_when_logged(table_lib):
  cold = dict(_ours(40.0, 30.0), programs={"eval": 5, "train": 5},
              xla_passes={"eval": {"passes_s": 20.0, "by_pass": {"priority-fusion": [18.0, 5]}}})
  results = dict(RESULTS, P4={"protocol": "P4", "cold": cold, "warm": _ours(16.0, 4.0, 40)})
  lines = table_lib.table(results, "Some GPU").splitlines()
  assert "| P4 | cold | eval | 7.50 (5) | 20.00 | priority-fusion 18.00 / 5 |" in lines
  assert not any("| P3 | cold |" in line for line in lines)  # P3's were not logged
  assert "pass by pass" not in table_lib.table(RESULTS, "Some GPU")


def test_results_are_read_from_one_file_or_from_one_file_per_result(table_lib, tmp_path):
  one = tmp_path / "one"
  one.mkdir()
  table_lib._save(str(one), RESULTS)  # pylint: disable=protected-access
  assert sorted(os.listdir(one)) == ["results.json"]
  assert table_lib.read_results(str(one)) == RESULTS
  many = tmp_path / "many"
  many.mkdir()
  for name, value in RESULTS.items():
    (many / f"{name}.json").write_text(json.dumps(value))
  assert table_lib.read_results(str(many)) == RESULTS
