"""Tests of the report (alma_jax/reports/report.py) and its figures (alma_jax/reports/plots.py)."""

import csv
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from alma_jax import methods
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.data import augment
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as wd
from alma_jax.reports import gating_plot
from alma_jax.reports import plot_style
from alma_jax.reports import plots
from alma_jax.reports import report
from alma_jax.stream import run
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist

ROOT = helpers.ROOT


def _config(method="sm", width=8, wait=1, replay=0.0, seed=0, num_seeds=1, dataset="mnist"):
  c = config_lib.base_config(dataset, method)
  c.model.width, c.stream.wait, c.stream.replay = width, wait, replay
  c.seed, c.num_seeds, c.stream.num_megabatches = seed, num_seeds, 4
  return wd.config_dict(c)


def _records(errors, params=100, macs=1e12, extra=None):
  out = []
  for t, e in enumerate(errors):
    r = {"t": t, "test_error": e, "num_params": params, "train_flops": 3 * macs * (t > 0),
         "train_flops_forward": macs * (t > 0), "train_macs": macs * (t > 0), "growth_flops": 0.0,
         "inference_flops_per_example": 10.0, "trained": t > 0, "wall_s": 0.1}
    r.update({k: v[t] for k, v in (extra or {}).items()})
    out.append(r)
  return out


def _summary(records):
  cer = sum(r["test_error"] for r in records)
  return {"cer": cer, "cer_percent": 100 * cer, "mean_error": cer / len(records),
          "mem": sum(r["num_params"] for r in records),
          "comp": sum(r["train_flops"] for r in records),
          "comp_paper": sum(r["train_macs"] for r in records), "comp_forward": 0.0,
          "comp_growth": 0.0, "final_error": records[-1]["test_error"], "num_stages": 4,
          "wall_s": 1.0}


def _write(path, config, records, finished=True, summary_extra=None):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, wd.CONFIG_FILE), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, wd.LOG_FILE), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  if finished:
    with open(os.path.join(path, wd.SUMMARY_FILE), "w") as f:
      json.dump(dict(_summary(records), **(summary_extra or {})), f)
  return str(path)


@pytest.fixture(name="runs")
def _runs(tmp_path):
  """SM at widths 8 and 16 (two seeds of width 8 as separate runs), Ens with a 2-seed
  `num_seeds` run, and SM width 8 with replay."""
  dirs = [
      _write(tmp_path / "sm8_s0", _config(seed=0), _records([0.9, 0.5, 0.4, 0.3, 0.2])),
      _write(tmp_path / "sm8_s1", _config(seed=1), _records([0.9, 0.7, 0.6, 0.5, 0.4],
                                                            macs=3e12)),
      _write(tmp_path / "sm16", _config(width=16), _records([0.9, 0.3, 0.2, 0.1, 0.1], 400, 4e12)),
      _write(tmp_path / "sm8_replay", _config(replay=1.0), _records([0.9, 0.4, 0.3, 0.2, 0.2],
                                                                    macs=5e12)),
  ]
  ens = tmp_path / "ens"
  _write(ens, _config("ens", num_seeds=2), [], finished=False)
  _write(ens / "seed_0", _config("ens", seed=0), _records([0.8, 0.4, 0.2, 0.2, 0.2], 500, 5e12))
  _write(ens / "seed_1", _config("ens", seed=1), _records([0.8, 0.2, 0.2, 0.2, 0.0], 500, 5e12))
  return dirs + [str(ens)]


def test_seeds_are_grouped_and_their_mean_and_std_computed(runs):
  groups = report.load_groups(runs)
  by = {(g.get("method.name"), g.get("model.width"), g.get("stream.replay")): g for g in groups}
  assert len(groups) == 4
  sm8 = by[("sm", 8, 0.0)]
  assert sm8.seeds == [0, 1]
  mean, std = sm8.stat("cer_percent")
  np.testing.assert_allclose([mean, std], [np.mean([230, 310]), np.std([230, 310], ddof=1)])
  ens = by[("ens", 8, 0.0)]
  assert ens.seeds == [0, 1]  # the seed_<k> folders of a num_seeds run
  t, m, s = ens.curve()
  np.testing.assert_allclose(m, [0.8, 0.3, 0.2, 0.2, 0.1])
  np.testing.assert_allclose(s, np.sqrt(2) * np.array([0.0, 0.1, 0.0, 0.0, 0.1]))  # ddof=1
  np.testing.assert_array_equal(t, np.arange(5))


def test_a_seed_without_records_yet_leaves_the_curve_of_the_others(tmp_path):
  # A sweep in progress: seed 0 has started (an empty log), seed 1 has five records.
  ens = tmp_path / "ens"
  _write(ens, _config("ens", num_seeds=2), [], finished=False)
  _write(ens / "seed_0", _config("ens", seed=0), [], finished=False)
  _write(ens / "seed_1", _config("ens", seed=1), _records([0.8, 0.4, 0.2, 0.2, 0.2]))
  (group,) = report.load_groups([str(ens)])
  t, m, s = group.curve()
  np.testing.assert_array_equal(t, np.arange(5))
  np.testing.assert_allclose(m, [0.8, 0.4, 0.2, 0.2, 0.2])
  assert "error_mnist" in report.write_report([str(ens)], str(tmp_path / "out"), gating=False)


def test_a_spread_is_shown_over_two_values_or_more_not_over_two_seeds(tmp_path):
  # Two finished seeds, one of which has no final error (an older summary, a part without
  # the column): one value, no spread.
  a = _write(tmp_path / "s0", _config(seed=0), _records([0.9, 0.5, 0.4, 0.3, 0.2]))
  b = _write(tmp_path / "s1", _config(seed=1), _records([0.9, 0.7, 0.6, 0.5, 0.4]))
  summary = io_utils.read_json(os.path.join(b, wd.SUMMARY_FILE))
  del summary["final_error"]
  io_utils.write_json_atomic(os.path.join(b, wd.SUMMARY_FILE), summary)
  (group,) = report.load_groups([a, b])
  assert report._cell(group, "final_error", "{:.4f}") == "0.2000"
  assert report._cell(group, "cer_percent", "{:.2f}") == "270.00 ± 56.57"


_HEAVY = ("jax", "flax", "optax", "orbax", "tensorflow")
_REPORT_IMPORTS = """
import runpy, sys
sys.argv = ["report"] + sys.argv[1:]
try:
  runpy.run_module("alma_jax.reports.report", run_name="__main__")
finally:
  print(sorted(m for m in {heavy!r} if m in sys.modules))
"""


def test_a_report_without_gating_figures_imports_no_jax(runs, tmp_path):
  # A report reads files and draws them: it starts without JAX, its model and checkpoint
  # libraries or TensorFlow, which only the gating figures need.
  proc = subprocess.run(
      [sys.executable, "-c", _REPORT_IMPORTS.format(heavy=_HEAVY), "--nogating",
       f"--workdirs={','.join(runs)}", f"--out={tmp_path / 'out'}"],
      cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / "out" / "report.md").exists()
  assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_report_writes_figures_whose_data_are_the_runs(runs, tmp_path):
  out = tmp_path / "out"
  figs = report.write_report(runs, str(out))
  for name in ("tradeoffs_mnist", "error_mnist", "replay_mnist"):
    assert name in figs
    for ext in ("png", "pdf"):
      assert (out / f"{name}.{ext}").stat().st_size > 1000
  comp = {s["label"]: s for s in figs["tradeoffs_mnist"]["comp"]}
  sm = comp["sm wait=1 replay=0"]
  assert sm["widths"] == [8, 16]
  np.testing.assert_allclose(sm["x"], [8.0, 16.0])  # TFLOPs: mean of 4 and 12; 16
  np.testing.assert_allclose(sm["xerr"], [4.0 * np.sqrt(2), 0.0])  # sample std of 4, 12
  np.testing.assert_allclose(sm["y"], [270.0, 160.0])
  np.testing.assert_allclose(sm["yerr"], [40.0 * np.sqrt(2), 0.0])
  assert sm["marker"] == "o" and sm["color"] != comp["ens wait=1 replay=0"]["color"]
  mem = {s["label"]: s for s in figs["tradeoffs_mnist"]["mem"]}
  np.testing.assert_allclose(mem["sm wait=1 replay=0"]["x"], [500, 2000])
  (rep,) = figs["replay_mnist"]["replay"]
  assert rep["replay"] == [0.0, 1.0]
  np.testing.assert_allclose(rep["x"], [8.0, 20.0])
  np.testing.assert_allclose(rep["y"], [270.0, 200.0])
  panels = figs["error_mnist"]
  assert set(panels) == {"width=8", "width=16"}
  ens = {s["label"]: s for s in panels["width=8"]}["ens wait=1 replay=0"]
  np.testing.assert_allclose(ens["y"], [80, 30, 20, 20, 10])
  text = (out / "report.md").read_text()
  assert "| mnist | sm | 8 | 1 | 0 | 2 | 270.00 ± 56.57 |" in text
  assert "![tradeoffs_mnist](tradeoffs_mnist.png)" in text
  assert "lm_mnist" not in figs


def test_records_with_a_waiting_policy_s_decisions_are_read(tmp_path):
  decided = _records([0.9, 0.5, 0.4], extra={"wait_decision": ["", "trained", "waited"],
                                            "wait_reason": ["", "scheduled", "not due"]})
  (run,) = report.load_runs(_write(tmp_path / "run", _config(), decided))
  assert [r["wait_decision"] for r in run.records] == ["", "trained", "waited"]
  figs = report.write_report([str(tmp_path / "run")], str(tmp_path / "out"))
  np.testing.assert_allclose(figs["error_mnist"]["width=8"][0]["y"], [90, 50, 40])


def test_the_plasticity_figure_compares_warm_starts_at_their_wait(tmp_path):
  def config(width, wait, warm_start="finetune", seed=0):
    c = _config(width=width, wait=wait, seed=seed)
    c["stream"]["warm_start"], c["log"]["plasticity"] = warm_start, True
    return c

  def plastic(dormant):
    return _records([0.9, 0.5, 0.4, 0.3, 0.2], extra={
        "dormant_fraction": dormant, "feature_rank": [4.0, 3.0, 3.0, 2.0, 2.0],
        "init_distance": [0.0, 1.0, 2.0, 3.0, 4.0]})

  dirs = [_write(tmp_path / f"ft{w}_{h}_{s}", config(h, w, seed=s),
                 plastic([0.0, 0.1, 0.2, 0.3, 0.1 * s]))
          for w in (1, 2) for h in (4, 8) for s in (0, 1)]
  dirs.append(_write(tmp_path / "redo4", config(4, 1, "redo"), plastic([0.0] * 5)))
  dirs.append(_write(tmp_path / "plain", _config(width=4, wait=1), _records([0.9] * 5)))
  figs = report.write_report(dirs, str(tmp_path / "out"))
  panels = figs["plasticity_mnist"]
  assert list(panels) == [f"{f} width={h}" for f in ("dormant_fraction", "feature_rank",
                                                      "init_distance") for h in (4, 8)]
  # The fixed-wait runs at w = 1, the wait of the other warm start; not the w = 2 runs, nor
  # the run without diagnostics.
  by = {s["label"]: s for s in panels["dormant_fraction width=4"]}
  assert set(by) == {"finetune", "redo"}
  np.testing.assert_allclose(by["finetune"]["y"], [0, 10, 20, 30, 5])
  np.testing.assert_allclose(by["finetune"]["yerr"][-1], 100 * np.std([0.0, 0.1], ddof=1))
  np.testing.assert_allclose(by["redo"]["y"], [0] * 5)
  assert [s["label"] for s in panels["feature_rank width=8"]] == ["finetune"]
  # Each config has the colour it has in the other figures: its policy's, or its method's shade.
  errors = {s["label"]: s["color"] for s in figs["error_mnist"]["width=4"]}
  assert by["redo"]["color"] == plots.policy_color("redo") == errors[
      "sm wait=1 replay=0 plasticity=True, redo"]
  assert by["finetune"]["color"] == errors["sm wait=1 replay=0 plasticity=True"]
  assert by["finetune"]["marker"] != by["redo"]["marker"]
  assert (tmp_path / "out" / "plasticity_mnist.png").stat().st_size > 1000


def test_wait_figure_has_a_line_per_config_over_its_waits(runs, tmp_path):
  # SM width 8 at waits 1 (two seeds, above) and 2; SM width 16 has one wait: no line.
  extra = _write(tmp_path / "sm8_w2", _config(wait=2), _records([0.9, 0.9, 0.3, 0.3, 0.1]))
  figs = report.write_report(runs + [extra], str(tmp_path / "out"), gating=False)
  assert "wait_mnist" not in report.write_report(runs, str(tmp_path / "out1"), gating=False)
  (line,) = figs["wait_mnist"]["wait"]
  assert line["label"] == "sm width=8 replay=0"
  np.testing.assert_allclose(line["x"], [1.0, 2.0])
  np.testing.assert_allclose(line["y"], [270.0, 250.0])
  np.testing.assert_allclose(line["yerr"], [40.0 * np.sqrt(2), 0.0])
  assert (tmp_path / "out" / "wait_mnist.png").stat().st_size > 1000


def test_execution_fields_keep_groups_apart_but_stay_out_of_labels(runs, tmp_path):
  config = _config(width=32)
  config["train"]["eval_batch_size"] = 128  # how it is evaluated, not what is computed
  extra = _write(tmp_path / "sm32", config, _records([0.9, 0.2, 0.1, 0.1, 0.1]))
  groups = report.load_groups(runs + [extra])
  assert len(groups) == 5  # a group of its own
  fields = report.varying_fields(groups)
  assert "train.eval_batch_size" not in fields
  assert {g.label(fields) for g in groups} >= {"sm width=32 wait=1 replay=0"}
  report.write_report(runs + [extra], str(tmp_path / "out"), gating=False)
  assert "eval_batch_size" not in (tmp_path / "out" / "report.md").read_text()
  # A field that does change the computation still shows where it differs.
  config["train"]["epochs"] = 7
  other = _write(tmp_path / "sm32e", config, _records([0.9, 0.2, 0.1, 0.1, 0.1]))
  assert "train.epochs" in report.varying_fields(report.load_groups(runs + [other]))


def test_unfinished_runs_are_listed_but_not_in_the_cer_figures(tmp_path):
  done = _write(tmp_path / "a", _config(), _records([0.5] * 5))
  partial = _write(tmp_path / "b", _config(width=32), _records([0.5, 0.4]), finished=False)
  figs = report.write_report([done, partial], str(tmp_path / "out"))
  assert [s["widths"] for s in figs["tradeoffs_mnist"]["comp"]] == [[8]]
  assert [s["marker_scale"] for s in figs["tradeoffs_mnist"]["comp"]] == [[1.0]]
  assert "width=32" in figs["error_mnist"]
  assert "0 of 1 finished" in (tmp_path / "out" / "report.md").read_text()


def test_language_model_figure_is_a_trajectory_per_config(tmp_path):
  # Fig. 5: a point per mega-batch t >= 1, the perplexity averaged over 1..t against the
  # compute spent up to t; configs that differ in a field other than the method (here the
  # width, and two seeds of one) are separate lines.
  dirs = []
  for i, (method, width, seed, ppl) in enumerate([("sm", 8, 0, 40.0), ("sm", 8, 1, 60.0),
                                                  ("sm", 16, 0, 30.0), ("gmoe", 8, 0, 35.0)]):
    extra = {"test_perplexity": [1000.0, ppl + 10, ppl, ppl, ppl - 10],
             "num_experts": [2, 2, 3, 4, 5] if method == "gmoe" else [4] * 5}
    dirs.append(_write(tmp_path / f"r{i}", _config(method, width, seed=seed),
                       _records([0.5] * 5, params=100 * width, macs=2e12, extra=extra)))
  figs = report.write_report(dirs, str(tmp_path / "out"), gating=False)
  lm = figs["lm_mnist"]
  assert set(lm) == {"comp", "params", "experts"}
  # Labelled by the fields that tell the configs apart (not the wait, the same for all).
  comp = {s["label"]: s for s in lm["comp"]}
  assert set(comp) == {"sm width=8", "sm width=16", "gmoe width=8"}
  sm8 = comp["sm width=8"]  # two seeds: 40 and 60 (+10, 0, 0, -10 over t = 1..4)
  np.testing.assert_allclose(sm8["x"], [2.0, 4.0, 6.0, 8.0])  # TFLOPs (2e12 MACs per stage)
  np.testing.assert_allclose(sm8["y"], [60.0, 55.0, 53.333333, 50.0])
  np.testing.assert_allclose(sm8["yerr"], [10 * np.sqrt(2)] * 4)  # ddof=1 over 40, 60
  # The last point is the summary's mean perplexity over t >= 1, as in the table.
  assert comp["sm width=16"]["y"][-1] == pytest.approx(30.0)
  gmoe = {s["label"]: s for s in lm["experts"]}["gmoe width=8"]
  np.testing.assert_allclose(gmoe["x"], [2, 3, 4, 5])
  params = {s["label"]: s for s in lm["params"]}
  np.testing.assert_allclose(params["sm width=16"]["x"], [1600] * 4)
  assert (tmp_path / "out" / "lm_mnist.pdf").exists()


def test_language_model_compute_panel_starts_where_the_learner_first_trains(tmp_path):
  # A learner that waits for the whole stream has spent no compute at t = 1..3: those points
  # have no place on the compute panel's log axis.
  records = _records([0.5] * 5, macs=2e12, extra={"test_perplexity": [900.0] * 4 + [50.0]})
  for r in records[:4]:
    r["train_macs"] = 0.0
  run_dir = _write(tmp_path / "iid", _config(wait=4), records)
  lm = report.write_report([run_dir], str(tmp_path / "out"), gating=False)["lm_mnist"]
  (comp,) = lm["comp"]
  np.testing.assert_allclose(comp["x"], [2.0])
  np.testing.assert_allclose(comp["y"], [(3 * 900.0 + 50.0) / 4])
  assert "params" not in lm  # the same parameters at every point: a panel that says nothing


def test_variants_of_one_method_have_colours_of_their_own(tmp_path):
  # gMoE with tree and flat gating at one wait: two lines that marker and fill cannot tell apart.
  dirs = []
  for tree in (True, False):
    config = _config("gmoe", 8)
    config["method"]["tree"] = tree
    dirs.append(_write(tmp_path / f"tree{tree}", config, _records([0.5] * 5)))
  dirs.append(_write(tmp_path / "sm_w1", _config(wait=1), _records([0.5] * 5)))
  dirs.append(_write(tmp_path / "sm_w2", _config(wait=2), _records([0.5] * 5)))
  comp = report.write_report(dirs, str(tmp_path / "out"), gating=False)["tradeoffs_mnist"]["comp"]
  by_label = {s["label"]: s for s in comp}
  gmoe = [s for label, s in by_label.items() if label.startswith("gmoe")]
  assert len(gmoe) == 2 and gmoe[0]["color"] != gmoe[1]["color"]
  assert gmoe[0]["marker"] == gmoe[1]["marker"]
  # The waiting time is the marker, not the colour.
  sm = [s for label, s in by_label.items() if label.startswith("sm")]
  assert len(sm) == 2 and sm[0]["color"] == sm[1]["color"] and sm[0]["marker"] != sm[1]["marker"]


def test_one_table_per_data_set_with_perplexities_where_runs_have_them(tmp_path):
  dirs = [_write(tmp_path / f"lm{i}", _config(width=8, seed=i, dataset="tiny_shakespeare"),
                 _records([0.5] * 5),
                 summary_extra={"final_perplexity": p, "mean_perplexity": 2 * p})
          for i, p in enumerate([30.0, 40.0])]
  dirs.append(_write(tmp_path / "img", _config(width=16), _records([0.5] * 5)))
  report.write_report(dirs, str(tmp_path / "out"), gating=False)
  text = (tmp_path / "out" / "report.md").read_text()
  img, lm = text.split("## mnist")[1].split("## tiny_shakespeare")
  assert "perplexity" not in img and "| mnist | sm | 16 |" in img
  assert "| final perplexity | mean perplexity |" in lm
  assert "| 35.00 ± 7.07 | 70.00 ± 14.14 |" in lm  # mean ± sample std of 30, 40 (and doubled)


def test_a_folder_that_is_not_a_run_is_named_with_what_it_lacks(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(report.ReportError, match=r"empty is not a run's workdir: it lacks "
                     r"config\.json and log\.jsonl"):
    report.load_runs(str(tmp_path / "empty"))
  with pytest.raises(report.ReportError, match="nowhere is not a directory"):
    report.load_runs(str(tmp_path / "nowhere"))
  bad = tmp_path / "bad"
  _write(bad, _config(), _records([0.5]))
  (bad / wd.SUMMARY_FILE).write_text("{not json")
  with pytest.raises(report.ReportError, match=r"bad/summary\.json cannot be read"):
    report.load_runs(str(bad))


def test_command_line_error_names_the_path(tmp_path):
  (tmp_path / "x").mkdir()
  proc = subprocess.run([sys.executable, "-m", "alma_jax.reports.report", f"--workdirs={tmp_path / 'x'}",
                         f"--out={tmp_path / 'o'}"], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), check=False)
  assert proc.returncode == 2
  assert f"report: error: --workdirs: {tmp_path / 'x'} is not a run's workdir" in proc.stderr
  # A flag the report does not have (a sweep's --root) is one line too, with its flags.
  proc = _report("--root=/tmp", f"--out={tmp_path / 'o'}")
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr == ("report: error: Unknown command line flag 'root'; the flags: "
                         "--workdirs, --results, --out, --gating, --findings (--helpshort says "
                         "what they take)\n")


def _report(*args):
  return subprocess.run([sys.executable, "-m", "alma_jax.reports.report", "--nogating", *args], cwd=ROOT,
                        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                        check=False)


def _policy_runs(tmp_path) -> list[str]:
  """SM width 8 under a geometric wait, trained from scratch at w=2, and fine-tuned at w=2."""
  c = _config()
  c["stream"].update(wait_policy="geometric", geometric_ratio=3.0)
  geo = _write(tmp_path / "geo", c, _records([0.9, 0.6, 0.6, 0.3, 0.3], macs=2e12))
  c = _config(wait=2)
  c["stream"]["warm_start"] = "scratch"
  scratch = _write(tmp_path / "scratch", c, _records([0.9, 0.9, 0.5, 0.5, 0.2], macs=6e12))
  w2 = _write(tmp_path / "sm8_w2", _config(wait=2), _records([0.9, 0.9, 0.3, 0.3, 0.1]))
  return [geo, scratch, w2]


def _plotted(figures: dict) -> str:
  return json.dumps(figures, sort_keys=True, default=float)


def test_the_summary_figures_are_drawn_again_from_results_csv_alone(runs, tmp_path,
                                                                     monkeypatch):
  unfinished = _write(tmp_path / "sm4", _config(width=4), _records([0.9, 0.5]), finished=False)
  first = report.write_report(runs + _policy_runs(tmp_path) + [unfinished], str(tmp_path / "out"),
                              gating=False)
  csv_path = str(tmp_path / "out" / "results.csv")
  again = report.write_report([], str(tmp_path / "again"), results=csv_path)
  # Every figure that the summaries give, with the same points, labels, colours and markers;
  # the error over t needs the records and is left out.
  assert sorted(again) == sorted(n for n in first if n.split("_")[0] in plots.SUMMARY_FIGURES)
  assert sorted(again) == ["policies_mnist", "replay_mnist", "tradeoffs_mnist", "wait_mnist"]
  assert "error_mnist" in first
  for name, series in again.items():
    assert _plotted(series) == _plotted(first[name]), name
  # The table: the same rows, the unfinished run's among them; results.csv is the input.
  table = lambda d: [l for l in (tmp_path / d / "report.md").read_text().splitlines()
                     if l.startswith("|")]
  assert table("again") == table("out") and "| 0 of 1 finished |" in "\n".join(table("again"))
  assert sorted(os.listdir(tmp_path / "again")) == sorted(
      [f"{n}.{ext}" for n in again for ext in ("png", "pdf")] + ["report.md"])
  text = (tmp_path / "again" / "report.md").read_text()
  assert f"Drawn from `{csv_path}` alone" in text
  # The same file in two parts (seed 0, and the other seeds) gives the same groups and table;
  # a run's seed in both parts is refused.
  lines = open(csv_path).read().splitlines()
  seed_at = next(i for i, c in enumerate(next(csv.reader([lines[0]]))) if c == "seed")
  first_seed = [l for l in lines[1:] if next(csv.reader([l]))[seed_at] in ("0", "")]
  (tmp_path / "part0.csv").write_text("\n".join(lines[:1] + first_seed) + "\n")
  (tmp_path / "part1.csv").write_text(
      "\n".join(lines[:1] + [l for l in lines[1:] if l not in first_seed]) + "\n")
  assert 0 < len(first_seed) < len(lines) - 1
  parts = f"{tmp_path / 'part0.csv'},{tmp_path / 'part1.csv'}"
  monkeypatch.setattr(report, "can_draw", lambda: False)  # the table alone
  report.write_report([], str(tmp_path / "parts"), results=parts)
  assert table("parts") == table("out")
  with pytest.raises(report.ReportError, match=r"^--results: seed 0 of .* is in both "):
    report.write_report([], str(tmp_path / "twice"), results=f"{csv_path},{csv_path}")
  # The command line draws the same, and refuses both sources at once or a file that is not
  # a report's results.csv.
  proc = _report(f"--results={csv_path}", f"--out={tmp_path / 'cli'}")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == f"wrote {tmp_path / 'cli' / 'report.md'} and 4 figures"
  (tmp_path / "other.csv").write_text("a,b\n1,2\n")
  lines = open(csv_path).read().splitlines()
  (tmp_path / "cut.csv").write_text("\n".join(lines[:2] + [lines[2].rsplit(",", 1)[0]]) + "\n")
  rows = list(csv.DictReader(io.StringIO(open(csv_path).read())))
  for name, line, field, cell in (("wide", 1, "model.width", "wide"),
                                  ("na", 0, "cer_percent", "n/a")):
    bad = [dict(r) for r in rows]
    bad[line][field] = cell
    with open(tmp_path / f"{name}.csv", "w", newline="") as f:
      writer = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
      writer.writeheader()
      writer.writerows(bad)
  for args, message in (
      ([f"--results={csv_path}", f"--workdirs={runs[0]}"], "give --workdirs or --results, not "
       "both"),
      ([f"--results={tmp_path / 'none.csv'}"], f"--results={tmp_path / 'none.csv'} cannot be "
       "read: No such file or directory"),
      ([f"--results={tmp_path / 'other.csv'}"], f"--results={tmp_path / 'other.csv'} is not a "
       "report's results.csv: it has no workdir, finished, method.name, data.name columns"),
      ([f"--results={tmp_path / 'cut.csv'}"], f"--results={tmp_path / 'cut.csv'}: line 3 does "
       f"not have the header's {len(lines[0].split(','))} cells"),
      ([f"--results={tmp_path / 'wide.csv'}"], f"--results={tmp_path / 'wide.csv'}: line 3: "
       "model.width='wide' is not a number"),
      ([f"--results={tmp_path / 'na.csv'}"], f"--results={tmp_path / 'na.csv'}: line 2: "
       "cer_percent='n/a' is not a number")):
    proc = _report(*args, f"--out={tmp_path / 'bad'}")
    assert proc.returncode == 2 and proc.stderr == f"report: error: {message}\n", proc.stderr
  assert not (tmp_path / "bad").exists()


def test_results_csv_cells_read_back_as_the_run_s_values():
  assert [report._csv_cell(t) for t in ("", "True", "False", "4", "0.0", "1e-05", "nan",
                                        "[1, 2]", '{"a": 1}', "mnist", "[not json")] == [
      None, True, False, 4, 0.0, 1e-05, pytest.approx(float("nan"), nan_ok=True), [1, 2],
      {"a": 1}, "mnist", "[not json"]


def test_a_run_given_twice_counts_once_with_a_warning(runs, tmp_path, caplog):
  sm8, ens = runs[0], runs[-1]
  os.symlink(sm8, tmp_path / "link")
  groups = report.load_groups([sm8, sm8, str(tmp_path / "link"), ens, os.path.join(ens, "seed_1")])
  assert sorted(len(g.runs) for g in groups) == [1, 2]  # sm8 once; ens: its two seeds
  assert f"--workdirs: {sm8} is given more than once; it counts once" in caplog.text
  assert f"{tmp_path / 'link'} (the run {sm8}) is given more than once" in caplog.text
  proc = _report(f"--workdirs={sm8},{sm8}", f"--out={tmp_path / 'out'}")
  assert proc.returncode == 0, proc.stderr
  assert "| mnist | sm | 8 | 1 | 0 | 1 |" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("out, message", [
    ("a_file", r"--out=\S*a_file exists and is not a directory"),
    ("a_file/sub", r"--out=\S*a_file/sub cannot be created: Not a directory"),
    ("", r"--out is empty"),
    (None, r"give --workdirs=DIR\[,DIR\.\.\.\] \(or directories as arguments\), or "
           r"--results=FILE \(a results\.csv that a report wrote\), and --out=DIR"),
], ids=["file", "below_a_file", "empty", "missing"])
def test_a_bad_out_is_one_line_with_exit_code_2(runs, tmp_path, out, message):
  (tmp_path / "a_file").write_text("kept")
  proc = _report(f"--workdirs={runs[0]}", *([] if out is None else [f"--out={tmp_path / out}"
                                                                     if out else "--out="]))
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr
  line = proc.stderr.rstrip("\n").splitlines()[-1]
  assert line.startswith("report: error: ") and re.search(message, line), proc.stderr
  assert (tmp_path / "a_file").read_text() == "kept"


# The cases whose error the command line also reports (one line, exit code 2): one per file;
# the others take the same path from `report.load_runs` to that line.
_CLI_CASES = ("config_list", "record_string", "summary_list")


@pytest.mark.parametrize("name, text, message", [
    (wd.CONFIG_FILE, "[1, 2]", r"config\.json is not a run's output: it holds a JSON list"),
    (wd.CONFIG_FILE, json.dumps(dict(_config(), seed="zero")),
     r"config\.json: seed='zero' is not a number"),
    (wd.LOG_FILE, '{"t": 0, "test_error": "x"}\n',
     r"log\.jsonl: record 1 \(\{\"t\": 0, \"test_error\": \"x\"\}\) is not a run's record"),
    (wd.LOG_FILE, '{"t": 0, "test_error": null}\n', r"log\.jsonl: record 1 .* is not a run's"),
    (wd.LOG_FILE, '{"t": 0, "test_error": 0.5, "num_params": [1]}\n',
     r"log\.jsonl: record 1 .* is not a run's record \(a JSON object of numbers and texts"),
    (wd.LOG_FILE, "[1]\n", r"log\.jsonl: record 1 \(\[1\]\) is not a run's record"),
    (wd.SUMMARY_FILE, "[1]", r"summary\.json is not a run's output"),
    (wd.SUMMARY_FILE, '{"cer_percent": "high"}', r"summary\.json: cer_percent='high' is not a"),
], ids=["config_list", "config_seed", "record_string", "record_null", "record_list_field",
        "record_list", "summary_list", "summary_field"])
def test_malformed_run_files_are_named(tmp_path, name, text, message, request):
  run_dir = _write(tmp_path / "run", _config(), _records([0.9, 0.5]))
  (tmp_path / "run" / name).write_text(text)
  with pytest.raises(report.ReportError, match=message):
    report.load_runs(run_dir)
  if request.node.callspec.id not in _CLI_CASES:
    return
  proc = _report(f"--workdirs={run_dir}", f"--out={tmp_path / 'out'}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.rstrip("\n").splitlines()[-1].startswith(f"report: error: {run_dir}")


def test_a_pattern_stands_for_the_runs_it_matches(runs, tmp_path):
  # As a sweep's root holds them: the runs, its logs/ and report/ folders.
  (tmp_path / "logs").mkdir()
  (tmp_path / "report").mkdir()
  assert report.expand_workdirs([str(tmp_path / "*")]) == sorted(runs)
  assert report.expand_workdirs([str(tmp_path / "sm8_s?"), "a"]) == sorted(runs[:2]) + ["a"]
  assert report.expand_workdirs([str(tmp_path / "none*")]) == [str(tmp_path / "none*")]
  for pattern in ("none*", "logs*"):  # no folder, or folders that are not runs
    with pytest.raises(report.ReportError, match=rf"{pattern}\* matches no run's workdir "
                       r"\(a folder with config\.json\)"):
      report.check_matched(report.expand_workdirs([str(tmp_path / pattern)]))
  report.check_matched(report.expand_workdirs([str(tmp_path / "*")]))  # patterns that matched
  proc = subprocess.run([sys.executable, "-m", "alma_jax.reports.report",
                         f"--workdirs={tmp_path}/*,{runs[0]}", f"--out={tmp_path / 'report'}",
                         "--nogating"], cwd=ROOT,
                        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                        check=False)
  assert proc.returncode == 0, proc.stderr
  assert "| mnist | sm | 8 | 1 | 0 | 2 |" in (tmp_path / "report" / "report.md").read_text()
  # Plain lines: no absl prefix, no library notices (JAX's "Unable to initialize backend").
  assert f"warning: --workdirs: {runs[0]} is given more than once" in proc.stderr, proc.stderr
  assert "Unable to initialize backend" not in proc.stderr, proc.stderr
  assert not re.search(r"^[IW]\d{4} ", proc.stderr, re.M), proc.stderr


def test_curves_over_t_have_ticks_at_whole_mega_batches_only():
  fig, (ax,) = plots.subplots(1, 6.0, 3.0)
  series = {"label": "a", "color": "C0", "marker": "o", "x": [0, 1, 2, 3, 4],
            "y": [90.0, 50.0, 40.0, 35.0, 30.0], "yerr": [0.0] * 5}
  plot_style.draw_curves(ax, [series], "mega-batch t", "test error (%)")
  fig.canvas.draw()
  lo, hi = ax.get_xlim()
  assert [x for x in ax.get_xticks() if lo <= x <= hi] == [0, 1, 2, 3, 4]


def test_run_error_png(tmp_path):
  path = str(tmp_path / "e.png")
  fig = plots.run_error_png(path, [("seed 0", [0, 1, 2], [0.9, 0.5, 0.3])], "t")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  (ax,) = fig.axes
  assert ax.get_ylabel() == "test error (%)" and ax.get_yscale() == "linear"
  assert ax.lines[0].get_ydata().tolist() == pytest.approx([90.0, 50.0, 30.0])
  # The steps are whole mega-batches: marked one by one, and no tick between two of them.
  fig.canvas.draw()
  assert ax.lines[0].get_marker() == "o"
  ticks = [x for x in ax.get_xticks() if ax.get_xlim()[0] <= x <= ax.get_xlim()[1]]
  assert ticks == [0, 1, 2]
  fig = plots.run_error_png(path, [("seed 0", list(range(50)), [0.5] * 50)], "t")
  assert fig.axes[0].lines[0].get_marker() in (None, "None", "")
  fig = plots.run_error_png(path, [("seed 0", [0, 1, 2], [50257.0, 700.0, 420.0])],
                            "tiny_shakespeare lm_sm preset=tiny", "test perplexity", 1.0)
  (ax,) = fig.axes
  assert ax.get_ylabel() == "test perplexity" and ax.get_yscale() == "log"
  assert ax.lines[0].get_ydata().tolist() == [50257.0, 700.0, 420.0]


# -- real runs ------------------------------------------------------------------------------------
@pytest.mark.drawing_child
@requires_mnist
def test_a_smoke_run_draws_its_errors_and_is_reported(tmp_path):
  workdir = str(tmp_path / "run")
  summary = run.run(helpers.smoke(stream__num_megabatches=2), workdir)
  with open(os.path.join(workdir, wd.ERROR_PNG), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  figs = report.write_report([workdir], str(tmp_path / "out"))
  (series,) = figs["tradeoffs_mnist"]["comp"]
  np.testing.assert_allclose(series["x"], [summary["comp_paper"] * 1e-12])
  np.testing.assert_allclose(series["y"], [summary["cer_percent"]])
  (curve,) = figs["error_mnist"]["width=8"]
  with open(os.path.join(workdir, wd.LOG_FILE)) as f:
    errors = [100 * json.loads(line)["test_error"] for line in f]
  np.testing.assert_allclose(curve["y"], errors)
  assert (tmp_path / "out" / "tradeoffs_mnist.pdf").exists()


@pytest.mark.drawing_child
@requires_mnist
def test_a_failure_to_draw_keeps_the_outputs(tmp_path, monkeypatch):
  warnings = []
  monkeypatch.setattr(sys, "executable", "/no/such/python")
  monkeypatch.setattr(run.logging, "warning", lambda msg, *a: warnings.append(msg % a))
  workdir = str(tmp_path / "run")
  run.run(helpers.smoke(stream__num_megabatches=2), workdir)
  assert os.path.exists(os.path.join(workdir, wd.SUMMARY_FILE))
  assert not os.path.exists(os.path.join(workdir, wd.ERROR_PNG))
  assert any("could not draw" in w and "FileNotFoundError" in w for w in warnings), warnings


@pytest.mark.drawing_child
@requires_mnist
def test_error_png_off_starts_no_drawing_child_and_draws_nothing(tmp_path, monkeypatch):
  launched, launch = [], plots.PlotChild._launch  # pylint: disable=protected-access
  monkeypatch.setattr(plots.PlotChild, "_launch",
                      staticmethod(lambda: launched.append(1) or launch()))
  off, on = str(tmp_path / "off"), str(tmp_path / "on")
  run.run(helpers.smoke(stream__num_megabatches=2, log__error_png=False), off)
  assert not launched and os.path.exists(os.path.join(off, wd.SUMMARY_FILE))
  assert not os.path.exists(os.path.join(off, wd.ERROR_PNG))
  run.run(helpers.smoke(stream__num_megabatches=2), on)  # the default draws it, in one child
  assert launched == [1] and os.path.exists(os.path.join(on, wd.ERROR_PNG))


def test_the_drawing_child_process_reports_its_error(tmp_path):
  spec = {"path": str(tmp_path / "missing_dir" / "e.png"), "curves": [["a", [0], [0.5]]]}
  proc = subprocess.run([sys.executable, "-m", "alma_jax.reports.plots"], input=json.dumps(spec),
                        cwd=ROOT, capture_output=True, text=True, check=False,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode != 0 and "missing_dir" in proc.stderr


def _ignores_sigint(pid: int) -> bool:
  """Whether process `pid` ignores SIGINT (its SigIgn mask in /proc; False once it is gone)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
  except OSError:
    return False
  return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)


@pytest.mark.drawing_child
def test_a_started_drawing_child_survives_a_terminal_interrupt_and_draws(tmp_path):
  child = plots.PlotChild().start()
  proc = child._proc  # pylint: disable=protected-access
  deadline = time.monotonic() + 120
  while not _ignores_sigint(proc.pid):  # until it has set itself up to ignore Ctrl-C
    assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
    time.sleep(0.01)
  os.kill(proc.pid, signal.SIGINT)  # what a Ctrl-C sends the whole process group
  path = str(tmp_path / "e.png")
  assert child.draw(path, [("seed 0", [0, 1], [0.5, 0.25])], "t") is None
  assert proc.returncode == 0  # the child started first drew it, not a replacement
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.drawing_child
def test_a_drawing_child_that_died_is_replaced_and_one_never_told_is_stopped(tmp_path):
  child = plots.PlotChild().start()
  first = child._proc  # pylint: disable=protected-access
  first.kill()
  first.wait()
  path = str(tmp_path / "e.png")
  assert child.draw(path, [("seed 0", [0], [0.5])]) is None and os.path.exists(path)
  idle = plots.PlotChild().start()
  proc = idle._proc  # pylint: disable=protected-access
  idle.close()
  assert proc.returncode is not None and idle._proc is None  # pylint: disable=protected-access
  idle.close()  # closing twice is harmless


# -- the gating tree of a gMoE run -----------------------------------------------------------------
def test_leaf_paths_and_pca():
  tree = {"gate": 0, "children": [{"gate": 1, "children": [{"expert": 0}, {"expert": 2}]},
                                  {"expert": 1}]}
  assert gating_plot.leaf_paths(tree) == {0: "LL", 2: "LR", 1: "R"}
  assert gating_plot.leaf_paths({"expert": 0}) == {0: "root"}
  flat = {"gate": 0, "children": [{"expert": 0}, {"expert": 2}, {"expert": 1}]}
  assert gating_plot.leaf_paths(flat) == {0: "softmax", 1: "softmax", 2: "softmax"}
  rng = np.random.default_rng(0)
  x = rng.normal(size=(200, 3)) * [5.0, 0.1, 1.0]
  emb = gating_plot.pca_2d(x)
  assert emb.shape == (200, 2)
  np.testing.assert_allclose(np.abs(emb[:, 0]), np.abs(x[:, 0] - x[:, 0].mean()), rtol=0.05,
                             atol=0.05)
  assert emb[:, 0].var() > emb[:, 1].var() > 10 * x[:, 1].var()


def _greedy(node, weights):
  """The leaf reached by taking the heavier subtree at every gate (leaf weights (E,))."""
  if "expert" in node:
    return node["expert"]
  mass = [sum(weights[e] for e in gating_plot.leaf_paths(k)) for k in node["children"]]
  return _greedy(node["children"][int(np.argmax(mass))], weights)


@requires_mnist
def test_gating_figure_of_a_gmoe_run(tmp_path):
  workdir = str(tmp_path / "gmoe")
  c = config_lib.apply_variant(config_lib.base_config("mnist", "gmoe"), "smoke")
  c.mesh.num_devices, c.method.grow_every = 1, 1
  run.run(c, workdir)
  figs = report.write_report([workdir], str(tmp_path / "out"))
  layers = figs["gating_gmoe"]
  assert (tmp_path / "out" / "gating_gmoe.png").exists()
  with open(os.path.join(workdir, wd.ARCH_FILE)) as f:
    experts = json.loads(f.readlines()[-1])["experts"]
  assert [len(layers[f"layer{l}"]) for l in range(len(experts))] == experts
  data = gating_plot.gating_data(workdir)
  assert data.t == 4 and data.embedding.shape == (1000, 2)
  for l, series in enumerate(layers.values()):
    assert sum(s["count"] for s in series) == 1000
    for s in series:
      np.testing.assert_allclose(s["x"], data.embedding[data.experts[l] == s["expert"], 0])
  # The experts are those of greedy descent through the gates of the restored learner.
  config = validation.validate(ml_collections.ConfigDict(
      io_utils.read_json(os.path.join(workdir, wd.CONFIG_FILE))))
  method = methods.make(config, (28, 28, 1), 10)
  learner, _ = gating_plot._restore(workdir, config, method)  # pylint: disable=protected-access
  ds, _ = tasks.for_config(config).load(config, [0])
  x = augment.prepare_batch(ds.test_x, ds.mean, ds.std, augment="none", rng=None)
  for l, w in enumerate(method.routing_weights(learner, x)):
    tree = method.gating_tree(learner, l)
    np.testing.assert_array_equal(data.experts[l], [_greedy(tree, wi) for wi in np.asarray(w)])


# -- results.csv -----------------------------------------------------------------------------------
def test_results_csv_has_a_row_per_run_and_seed_with_config_fields_and_metrics(runs, tmp_path):
  import csv  # pylint: disable=g-import-not-at-top
  partial = _write(tmp_path / "partial", _config(width=32), _records([0.5, 0.4]), finished=False)
  report.write_report(runs + [partial], str(tmp_path / "out"), gating=False)
  with open(tmp_path / "out" / "results.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 7  # sm8 (2 runs), sm16, sm8 with replay, ens (2 seeds), the partial run
  columns = list(rows[0])
  assert columns[:2] == ["workdir", "finished"]
  for field in ("method.name", "model.width", "stream.wait", "stream.replay", "seed",
                "optimizer.name", "cer", "cer_percent", "mem", "comp_paper", "final_error"):
    assert field in columns, field
  assert columns.index("seed") < columns.index("cer")  # config fields, then metrics
  by_dir = {r["workdir"]: r for r in rows}
  ens1 = by_dir[os.path.join(runs[-1], "seed_1")]
  assert (ens1["method.name"], ens1["seed"], ens1["finished"]) == ("ens", "1", "True")
  with open(os.path.join(runs[-1], "seed_1", wd.SUMMARY_FILE)) as f:
    summary = json.load(f)
  assert float(ens1["cer_percent"]) == summary["cer_percent"]
  assert float(ens1["comp_paper"]) == summary["comp_paper"]
  assert by_dir[partial]["finished"] == "False" and by_dir[partial]["cer_percent"] == ""
  assert "results.csv" in (tmp_path / "out" / "report.md").read_text()


def test_the_seeds_of_a_num_seeds_run_carry_its_speed_choices_in_results_csv(tmp_path):
  """Seeds' summaries written before they held the run's `choices` get them from the run's
  summary; its timings, which are the whole process's, stay out of the seeds' rows."""
  import csv  # pylint: disable=g-import-not-at-top
  ens = tmp_path / "ens"
  _write(ens, _config("ens", num_seeds=2), [], finished=False)
  with open(ens / wd.SUMMARY_FILE, "w") as f:
    json.dump({"cer": 1.0, "choices": {"train.step_fusion": "no_ynn", "train.steps_per_call": 1},
               "timings": {"train_s": 7.0}}, f)
  _write(ens / "seed_0", _config("ens", seed=0), _records([0.8, 0.4, 0.2, 0.2, 0.2]))
  _write(ens / "seed_1", _config("ens", seed=1), _records([0.8, 0.2, 0.2, 0.2, 0.0]),
         summary_extra={"choices": {"train.step_fusion": "same"}})  # its own: kept
  report.write_report([str(ens)], str(tmp_path / "out"), gating=False)
  with open(tmp_path / "out" / "results.csv", newline="") as f:
    rows = {r["seed"]: r for r in csv.DictReader(f)}
  assert rows["0"]["choices.train.step_fusion"] == "no_ynn"
  assert rows["0"]["choices.train.steps_per_call"] == "1"
  assert rows["1"]["choices.train.step_fusion"] == "same"
  assert "timings.train_s" not in rows["0"]


def test_results_csv_reads_into_pandas(runs, tmp_path):
  import pandas as pd  # pylint: disable=g-import-not-at-top
  report.write_report(runs, str(tmp_path / "out"), gating=False)
  frame = pd.read_csv(tmp_path / "out" / "results.csv")
  assert len(frame) == 6 and frame["model.width"].dtype.kind == "i"
  assert frame.groupby("method.name")["cer_percent"].mean().loc["ens"] == pytest.approx(
      np.mean([180.0, 140.0]))  # its two seeds


# -- the look of the figures -----------------------------------------------------------------------
def _canvas(fig):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  FigureCanvasAgg(fig)
  fig.canvas.draw()
  return fig.canvas.get_renderer()


def _method_runs(tmp_path, cer_scale=1.0):
  """SM, Ens and UMix (waits 1 and 2, SM with replay too), errors scaled by `cer_scale`."""
  dirs = []
  for method, width, wait, replay, err in [("sm", 8, 1, 0.0, 0.8), ("sm", 16, 1, 0.0, 0.7),
                                           ("sm", 8, 2, 0.0, 0.9), ("sm", 8, 2, 1.0, 0.85),
                                           ("ens", 8, 1, 0.0, 0.05), ("umix", 8, 1, 0.0, 0.04)]:
    errors = [err * (cer_scale if method == "sm" else 1.0)] * 5
    dirs.append(_write(tmp_path / f"{method}{width}w{wait}r{replay}",
                       _config(method, width, wait, replay), _records(errors, width * 100)))
  return dirs


def test_every_figure_gives_a_method_its_one_colour(tmp_path):
  figs = report.write_report(_method_runs(tmp_path), str(tmp_path / "out"), gating=False)
  assert {"tradeoffs_mnist", "error_mnist", "replay_mnist", "wait_mnist"} <= set(figs)
  for name in figs:
    assert (tmp_path / "out" / f"{name}.png").stat().st_size > 1000
  seen = {}
  for name, panels in figs.items():
    for series in panels.values():
      for s in series:
        method = s["label"].split()[0]
        assert s["color"] == plot_style.method_color(method), (name, s["label"])
        seen.setdefault(method, set()).add(s["color"])
  assert seen.keys() == {"sm", "ens", "umix"}
  assert len({c for colors in seen.values() for c in colors}) == 3  # Ens and UMix differ too
  # The map is fixed: the same in another report with other methods, and for a language model.
  assert plot_style.method_color("ens") == "#ff7f0e" and plot_style.method_color("umix") == \
      "#2ca02c"
  assert plot_style.method_color("lm_sm") == plot_style.method_color("sm")
  assert plot_style.method_color("new_method") == plot_style.method_color("new_method")
  # Markers: a wait's, hollow with replay.
  trade = {s["label"]: s for s in figs["tradeoffs_mnist"]["comp"]}
  assert trade["sm wait=1 replay=0"]["marker"] != trade["sm wait=2 replay=0"]["marker"]
  assert trade["sm wait=2 replay=1"]["filled"] is False
  assert trade["sm wait=2 replay=1"]["marker"] == trade["sm wait=2 replay=0"]["marker"]


@pytest.mark.parametrize("values, scale", [([100.0, 900.0], "linear"), ([10.0, 101.0], "log"),
                                           ([1.0, 1.1, 1.2, 1.3, 3.5], "log"),
                                           ([1.0, 2.0, 2.5, 3.0, 3.5], "linear"),
                                           ([0.0, 50.0], "linear")])
def test_an_axis_is_logarithmic_where_its_values_span_more_than_ten_times(values, scale):
  # Or more than three times with most values in the bottom fifth (a few squash the others).
  assert plot_style.axis_scale(values) == scale


@pytest.mark.parametrize("cer_scale, scale", [(1.0, "log"), (0.12, "linear")])
def test_the_cer_axis_is_logarithmic_where_the_values_span_more_than_ten_times(
    tmp_path, cer_scale, scale):
  # SM's CER is up to 22x UMix's with the errors as given, below 3x scaled by 0.12.
  figs = report.write_report(_method_runs(tmp_path, cer_scale), str(tmp_path / "out"),
                             gating=False)
  ys = [y for s in figs["tradeoffs_mnist"]["comp"] for y in s["y"]]
  assert (max(ys) / min(ys) > 10) == (scale == "log")
  fig = plots.tradeoffs_figure(figs["tradeoffs_mnist"], "mnist")
  assert [ax.get_yscale() for ax in fig.axes] == [scale, scale]
  assert [ax.get_xscale() for ax in fig.axes] == ["log", "log"]


def test_fonts_are_at_least_8_pt_and_mem_tick_labels_do_not_overlap(tmp_path):
  figs = report.write_report(_method_runs(tmp_path), str(tmp_path / "out"), gating=False)
  builders = {"tradeoffs": plots.tradeoffs_figure, "error": plots.error_figure,
              "replay": lambda d, n: plots.replay_figure(d["replay"], n),
              "wait": lambda d, n: plots.wait_figure(d["wait"], n)}
  for kind, build in builders.items():
    fig = build(figs[f"{kind}_mnist"], "mnist")
    _canvas(fig)
    texts = [t for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()
             if t.get_text()]
    texts += [t for legend in fig.legends for t in legend.get_texts()]
    assert texts and min(t.get_fontsize() for t in texts) >= 8, kind
  # Parameter counts over three decades, or within one: engineering labels, none overlapping.
  for mems in ([5e5, 2e6, 3e7, 4e8], [2.1e6, 2.4e6, 2.9e6, 3.3e6]):
    series = [{"label": "sm", "color": "#1f77b4", "marker": "o", "x": mems,
               "y": [4.0, 3.0, 2.0, 1.0]}]
    fig = plots.tradeoffs_figure({"comp": series, "mem": series}, "mnist")
    renderer = _canvas(fig)
    labels = [t for t in fig.axes[1].get_xticklabels() if t.get_text()]
    assert 2 <= len(labels) <= 6, [t.get_text() for t in labels]
    assert all(t.get_text()[-1] in "kMG" or t.get_text().isdigit() for t in labels)
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in labels]


def test_a_point_without_an_x_leaves_the_axis_logarithmic_in_any_series_order():
  # A growing run of an older summary has no comp_paper_total (nan): its points are not drawn,
  # and the others' compute axis stays logarithmic whichever series comes first.
  nan = {"label": "ff", "color": "#8c564b", "marker": "s", "x": [math.nan], "y": [90.0]}
  sm = {"label": "sm", "color": "#1f77b4", "marker": "o", "x": [1e9, 1e11, 1e12],
        "y": [100.0, 30.0, 10.0]}
  for series in ([nan, sm], [sm, nan]):
    fig = plots.tradeoffs_figure({"comp": series, "mem": series}, "mnist")
    assert fig.axes[0].get_xscale() == "log"


def test_a_log_axis_under_a_decade_has_labels_over_all_of_it():
  # CER from about 10,000 to 42,000 on a log axis (the policies figure of a grid): a label
  # above 20,000, so that no stretch of more than half the axis goes unlabelled.
  fig, (ax,) = plot_style.subplots(1)
  ax.plot([1.0, 2.0], [10_000.0, 42_000.0])
  ax.set_yscale("log")
  ax.set_ylim(9_000.0, 46_000.0)
  plot_style.tidy_log_axis(ax.yaxis, [10_000.0, 42_000.0])
  _canvas(fig)
  shown = [float(t.get_text()) for t in ax.get_yticklabels()
           if t.get_text() and 9_000.0 <= t.get_position()[1] <= 46_000.0]
  assert shown == [10_000.0, 20_000.0, 30_000.0], shown
  edges = np.log10([9_000.0, *shown, 46_000.0])
  assert np.diff(edges).max() < 0.5 * (edges[-1] - edges[0])


def test_series_that_share_an_x_are_drawn_apart_on_the_page_with_exact_data():
  same = [{"x": [1e6, 4e6], "y": [1.0, 2.0]}, {"x": [1e6], "y": [3.0]}, {"x": [9e6], "y": [1.0]}]
  shifts = plot_style.dodge(same)
  assert shifts == [-plot_style.DODGE_PT / 2, plot_style.DODGE_PT / 2, 0.0]  # alone: unmoved
  assert plot_style.dodge([{"x": [5.0], "y": [1.0]}, {"x": [5.0], "y": [2.0]}]) == [0.0, 0.0]
  # Equal x on an axis zoomed to a few percent of a decade: exact data, a shift of points.
  for xs in ([0.0083, 0.00855], [1e3, 1e9]):
    series = [{"label": f"s{i}", "color": "#1f77b4", "marker": "o", "x": list(xs),
               "y": [1.0 + i, 2.0]} for i in range(2)]
    fig, (ax,) = plot_style.subplots(1)
    plot_style.draw_points(ax, series, "Comp", "CER")
    _canvas(fig)
    centres = []
    for line in ax.get_lines():
      if len(line.get_xdata()) == 2 and list(line.get_marker() or "") != ["None"]:
        assert list(line.get_xdata()) == xs  # the data, unmoved
        centres.append(line.get_transform().transform([[xs[0], 1.0]])[0][0])
    gaps = {round(abs(a - b) * 72.0 / fig.dpi, 6) for a in centres for b in centres if a != b}
    assert gaps == {plot_style.DODGE_PT}, gaps
    lo, hi = ax.get_xlim()
    assert lo < xs[0] and hi > xs[1]


def test_a_dodged_marker_at_either_end_of_the_axis_stays_inside_it():
  # Eight series that share their smallest and largest x (as the methods of one width share
  # Mem): the outermost are shifted by 3.5 x DODGE_PT, the tradeoffs figure's worst case.
  # The markers grow along each line, as the tradeoffs figure draws them: the largest at the
  # right-hand end.
  series = [{"label": f"s{i}", "color": "#1f77b4", "marker": "o", "x": [2.7e4, 1e5, 1.2e6],
             "y": [900.0 - i, 800.0, 650.0 + i], "yerr": [5.0] * 3,
             "marker_scale": plot_style.marker_scale(3)} for i in range(8)]
  assert max(plot_style.dodge(series)) == 3.5 * plot_style.DODGE_PT
  fig = plots.tradeoffs_figure({"comp": series, "mem": series}, "cifar10")
  _canvas(fig)
  for ax in fig.axes:
    box = ax.get_window_extent()
    for line in ax.get_lines():
      radius = line.get_markersize() / 2 * fig.dpi / 72.0
      if len(line.get_xdata()) and str(line.get_marker()) not in ("None", "none", ""):
        pts = line.get_transform().transform(np.column_stack([
            np.asarray(line.get_xdata(), np.float64), np.asarray(line.get_ydata(), np.float64)]))
        assert np.all(pts[:, 0] - radius >= box.x0), (ax.get_xlabel(), pts[:, 0], box)
        assert np.all(pts[:, 0] + radius <= box.x1), (ax.get_xlabel(), pts[:, 0], box)


def test_the_markers_along_a_line_grow_from_its_smallest_model_to_its_largest(runs, tmp_path):
  assert plot_style.marker_scale(1) == [1.0]
  four = plot_style.marker_scale(4)
  assert four[0] == plot_style.MARKER_SCALES[0] and four[-1] == plot_style.MARKER_SCALES[1]
  assert all(a < b for a, b in zip(four, four[1:]))
  figs = report.write_report(runs, str(tmp_path / "out"))
  comp = {s["label"]: s for s in figs["tradeoffs_mnist"]["comp"]}
  sm = comp["sm wait=1 replay=0"]
  assert sm["widths"] == [8, 16] and sm["marker_scale"] == plot_style.marker_scale(2)
  fig = plots.tradeoffs_figure(figs["tradeoffs_mnist"], "mnist")
  _canvas(fig)
  for ax, panel in zip(fig.axes, ("comp", "mem")):
    line_of = {s["label"]: s for s in figs["tradeoffs_mnist"][panel]}["sm wait=1 replay=0"]
    points = list(zip(map(float, line_of["x"]), map(float, line_of["y"])))
    size = {}  # the drawn marker sizes at each of the SM line's points
    for line in ax.get_lines():
      if line.get_color() == sm["color"] and str(line.get_marker()) == sm["marker"]:
        for p in zip(map(float, line.get_xdata()), map(float, line.get_ydata())):
          size.setdefault(p, []).append(line.get_markersize())
    assert [size[p] for p in points] == [[plot_style.MARKER_SIZE * f]
                                         for f in plot_style.marker_scale(2)], size
  # The legend keys the sizes: a grey marker of each size, named by its width.
  key = plots.model_sizes_legend(figs["tradeoffs_mnist"]["comp"])
  assert key == [("width 8", plot_style.MARKER_SCALES[0]), ("width 16", plot_style.MARKER_SCALES[1])]
  (legend,) = fig.legends
  handles = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
  assert [handles[label].get_markersize() for label, _ in key] == [
      plot_style.MARKER_SIZE * f for _, f in key]
  # One model in the figure: one marker size, no key.
  one = [dict(s, widths=[8], marker_scale=[1.0]) for s in figs["tradeoffs_mnist"]["comp"]]
  assert plots.model_sizes_legend(one) == []


def _lm_run(tmp_path, name, iid, seed, ppl):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"), "smoke")
  c.seed, c.stream.num_megabatches, c.stream.iid = seed, 4, iid
  config = wd.config_dict(validation.complete(c))
  records = _records([0.5] * 5, params=5000, macs=2e12,
                     extra={"test_perplexity": ppl, "num_experts": [4] * 5})
  if iid:  # trained once, at t = B, on everything
    for r in records[:4]:
      r["train_macs"] = 0.0
    records[4]["train_macs"] = 8e12
  return _write(tmp_path / name, config, records)


def test_the_language_model_figure_shows_the_iid_learner_where_it_is_evaluated(tmp_path):
  dirs = [_lm_run(tmp_path, f"seq{s}", False, s, [5e4, 800.0 + s, 600.0, 500.0, 400.0])
          for s in (0, 1)]
  dirs += [_lm_run(tmp_path, f"iid{s}", True, s, [5e4, 5e4, 5e4, 5e4, 350.0 + 10 * s])
           for s in (0, 1)]
  figs = report.write_report(dirs, str(tmp_path / "out"), gating=False)
  lm = figs["lm_tiny_shakespeare"]
  # Parameters and experts are the same at every point: those panels say nothing.
  assert set(lm) == {"comp"}
  seq, iid = sorted(lm["comp"], key=lambda s: s["iid"])
  assert seq["label"] == "lm_sm" and iid["label"] == "lm_sm i.i.d. (at t=B)"
  assert all("width" not in s["label"] for s in lm["comp"])
  np.testing.assert_allclose(seq["x"], [2.0, 4.0, 6.0, 8.0])
  np.testing.assert_allclose(seq["y"][-1], np.mean([800.5, 600, 500, 400]))
  np.testing.assert_allclose(iid["x"], [8.0])
  np.testing.assert_allclose(iid["y"], [355.0])  # its perplexity at t=B, not an average
  np.testing.assert_allclose(iid["yerr"], [np.std([350.0, 360.0], ddof=1)])
  assert seq["color"] == plot_style.method_color("sm") and iid["color"] != seq["color"]
  # In the CER figures too, the i.i.d. learner is named as such, not by the wait and steps it
  # sets, and the wait and replay that all share are left out.
  trade = figs["tradeoffs_tiny_shakespeare"]["comp"]
  assert sorted(s["label"] for s in trade) == ["lm_sm", "lm_sm i.i.d."]
  assert sorted(s["label"] for s in figs["error_tiny_shakespeare"][""]) == [
      "lm_sm", "lm_sm i.i.d."]
  fig = plots.lm_figure(lm, "tiny_shakespeare")
  assert len(fig.axes) == 1 and fig.axes[0].get_yscale() == "linear"
  assert (tmp_path / "out" / "lm_tiny_shakespeare.png").exists()
  # A panel alone in its figure: the compute axis' label, wider than the axes, is broken
  # before its parenthesis and stays inside the figure.
  renderer = _canvas(fig)
  label = fig.axes[0].xaxis.label
  assert label.get_text() == plots.TFLOPS.replace(" (", "\n(")
  box = label.get_window_extent(renderer)
  assert box.x0 >= 0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


def test_an_axis_label_wider_than_its_axes_is_broken_into_lines_that_fit():
  room = plot_style.text_width_pt("TFLOPs, paper count", plot_style.LABEL_PT) + 1.0
  assert plot_style.fit_axis_label("TFLOPs", room) == "TFLOPs"  # fits: unchanged
  assert plot_style.fit_axis_label(plots.TFLOPS, room).split("\n")[0] == "TFLOPs, paper count"
  for text in (plots.TFLOPS, "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
               "first line\nsecond (with a gloss that does not fit the room at all)"):
    lines = plot_style.fit_axis_label(text, room).split("\n")
    assert " ".join(lines).replace("( ", "(").split() == text.split()  # every word, in order
    assert all(plot_style.text_width_pt(l, plot_style.LABEL_PT) <= room for l in lines), lines


def _switch_run(tmp_path, method, experts, balanced, seed, ppl, vocab=2048):
  """A tiny_shakespeare run of the tiny preset or of a wider model with a smaller vocabulary
  (`vocab`; 0: the preset's) and ten times the steps (the sizes of
  `launch/grids/lm_growth.py`)."""
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", method), "quick")
  c.seed, c.model.num_experts = seed, experts
  if balanced:
    c.data.vocab_size, c.model.dim, c.model.ffn_dim = vocab, 128, 256
    c.train.steps_per_epoch *= 10
  config = wd.config_dict(validation.complete(c))
  params = (1_000_000 if balanced else 3_000_000) + 10_000 * experts
  records = _records([0.9, 0.8, 0.7, 0.6, 0.5], params=params, macs=(8e12 if balanced else 5e12),
                     extra={"test_perplexity": [2e3] + [ppl + 10 * t for t in (3, 2, 1, 0)]})
  return _write(tmp_path / f"{method}_{experts}_{int(balanced)}_{seed}", config, records)


def test_switch_transformers_of_two_sizes_are_drawn_apart_and_labelled_by_what_differs(tmp_path):
  # Two sizes of one grid: the per-size fields (the widths and vocabulary, and the steps chosen
  # for each) name the size, in the panels' titles or along a config's line; the labels keep
  # only what sets the configs of one size apart (the method, the experts), not the wait and
  # replay that all share or a field at 0 that stands for the preset's value.
  dirs = [_switch_run(tmp_path, m, e, b, s, (40.0 if b else 400.0) - e)
          for b in (True, False) for m, e in (("lm_sm", 4), ("lm_sm", 8), ("lm_gmoe", 4))
          for s in (0, 1)]
  figs = report.write_report(dirs, str(tmp_path / "out"), gating=False)
  steps = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"),
                                   "quick").train.steps_per_epoch
  tiny = f"dim=64 ffn_dim=128 vocab_size=all steps_per_epoch={steps}"
  wide = f"dim=128 ffn_dim=256 vocab_size=2048 steps_per_epoch={10 * steps}"
  labels = {"lm_sm num_experts=4", "lm_sm num_experts=8", "lm_gmoe num_experts=4"}
  lm = figs["lm_tiny_shakespeare"]
  assert list(lm) == [f"comp: {tiny}", f"params: {tiny}", f"comp: {wide}", f"params: {wide}"]
  for panel, series in lm.items():
    assert {s["label"] for s in series} == labels, panel
    assert {s["size"] for s in series} == {panel.split(": ")[1]}
  by_size = {panel: {s["label"]: s for s in series} for panel, series in lm.items()}
  np.testing.assert_allclose(by_size[f"comp: {wide}"]["lm_sm num_experts=8"]["y"][-1],
                             np.mean([62.0, 52.0, 42.0, 32.0]))
  np.testing.assert_allclose(by_size[f"comp: {tiny}"]["lm_sm num_experts=8"]["y"][-1],
                             np.mean([422.0, 412.0, 402.0, 392.0]))
  # A config has one colour in every size's panels, and its method's shades among its configs.
  for label in labels:
    assert len({by_size[p][label]["color"] for p in lm}) == 1
  assert by_size[f"comp: {tiny}"]["lm_sm num_experts=4"]["color"] != (
      by_size[f"comp: {tiny}"]["lm_sm num_experts=8"]["color"])
  # The trade-offs: a config's points in its two sizes, the smaller model first, not joined by
  # a line: the sizes' vocabularies differ, and with them the tokens whose error is measured.
  trade = {s["label"]: s for s in figs["tradeoffs_tiny_shakespeare"]["comp"]}
  assert set(trade) == labels
  assert trade["lm_sm num_experts=4"]["widths"] == [tiny, wide]
  np.testing.assert_allclose(trade["lm_sm num_experts=4"]["x"], [20.0, 32.0])  # 4 stages
  assert all(s["joined"] is False for s in figs["tradeoffs_tiny_shakespeare"]["comp"])
  drawn = plots.tradeoffs_figure(figs["tradeoffs_tiny_shakespeare"], "tiny_shakespeare")
  assert _through_points(drawn.axes[0]) == ["None"] * len(labels)
  # The test error over t: a panel per size.
  errors = figs["error_tiny_shakespeare"]
  assert list(errors) == [tiny, wide]
  assert {s["label"] for s in errors[wide]} == labels
  fig = plots.lm_figure(lm, "tiny_shakespeare")
  # Titled by the size, on as many lines as the panel's width needs.
  assert [ax.get_title().replace("\n", " ") for ax in fig.axes] == [
      f"tiny_shakespeare {tiny}"] * 2 + [f"tiny_shakespeare {wide}"] * 2
  room = fig.get_figwidth() * 72 / 2 - plot_style.TITLE_MARGIN_PT
  assert all(plot_style.text_width_pt(line, plot_style.LABEL_PT) <= room
             for ax in fig.axes for line in ax.get_title().split("\n"))
  assert all("\n" in ax.get_title() for ax in fig.axes)  # one line would not fit
  assert fig.axes[0].get_subplotspec().rowspan != fig.axes[2].get_subplotspec().rowspan
  # One size: the panels and labels as before, without a size in their titles.
  one = report.write_report(dirs[:6], str(tmp_path / "one"), gating=False)
  assert set(one["lm_tiny_shakespeare"]) == {"comp", "params"}
  assert list(one["error_tiny_shakespeare"]) == [""]
  assert {s["label"] for s in one["tradeoffs_tiny_shakespeare"]["comp"]} == labels
  # Sizes on one vocabulary (the preset's): each config's line joins them.
  same = [_switch_run(tmp_path / "same", "lm_sm", 4, b, s, 40.0, vocab=0)
          for b in (True, False) for s in (0, 1)]
  (line,) = report.write_report(same, str(tmp_path / "same_out"),
                                gating=False)["tradeoffs_tiny_shakespeare"]["comp"]
  assert len(line["x"]) == 2 and line.get("joined", True)
  drawn = plots.tradeoffs_figure({"comp": [line], "mem": [line]}, "tiny_shakespeare")
  assert _through_points(drawn.axes[0]) == ["-"]


def _through_points(ax) -> list[str]:
  """The line styles of the lines through the points of a panel's series (not their markers,
  error bars' caps or legend handles)."""
  return [l.get_linestyle() for l in ax.get_lines()
          if l.get_marker() in ("None", "none", "") and len(l.get_xdata()) > 1]


def test_the_gating_figure_gives_every_expert_a_colour_and_readable_legends(tmp_path):
  rng = np.random.default_rng(0)
  n = 12
  data = gating_plot.GatingData(t=4, embedding=rng.normal(size=(200, 2)),
                                experts=[rng.integers(0, n, 200), rng.integers(0, 2, 200)],
                                paths=[{e: f"path{e}" for e in range(n)}, {0: "L", 1: "R"}])
  layers = gating_plot.draw(data, str(tmp_path / "gating"), "gmoe width=8")
  assert (tmp_path / "gating.png").exists() and (tmp_path / "gating.pdf").exists()
  colors = [s["color"] for s in layers["layer0"]]
  assert len(set(colors)) == n  # Tableau 20 beyond ten experts
  assert sum(s["count"] for s in layers["layer0"]) == 200


def test_the_policies_figure_sets_each_policy_against_the_frontier_of_fixed_waits(runs,
                                                                                  tmp_path):
  assert "policies_mnist" not in report.write_report(runs, str(tmp_path / "out0"),
                                                     gating=False)
  figs = report.write_report(runs + _policy_runs(tmp_path), str(tmp_path / "out"), gating=False)
  panels = figs["policies_mnist"]
  assert set(panels) == {"width=8", "width=16"}
  ens, frontier, *others = panels["width=8"]
  # Each method's fixed waits without replay, fine-tuned, in order of compute: SM's w=2
  # (4 TFLOPs) then w=1 (mean of 4 and 12); the replay run and the other policies are not on it.
  assert ens["label"] == "ens fixed waits w = 1 (finetune)"
  assert frontier["label"] == "sm fixed waits w = 2, 1 (finetune)"
  np.testing.assert_allclose(frontier["x"], [4.0, 8.0])
  np.testing.assert_allclose(frontier["y"], [250.0, 270.0])
  # Each other point is named by its policies with their settings off the defaults (no wait
  # under a waiting policy), and drawn in its policy's colour, the same in every figure.
  by = {s["label"]: s for s in others}
  assert set(by) == {"geometric ratio=3", "scratch, w=2"}, set(by)
  np.testing.assert_allclose(by["geometric ratio=3"]["x"], [8.0])
  assert by["geometric ratio=3"]["color"] == plots.policy_color("geometric")
  assert by["scratch, w=2"]["color"] == plots.policy_color("scratch")
  assert len({plots.policy_color(p) for p in ("scratch", "shrink_perturb", "redo",
                                               "continual_backprop", "l2_init", "geometric",
                                               "triggered")} | {frontier["color"]}) == 8
  assert [s["label"] for s in panels["width=16"]] == ["sm fixed waits w = 1 (finetune)"]
  assert (tmp_path / "out" / "policies_mnist.png").stat().st_size > 1000
  # The other figures name a policy the same way, with the rest of the label; the fields of
  # the policies a run does not use, and the wait under a waiting policy, are left out.
  labels = {s["label"] for s in figs["tradeoffs_mnist"]["comp"]}
  assert {"sm replay=0, geometric ratio=3", "sm wait=2 replay=0, scratch",
          "sm wait=2 replay=0", "sm wait=1 replay=0"} <= labels, labels
  assert not any("wait_policy" in l or "warm_start" in l for l in labels), labels
  # ... and colour it as the policies figure does; the paper's configs keep their method's.
  colors = {s["label"]: s["color"] for s in figs["tradeoffs_mnist"]["comp"]}
  assert colors["sm wait=2 replay=0, scratch"] == plots.policy_color("scratch")
  assert colors["sm replay=0, geometric ratio=3"] == plots.policy_color("geometric")
  assert colors["sm wait=1 replay=0"] == plot_style.method_color("sm")


def test_a_policy_s_label_does_not_repeat_its_name(tmp_path):
  # The policy's one number named after it stands as name=value; a field named with the
  # policy's word in front loses that word; others keep their names.
  c = _config()
  c["stream"]["warm_start"], c["train"]["l2_init"] = "l2_init", 0.001
  l2 = _write(tmp_path / "l2", c, _records([0.9, 0.5, 0.4, 0.3, 0.2]))
  c = _config()
  c["stream"].update(wait_policy="triggered", trigger_margin=0.15, trigger_fraction=0.1)
  trig = _write(tmp_path / "trig", c, _records([0.9, 0.6, 0.6, 0.3, 0.3]))
  plain = _write(tmp_path / "plain", _config(), _records([0.9, 0.4, 0.3, 0.2, 0.2]))
  panels = report.write_report([l2, trig, plain], str(tmp_path / "out"),
                               gating=False)["policies_mnist"]
  labels = [s["label"] for s in panels["width=8"]]
  assert labels == ["sm fixed waits w = 1 (finetune)", "l2_init=0.001, w=1",
                    "triggered margin=0.15 fraction=0.1"], labels
  for policy, field, shown in (("geometric", "geometric_w0", "w0"),
                               ("triggered", "trigger_min_wait", "min_wait"),
                               ("redo", "redo_threshold", "threshold"),
                               ("continual_backprop", "cbp_fraction", "cbp_fraction"),
                               ("shrink_perturb", "shrink", "shrink")):
    assert plots.policy_field_name(policy, field) == shown


def test_the_policies_figure_draws_a_frontier_per_setting_of_the_fields_that_differ(tmp_path):
  # gMoE with tree and with flat gating, at one wait each, beside a policy's point: two
  # frontiers of one point each, named by their gating, not one line through "w = 1, 1".
  dirs = []
  for tree, errors in ((True, [0.9, 0.5, 0.4, 0.3, 0.2]), (False, [0.9, 0.6, 0.5, 0.4, 0.3])):
    c = _config("gmoe")
    c["method"]["tree"] = tree
    dirs.append(_write(tmp_path / f"tree_{tree}", c, _records(errors)))
  c = _config("gmoe")
  c["stream"]["warm_start"] = "scratch"
  dirs.append(_write(tmp_path / "scratch", c, _records([0.9, 0.9, 0.8, 0.8, 0.7])))
  panels = report.write_report(dirs, str(tmp_path / "out"), gating=False)["policies_mnist"]
  labels = [s["label"] for s in panels["width=8"]]
  assert labels == ["gmoe tree=False fixed waits w = 1 (finetune)",
                    "gmoe tree=True fixed waits w = 1 (finetune)", "scratch, w=1"], labels
  assert [len(s["x"]) for s in panels["width=8"]] == [1, 1, 1]


def test_the_report_computes_the_findings_verdicts_from_its_results_csv(runs, tmp_path):
  import csv  # pylint: disable=g-import-not-at-top
  found = [{"id": "F3", "claim": "Ens beats SM", "comparisons": [
      {"better": {"method.name": "ens"},
       "worse": {"method.name": "sm", "model.width": 8, "stream.replay": 0.0}}]}]
  report.write_report(runs, str(tmp_path / "out"), gating=False, findings=found)
  with open(tmp_path / "out" / "results.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  groups = {r["workdir"]: r["group"] for r in rows}
  assert groups[runs[0]] == groups[runs[1]]  # sm8's two seeds: one group
  assert len(set(groups.values())) == 4 and all(len(g) == 10 for g in groups.values())
  text = (tmp_path / "out" / "report.md").read_text()
  assert "## Findings" in text and "| F3 | Ens beats SM |" in text
  # Ens: CER 180 and 140; SM H=8: 230 and 310 (in %): t = (270 - 160) / sqrt(800/2 + 3200/2).
  t = 110 / math.sqrt(800 / 2 + 3200 / 2)
  assert f"| {t:+.1f} | as the paper, not clear |" in text
  bad = [{"id": "F9", "claim": "", "comparisons": [{"better": {"method.name": "sm"},
                                                    "worse": {"method.name": "ens"}}]}]
  with pytest.raises(report.ReportError, match="F9.*matches 3 groups"):
    report.write_report(runs, str(tmp_path / "out2"), gating=False, findings=bad)


def test_compute_totals_of_a_run_written_before_the_summary_had_them():
  old = {"comp": 10.0, "comp_paper": 4.0, "comp_growth": 0.0}
  assert report.with_totals(old) == dict(old, comp_total=10.0, comp_paper_total=4.0)
  grown = report.with_totals({"comp": 10.0, "comp_paper": 4.0, "comp_growth": 5.0})
  assert grown["comp_total"] == 15.0 and math.isnan(grown["comp_paper_total"])
  new = {"comp": 10.0, "comp_paper": 4.0, "comp_growth": 5.0, "comp_total": 15.0,
         "comp_paper_total": 6.5}
  assert report.with_totals(new) == new


def test_a_copy_of_a_run_is_not_another_seed(runs, tmp_path, caplog):
  import shutil  # pylint: disable=g-import-not-at-top
  sm16, ens = runs[2], runs[-1]
  shutil.copytree(sm16, tmp_path / "sm16_copy")
  shutil.copytree(ens, tmp_path / "ens_copy")
  groups = report.load_groups([sm16, str(tmp_path / "sm16_copy"), ens, str(tmp_path / "ens_copy")])
  assert sorted(len(g.runs) for g in groups) == [1, 2]  # sm16: one seed; ens: seeds 0 and 1
  ens_group = next(g for g in groups if g.get("method.name") == "ens")
  assert ens_group.seeds == [0, 1] and ens_group.stat("cer_percent")[0] == pytest.approx(160.0)
  assert f"{tmp_path / 'sm16_copy'} holds the same config and seed (0) as {sm16}" in caplog.text
  # Another seed of the same config is another run.
  other = _write(tmp_path / "sm16_s1", _config(width=16, seed=1), _records([0.9, 0.4, 0.2, 0.2, 0.1]))
  groups = report.load_groups([sm16, str(tmp_path / "sm16_copy"), other])
  assert [len(g.runs) for g in groups] == [2]


def test_without_matplotlib_the_report_writes_its_table_and_csv_and_says_why_no_figures(
    runs, tmp_path, monkeypatch, caplog):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
  assert not report.can_draw()
  figures = report.write_report(runs, str(tmp_path / "out"), findings=[
      {"id": "F3", "claim": "Ens beats SM", "comparisons": [
          {"better": {"method.name": "ens"},
           "worse": {"method.name": "sm", "model.width": 8, "stream.replay": 0.0}}]}])
  assert figures == {}
  assert sorted(os.listdir(tmp_path / "out")) == ["report.md", "results.csv"]
  text = (tmp_path / "out" / "report.md").read_text()
  assert "pip install 'alma-jax[report]'" in text and "| F3 | Ens beats SM |" in text
  assert "| mnist | sm |" in text
  assert "needs matplotlib" in caplog.text


def test_the_wait_figure_has_a_tick_at_every_plotted_wait_and_its_legend_inside(tmp_path):
  series = [{"label": "sm width=4", "color": "#1f77b4", "marker": "o",
             "x": [1.0, 10.0, 25.0, 50.0, 250.0, 500.0], "y": [9.0, 5.0, 5.5, 6.0, 12.0, 20.0],
             "yerr": [0.1] * 6},
            {"label": "sm width=64", "color": "#1f77b4", "marker": "s",
             "x": [1.0, 10.0, 25.0, 50.0, 250.0, 500.0], "y": [3.0, 3.2, 3.5, 4.0, 9.0, 18.0],
             "yerr": [0.1] * 6}]
  fig = plots.wait_figure(series, "mnist")
  renderer = _canvas(fig)
  (ax,) = fig.axes
  labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
  assert labels == ["1", "10", "25", "50", "250", "500"]
  assert not ax.xaxis.get_minorticklocs().size
  (legend,) = fig.legends
  box, page = legend.get_window_extent(renderer), fig.bbox
  assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1


def test_a_legend_of_long_labels_stays_inside_its_figure():
  """Labels wider than a legend column are broken at spaces, and the figure grows by the lines
  added, so that no label runs off the page."""
  words = "sm wait=10 replay=0, shrink_perturb shrink=0.6 perturb=0.8 trigger_fraction=0.5"
  # One panel, two columns; two panels, two columns: broken. Two panels, one column: it fits.
  for panels, entries, broken in ((1, 4, True), (2, 6, True), (2, 2, False)):
    fig, axes = plot_style.subplots(panels, legend_entries=entries)
    height = fig.get_figheight()
    for i in range(entries):
      axes[i % panels].plot([1, 2], [i, i + 1], label=f"{words} {i}")
    plot_style.legend(fig, axes)
    fig.canvas.draw()
    (legend,) = fig.legends
    box, page = legend.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1, (panels, box, page)
    texts = [t.get_text() for t in legend.get_texts()]
    assert sorted(t.replace("\n", " ") for t in texts) == [f"{words} {i}" for i in range(entries)]
    added = max(t.count("\n") for t in texts)
    assert (added > 0) == broken and (fig.get_figheight() > height) == broken
  room = 120.0
  fitted = plot_style.fit_label(words, room)
  assert all(plot_style.text_width_pt(line) <= room for line in fitted.split("\n"))
  assert plot_style.fit_label("short", room) == "short"


def test_a_text_s_width_is_remembered_per_font_and_math_setting():
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib.textpath import TextPath  # pylint: disable=g-import-not-at-top
  text = "gmoe wait=10 $x$"
  measure = lambda: TextPath((0, 0), text, size=9.0).get_extents().width  # pylint: disable=unnecessary-lambda-assignment
  plain = plot_style.text_width_pt(text, 9.0)
  assert plain == measure() and plot_style.text_width_pt(text, 9.0) == plain  # remembered
  assert plot_style.text_width_pt(text, 12.0) > plain
  # The same text in another font, or with its dollars read as text, is measured anew.
  for params in ({"font.family": "serif"}, {"font.weight": "bold"}, {"text.parse_math": False}):
    with matplotlib.rc_context(params):
      width = plot_style.text_width_pt(text, 9.0)
      assert width == measure() and width != plain, params
  assert plot_style.text_width_pt(text, 9.0) == plain
  assert plot_style.text_width_pt("   ", 9.0) == 0.0
