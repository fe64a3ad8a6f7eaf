"""Tests of the accelerator table's results files and table (benchmarks/accelerator_table.py),
on canned results."""

import importlib.util
import json
import os
import sys
import time

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


# -- time limits -----------------------------------------------------------------------------
_CHILD = """
import signal, subprocess, sys, time
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1] + ".pid", "w").write(str(sleeper.pid))
def stop(*_):
  open(sys.argv[1], "w").write("stopped")
  sys.exit(143)
if sys.argv[2] == "handles":
  signal.signal(signal.SIGTERM, stop)
else:
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("started", file=sys.stderr, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("child", ["handles", "ignores"])
def test_a_process_past_its_time_limit_is_stopped_with_sigterm_then_killed(
    table_lib, tmp_path, monkeypatch, child):
  budget = table_lib.compile_budget
  monkeypatch.setattr(budget, "STOP_GRACE_S", 1.0)
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  marker = tmp_path / "marker"
  t0 = time.monotonic()
  rc, _, err, timed_out = budget.run_child([sys.executable, str(script), str(marker), child],
                                           None, 3.0)
  elapsed = time.monotonic() - t0
  assert timed_out and "started" in err
  # The limit, then at most the grace period before the kill (and process start-up).
  assert 3.0 <= elapsed < 3.0 + 1.0 + 5.0
  if child == "handles":  # SIGTERM: the process ended on its own terms
    assert rc == 143 and marker.read_text() == "stopped"
  else:
    assert rc == -9 and not marker.exists()
  assert not _alive(int((tmp_path / "marker.pid").read_text()))  # what it started, too
  rc, out, _, timed_out = budget.run_child([sys.executable, "-c", "print(1)"], None, 30.0)
  assert (rc, out, timed_out) == (0, "1\n", False)


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie waiting for its parent to reap it does not)."""
  for _ in range(50):  # a killed process may take a moment to be gone
    try:
      with open(f"/proc/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
      return False
    if state in ("Z", "X"):
      return False
    time.sleep(0.1)
  return True


def test_a_run_stopped_at_its_limit_is_a_row_with_what_it_had_compiled(table_lib, monkeypatch):
  budget = table_lib.compile_budget

  def stopped(cmd, env, timeout):
    del env, timeout
    out = next(a.split("=", 1)[1] for a in cmd if a.startswith("--child="))
    with open(out, "w") as f:  # what the child tallied before it was stopped
      json.dump({"seconds": {"train": 20.0, "eval": 45.0, budget.ACCOUNTING: 3.0},
                 "programs": {"train": 4, "eval": 5}, "names": {}}, f)
    return -15, "", "", True

  monkeypatch.setattr(budget, "run_child", stopped)
  row = budget.run_one(budget.RUNS["p4"], [], "/nonexistent", timeout=150.0)
  assert row["error"] == "timed out after 150 s" and row["timed_out_s"] == 150.0
  assert row["so_far"]["compile_s"] == 65.0  # the FLOP-counting traces are not compilation
  assert row["so_far"]["xla_programs"] == 9
  lines = table_lib.table({"P4": {"protocol": "P4", "cold": row, "warm": {
      "error": "not started", "not_started": True}}}, "Some GPU").splitlines()
  assert "| P4 | > 150 (compile >= 65.0, 9 programs) | - | - | - | - / - | - / - |" in lines


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _fake_runs(table_lib, monkeypatch, durations: dict):
  """run_one of alma_jax's runs taking `durations[spec]` (cold, then warm) seconds of a fake
  clock, stopped at their timeout as the real one is; returns (clock, calls)."""
  clock, calls = _Clock(), []
  budget = table_lib.compile_budget
  real = table_lib.Deadline
  monkeypatch.setattr(table_lib, "Deadline", lambda seconds: real(seconds, clock=clock))
  monkeypatch.setattr(table_lib, "device_name", lambda: "Some GPU")
  left = {spec: list(d) for spec, d in durations.items()}

  def run_one(spec, extra, cache_dir, xla_cpu_log=False, xla_pass_log=False, timeout=None):
    del extra, cache_dir, xla_cpu_log, xla_pass_log
    name = next(n for n, s in budget.RUNS.items() if s == spec)
    calls.append((name, timeout))
    took = left[name].pop(0)
    if timeout is not None and took > timeout:
      clock.now += timeout
      return {"error": f"timed out after {timeout:.0f} s", "timed_out_s": timeout,
              "so_far": {"compile_s": timeout - 1, "xla_programs": 3}}
    clock.now += took
    return _ours(took, took / 2)

  monkeypatch.setattr(budget, "run_one", run_one)
  return clock, calls


def test_a_deadline_stops_runs_and_lists_what_did_not_start(table_lib, tmp_path, monkeypatch):
  _, calls = _fake_runs(table_lib, monkeypatch,
                        {"p4": [150.0, 20.0], "p1": [60.0], "p3": [], "lm_base": []})
  out = tmp_path / "table"
  assert table_lib.main(["--only=P4,P1,P3", "--lm=lm_base", f"--out_dir={out}",
                         "--deadline_s=200"]) == 0
  # P4 cold and warm (170 s), P1 cold with 30 s left: stopped; nothing starts after it.
  assert calls == [("p4", 200.0), ("p4", 50.0), ("p1", 30.0)]
  results = table_lib.read_results(str(out))
  assert table_lib.complete(results["P4"]) and not table_lib.complete(results["P1"])
  assert results["P1"]["cold"]["timed_out_s"] == 30.0
  assert results["P1"]["warm"]["not_started"]  # its cache would have been partly cold
  assert results["not_started"] == ["P3", "lm_base"]
  text = table_lib.table(results, "Some GPU")
  assert "| P1 | > 30 (compile >= 29.0, 3 programs) | - | - | - | - / - | - / - |" in text
  assert text.splitlines()[-1] == "Not started before the deadline: P3, lm_base."


def test_a_second_command_keeps_the_complete_results_and_measures_the_rest(
    table_lib, tmp_path, monkeypatch):
  _fake_runs(table_lib, monkeypatch, {"p4": [150.0, 20.0], "p1": [60.0], "p3": []})
  first = tmp_path / "first"
  table_lib.main(["--only=P4,P1,P3", f"--out_dir={first}", "--deadline_s=200"])
  monkeypatch.undo()  # a new clock and new runs for the second command
  _, calls = _fake_runs(table_lib, monkeypatch, {"p1": [60.0, 10.0], "p3": [13.0, 8.0]})
  second = tmp_path / "second"
  assert table_lib.main(["--only=P4,P1,P3", f"--out_dir={second}", "--deadline_s=500",
                         f"--continue_from={first}"]) == 0
  assert [name for name, _ in calls] == ["p1", "p1", "p3", "p3"]  # P4 kept, not run again
  results = table_lib.read_results(str(second))
  before = table_lib.read_results(str(first))
  assert results["P4"] == before["P4"]
  assert all(table_lib.complete(results[p]) for p in ("P1", "P3", "P4"))
  assert "not_started" not in results
  # Continued with the released code, whose times those results lack: measured again.
  monkeypatch.undo()
  _, calls = _fake_runs(table_lib, monkeypatch, {"p3": [13.0, 8.0]})
  monkeypatch.setattr(table_lib, "_released", lambda *_: {"wall_s": 20.8})
  table_lib.main(["--only=P3", f"--out_dir={tmp_path / 'third'}", "--peer_cmd=peer",
                  f"--continue_from={second}"])
  assert [name for name, _ in calls] == ["p3", "p3"]
  assert table_lib.read_results(str(tmp_path / "third"))["P3"]["released"] == {"wall_s": 20.8}


def test_results_of_another_device_are_not_continued(table_lib, tmp_path, monkeypatch):
  _fake_runs(table_lib, monkeypatch, {})
  other = tmp_path / "other"
  other.mkdir()
  table_lib._save(str(other), RESULTS)  # pylint: disable=protected-access
  monkeypatch.setattr(table_lib, "device_name", lambda: "Another GPU")
  with pytest.raises(SystemExit, match="measured on 'Some GPU', not on this machine's "
                                        "'Another GPU'"):
    table_lib.main(["--only=P3", f"--out_dir={tmp_path / 'new'}",
                    f"--continue_from={other}"])
  with pytest.raises(SystemExit, match="--continue_from=.*: no such folder"):
    table_lib.main(["--only=P3", f"--out_dir={tmp_path / 'new'}",
                    f"--continue_from={tmp_path / 'missing'}"])
