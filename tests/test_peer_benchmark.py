"""Tests of the side-by-side benchmark's parsing and table (benchmarks/peer.py), on canned runs."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def peer():
  spec = importlib.util.spec_from_file_location("peer", os.path.join(ROOT, "benchmarks",
                                                                     "peer.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


LSCPU = """Architecture:                            x86_64
CPU(s):                                  2
Model name:                              Intel(R) Xeon(R) Processor
Flags:                                   fpu vme de: not a field
"""


def _theirs(wall, acc, busy=0.02, **extra):
  return dict(protocol="P3", wall_s=wall, final_test_acc=acc, busy_before=busy, **extra)


def _ours(wall, error, busy=0.02):
  return {"wall_s": wall, "busy_before": busy,
          "summary": {"final_error": error, "timings": {"train_s": wall / 2, "eval_s": 1.0,
                                                        "compile_cache_hits": 3}}}


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

processor\t: 1
"""


def test_cpu_model_and_peer_lines_are_parsed(peer):
  assert peer.cpu_model(LSCPU) == "Intel(R) Xeon(R) Processor, 2 CPUs"
  assert peer.cpu_model("") == "unknown CPU"
  # Hosts of one model name are told apart by family, model and instruction sets.
  assert peer.cpu_model(LSCPU.replace("Intel(R) Xeon(R) Processor", "AMD EPYC"), CPUINFO) == (
      "AMD EPYC (family 26, model 2, stepping 1; avx2 avx512f avx512_bf16), 2 CPUs")
  assert peer.this_cpu().endswith(" CPUs")
  stdout = "\n".join(["[run_peer] P3 run 1/1", json.dumps(_theirs(10.9, 0.969)), "{not json",
                      json.dumps(_theirs(11.3, 0.967))])
  assert [r["wall_s"] for r in peer.parse_peer_lines(stdout)] == [10.9, 11.3]


def test_the_row_takes_medians_and_leaves_failed_peer_runs_out(peer):
  ours = [_ours(6.0, 0.033), _ours(6.6, 0.031), _ours(6.3, 0.032)]
  theirs = [_theirs(10.9, 0.969), _theirs(12.1, 0.967), _theirs(11.5, 0.968),
            _theirs(3.0, None, error="rc=1")]
  r = peer.row("P3", ours, theirs)
  assert r["ratio"] == pytest.approx(11.5 / 6.3)  # median over median
  assert r["peer_failures"] == 1 and r["theirs_wall_s"] == [10.9, 12.1, 11.5]
  assert r["ours_final_acc"] == pytest.approx([0.967, 0.969, 0.968])
  text = peer.table([r], "Intel(R) Xeon(R) Processor, 2 CPUs", (0.1, 0.2, 0.3))
  lines = text.splitlines()
  assert lines[0] == ("# alma_jax vs the released code on Intel(R) Xeon(R) Processor, 2 CPUs; "
                      "load average before: 0.10, 0.20, 0.30")
  assert not any("WARNING" in l for l in lines)
  assert lines[-1] == ("| P3 | 6.3 (6.0-6.6) | 11.5 (10.9-12.1) (1 failed) | 1.83x | "
                       "0.968 / 0.968 | eval 1.0, train 3.1 |")


def test_a_busy_machine_is_warned_about(peer):
  r = peer.row("P1", [_ours(70.0, 0.55, busy=0.6)], [_theirs(140.0, 0.40)])
  assert r["ratio"] == pytest.approx(2.0)
  text = peer.table([r], "cpu", (0.2, 0.2, 0.2))
  assert "WARNING: other work kept more than 15% of the CPUs busy just before a run of P1" in text
  # The load average alone (which still counts the benchmark's previous run) warns of nothing.
  assert "WARNING" not in peer.table([peer.row("P1", [_ours(1.0, 0.5)], [_theirs(1.0, 0.5)])],
                                     "cpu", (3.0, 1.0, 1.0))
  assert "WARNING" in peer.table([peer.row("P1", [_ours(1.0, 0.5)],
                                           [_theirs(1.0, 0.5, busy=0.5)])], "cpu", (0.0,) * 3)


def test_busy_share_is_the_busy_fraction_of_the_jiffies_between_two_reads(peer, monkeypatch):
  # Scripted /proc/stat readings: the share is decided by the counters, not by how busy this
  # machine happens to be while the test runs.
  reads = iter([(1_000, 10_000), (1_150, 10_200)])  # (busy, total) jiffies, 0.75 busy in between
  monkeypatch.setattr(peer, "_cpu_times", lambda: next(reads))
  monkeypatch.setattr(peer.time, "sleep", lambda s: None)
  assert peer.busy_share(1.0) == 0.75
  monkeypatch.setattr(peer, "_cpu_times", lambda: (5, 5))  # no jiffy passed: no division by 0
  assert peer.busy_share(1.0) == 0.0

  def unreadable():
    raise OSError("no /proc/stat")

  monkeypatch.setattr(peer, "_cpu_times", unreadable)
  assert peer.busy_share(1.0) == 0.0


def test_cpu_times_reads_counters_that_only_grow(peer):
  busy0, total0 = peer._cpu_times()
  sum(range(200_000))  # some work of this process between the reads
  busy1, total1 = peer._cpu_times()
  assert 0 <= busy0 <= total0 and 0 <= busy1 <= total1
  assert busy1 >= busy0 and total1 >= total0 and total0 > 0


def test_no_successful_peer_run_gives_no_ratio(peer):
  r = peer.row("P4", [_ours(18.0, 0.03)], [_theirs(1.0, None, error="rc=1")])
  assert r["ratio"] is None
  assert "| P4 | 18.0 (18.0-18.0) | - (1 failed) | - | 0.970 / - |" in peer.table([r], "cpu", (0.0,))


def test_bad_arguments_are_rejected(peer, capsys):
  with pytest.raises(SystemExit):
    peer.main(["--only=P9"])
  assert "--only: unknown protocols ['P9']; valid: ['P1', 'P2', 'P3', 'P4']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    peer.main(["--only=P3", "--peer-script=/nonexistent/run_peer.sh"])
  assert "--peer-script=/nonexistent/run_peer.sh does not exist" in capsys.readouterr().err
