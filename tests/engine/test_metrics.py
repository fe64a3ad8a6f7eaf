"""Tests of the immutable metrics log (alma_jax/engine/metrics.py)."""

import dataclasses
import math

import pytest

from alma_jax.engine.metrics import Log, Record, RECORD_KEYS


def rec(t, err, params, flops, trained=True):
  return Record(t=t, test_error=err, num_params=params, train_flops=flops,
                train_flops_forward=flops / 3, train_macs=flops / 6, growth_flops=flops / 10,
                growth_macs=flops / 40,
                inference_flops_per_example=10.0, trained=trained, wall_s=0.5)


def test_cer_mem_comp_on_hand_made_log():
  log = Log()
  log = log.append(rec(0, 0.9, 100, 0.0, trained=False))
  log = log.append(rec(1, 0.5, 100, 3e6))
  log = log.append(rec(2, 0.5, 200, 0.0, trained=False))
  log = log.append(rec(3, 0.2, 300, 6e6))
  assert log.cer == pytest.approx(2.1)
  assert log.mean_error == pytest.approx(2.1 / 4)
  assert log.mem == 700
  assert log.comp == pytest.approx(9e6)
  assert log.comp_paper == pytest.approx(1.5e6) and log.comp_growth == pytest.approx(9e5)
  assert log.final_error == pytest.approx(0.2)
  assert log.num_stages == 2
  s = log.summary()
  for k in ("cer", "mean_error", "mem", "comp", "final_error", "num_stages", "wall_s"):
    assert k in s
  assert s["cer_percent"] == pytest.approx(210.0) and s["comp_paper"] == pytest.approx(1.5e6)
  assert s["wall_s"] == pytest.approx(2.0)


def test_comp_total_adds_growth_passes_to_comp():
  records = [rec(0, 0.9, 100, 0.0, trained=False), rec(1, 0.5, 100, 4e6), rec(2, 0.4, 200, 8e6)]
  s = Log.from_records(records).summary()
  # comp: 12e6; growth: 1.2e6 FLOPs, 0.3e6 multiply-adds; comp_paper: 2e6.
  assert s["comp_growth"] == pytest.approx(1.2e6) and s["comp_growth_macs"] == pytest.approx(3e5)
  assert s["comp_total"] == pytest.approx(12e6 + 1.2e6)
  assert s["comp_paper_total"] == pytest.approx(2e6 + 3e5)
  assert s["comp_total"] == s["comp"] + s["comp_growth"]
  assert s["comp_paper_total"] == s["comp_paper"] + s["comp_growth_macs"]
  # A waiting policy's evaluations are in comp, and so in comp_total.
  trig = dataclasses.replace(records[2], extra={"trigger_flops": 5e5, "trigger_macs": 1e5})
  s = Log.from_records(records[:2] + [trig]).summary()
  assert s["comp_total"] == pytest.approx(12e6 + 5e5 + 1.2e6)
  assert s["comp_paper_total"] == pytest.approx(2e6 + 1e5 + 3e5)


def test_a_record_of_older_code_without_growth_macs_reads():
  old = {k: v for k, v in rec(2, 0.4, 10, 1e3).to_dict().items() if k != "growth_macs"}
  assert old["growth_flops"] == 100.0
  assert math.isnan(Record.from_dict(old).growth_macs)  # growth ran: its multiply-adds unknown
  no_growth = dict(old, growth_flops=0.0)
  assert Record.from_dict(no_growth).growth_macs == 0.0  # no growth pass: none to miss
  log = Log.from_records([Record.from_dict(dict(no_growth, t=t)) for t in range(2)])
  assert log.summary()["comp_paper_total"] == log.comp_paper
  s = Log.from_records([Record.from_dict(dict(no_growth, t=0)), Record.from_dict(
      dict(old, t=1))]).summary()
  assert s["comp_total"] == s["comp"] + 100.0 and math.isnan(s["comp_paper_total"])
  assert "growth_macs" not in Record.from_dict(old).extra


def test_log_is_immutable():
  log = Log()
  log2 = log.append(rec(0, 0.9, 1, 0.0))
  assert len(log) == 0 and len(log2) == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    log2.records = ()
  with pytest.raises(dataclasses.FrozenInstanceError):
    log2.records[0].test_error = 0.0


def test_records_must_arrive_in_order():
  log = Log().append(rec(0, 0.9, 1, 0.0))
  with pytest.raises(ValueError, match="in order"):
    log.append(rec(2, 0.9, 1, 0.0))


def test_record_round_trip():
  r = rec(3, 0.25, 7, 1e3)
  d = r.to_dict()
  assert tuple(d) == RECORD_KEYS
  assert Record.from_dict(d) == r
  with pytest.raises(ValueError, match="missing keys"):
    Record.from_dict({"t": 1})
