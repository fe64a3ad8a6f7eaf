"""Tests of the verdicts computed from results.csv (alma_jax/reports/findings.py)."""

import csv
import io
import math
import os

import pytest

from alma_jax.reports import findings as F
from alma_jax.reports import labels
from tests import helpers


def _rows(groups):
  """results.csv rows: {label: (fields, [metric values per seed], extra metrics)}."""
  rows = []
  for label, (fields, values, *extra) in groups.items():
    for seed, v in enumerate(values):
      row = {"workdir": f"/runs/{label}/seed_{seed}", "finished": "True", "group": label,
             "seed": str(seed), "cer_percent": repr(v)}
      row.update({k: str(x) for k, x in fields.items()})
      if extra:
        row.update({k: repr(x) for k, x in extra[0].items()})
      rows.append(row)
  # Through the CSV text, as the report writes it and the command reads it.
  text = io.StringIO()
  writer = csv.DictWriter(text, sorted(set().union(*rows)), lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  return F.read_rows(text.getvalue())


def _sm(width, wait=10):
  return {"method.name": "sm", "model.width": width, "stream.wait": wait}


def test_welch_t_by_hand():
  # means 2 and 5, sample variances 1 and 1, n = 3 each: (5 - 2) / sqrt(1/3 + 1/3) = 3.674...
  assert F.welch_t([1, 2, 3], [4, 5, 6]) == pytest.approx(3 / math.sqrt(2 / 3), rel=1e-12)
  assert F.welch_t([4, 5, 6], [1, 2, 3]) == pytest.approx(-3 / math.sqrt(2 / 3), rel=1e-12)
  assert math.isnan(F.welch_t([1.0], [2.0, 3.0]))  # one seed: no spread to judge by
  assert F.welch_t([1, 1], [2, 2]) == math.inf and F.welch_t([1, 1], [1, 1]) == 0.0


def _one(values_better, values_worse, metric="cer_percent"):
  rows = _rows({"a": (_sm(4), values_better), "b": (_sm(16), values_worse)})
  spec = [{"id": "X", "claim": "c", "metric": metric,
           "comparisons": [{"better": _sm(4), "worse": _sm(16)}]}]
  return F.evaluate(rows, spec)[0]


@pytest.mark.parametrize("better, worse, expected_outcome", [
    ([1.0, 1.1, 0.9], [2.0, 2.1, 1.9], F.CLEAR_FOR),       # t = 12.2
    ([1.0, 1.5, 0.5], [1.5, 2.0, 1.0], F.FOR),             # t = 1.22
    ([1.5, 2.0, 1.0], [1.0, 1.5, 0.5], F.AGAINST),         # t = -1.22
    ([2.0, 2.1, 1.9], [1.0, 1.1, 0.9], F.CLEAR_AGAINST),   # t = -12.2
    ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], F.EQUAL),           # t = 0, no spread, no difference
    ([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], F.EQUAL),           # t = 0, equal means
])
def test_the_outcome_of_one_comparison(better, worse, expected_outcome):
  found = _one(better, worse)
  (c,) = found.comparisons
  assert c.outcome == expected_outcome
  assert c.better.mean == pytest.approx(sum(better) / 3) and c.better.n == 3
  assert c.t == pytest.approx(F.welch_t(better, worse))


@pytest.mark.parametrize("outcomes, verdict", [
    ([F.CLEAR_FOR, F.CLEAR_FOR], "reproduced"),
    ([F.CLEAR_FOR, F.FOR], "partly"),
    ([F.CLEAR_FOR, F.MISSING], "partly"),
    ([F.CLEAR_FOR, F.EQUAL, F.FOR], "partly"),
    ([F.EQUAL, F.FOR], "not shown"),
    ([F.EQUAL, F.CLEAR_AGAINST], "against"),
    ([F.CLEAR_FOR, F.AGAINST], "not reproduced"),
    ([F.CLEAR_FOR, F.CLEAR_AGAINST], "not reproduced"),
    ([F.CLEAR_AGAINST, F.FOR], "against"),
    ([F.AGAINST, F.CLEAR_AGAINST], "against"),
    ([F.FOR, F.AGAINST], "not shown"),
    ([F.FOR, F.FOR], "not shown"),
    ([F.MISSING], "not shown"),
])
def test_the_verdict_rule(outcomes, verdict):
  assert F.verdict(outcomes) == verdict
  assert verdict in F.VERDICTS


def test_every_verdict_class_from_a_results_csv():
  clear_low, clear_high = [1.0, 1.1, 0.9], [2.0, 2.1, 1.9]
  unclear_low, unclear_high = [1.0, 1.5, 0.5], [1.5, 2.0, 1.0]
  rows = _rows({
      "s4": (_sm(4), clear_high), "s8": (_sm(8), unclear_high), "s16": (_sm(16), unclear_low),
      "s32": (_sm(32), clear_low)})

  def finding(*pairs):
    return {"id": "X", "claim": "", "comparisons": [{"better": _sm(b), "worse": _sm(w)}
                                                    for b, w in pairs]}

  cases = {
      "reproduced": finding((32, 4), (16, 4)),    # 16 vs 4: t = 3.6 (sd 0.5 against 0.1)
      "partly": finding((32, 4), (16, 8)),        # clear, then the same way unclearly
      "not reproduced": finding((32, 4), (8, 16)),  # clear, then against unclearly
      "against": finding((4, 32)),                 # clearly the other way
      "not shown": finding((16, 8)),               # the paper's way, not clear
  }
  for expected, spec in cases.items():
    (got,) = F.evaluate(rows, [spec])
    assert got.verdict == expected, (expected, [c.outcome for c in got.comparisons])


def test_a_missing_group_is_not_shown_and_an_ambiguous_selector_is_an_error():
  rows = _rows({"a": (_sm(4), [1.0, 1.1]), "b": (dict(_sm(4), **{"stream.replay": 1.0}),
                                                  [0.5, 0.6])})
  spec = {"id": "F9", "claim": "", "comparisons": [{"better": _sm(64), "worse": _sm(4)}]}
  with pytest.raises(F.FindingsError, match=r"F9.*matches 2 groups.*stream.replay"):
    F.evaluate(rows, [spec])
  spec["comparisons"][0]["worse"] = dict(_sm(4), **{"stream.replay": 1.0})
  (got,) = F.evaluate(rows, [spec])
  assert got.verdict == "not shown" and got.comparisons[0].outcome == F.MISSING
  assert "not in the results" in F.table([got])


def test_a_side_is_labelled_by_its_names_and_its_sizes_as_they_stand():
  def lm(dim, vocab):
    return {"data.name": "tiny_shakespeare", "method.name": "lm_sm", "model.name": "switch",
            "model.preset": "tiny", "model.dim": dim, "data.vocab_size": vocab}
  rows = _rows({"tiny": (lm(0, 0), [5.0, 5.1, 4.9]), "wide": (lm(128, 2048), [3.0, 3.1, 2.9])})
  spec = {"id": "L", "claim": "", "comparisons": [
      {"better": {"data.name": "tiny_shakespeare", "model.dim": 128, "data.vocab_size": 2048},
       "worse": {"method.name": "lm_sm", "model.dim": 0, "data.vocab_size": 0}}]}
  (c,) = F.evaluate(rows, [spec])[0].comparisons
  # A name by its value alone (not "name=tiny_shakespeare name=lm_sm"); a size at 0 by the
  # preset's size and the whole vocabulary, as the figures name it.
  assert c.better.label == "tiny_shakespeare dim=128 vocab_size=2048"
  assert c.worse.label == "lm_sm dim=64 vocab_size=all"
  assert labels.label({"stream.replay": 0.0, "method.name": ""},
                      ["method.name", "stream.replay"]) == "replay=0.0"


def test_within_a_budget_the_largest_candidate_that_spends_no_more_is_compared():
  rows = _rows({
      "s4": (_sm(4), [5.0, 5.1, 4.9], {"comp_total": 1.0}),
      "s16": (_sm(16), [2.0, 2.1, 1.9], {"comp_total": 3.0}),
      "s64": (_sm(64), [1.0, 1.1, 0.9], {"comp_total": 9.0}),  # more than the budget
      "grow": ({"method.name": "gmoe", "model.width": 4, "stream.wait": 10}, [3.0, 3.1, 2.9],
               {"comp_total": 4.0})})
  spec = {"id": "F4", "claim": "", "comparisons": [
      {"better": [_sm(4), _sm(16), _sm(64)], "within": "comp_total",
       "worse": {"method.name": "gmoe"}}]}
  (got,) = F.evaluate(rows, [spec])
  (c,) = got.comparisons
  assert c.better.label == "sm width=16 wait=10" and c.outcome == F.CLEAR_FOR
  assert "comp_total 3 vs 4" in c.note
  spec["comparisons"][0]["better"] = [_sm(64)]  # nothing within the budget
  (got,) = F.evaluate(rows, [spec])
  assert got.comparisons[0].outcome == F.MISSING and "no candidate within" in (
      got.comparisons[0].note)


def test_pick_best_compares_the_lowest_metric_within_the_budget():
  def _r(width, replay=0.0):
    return dict(_sm(width), **{"stream.replay": replay})
  rows = _rows({
      "s4": (_r(4), [2.0, 2.1, 1.9], {"comp_total": 1.0}),   # best, and within the budget
      "s16": (_r(16), [4.0, 4.1, 3.9], {"comp_total": 3.0}),  # spends most within it
      "s64": (_r(64), [1.0, 1.1, 0.9], {"comp_total": 9.0}),  # best of all, over the budget
      "replay": (_r(4, 1.0), [3.0, 3.1, 2.9], {"comp_total": 4.0})})
  comp = {"better": [_r(4), _r(16), _r(64)], "within": "comp_total", "worse": _r(4, 1.0)}
  spec = {"id": "F5", "claim": "", "comparisons": [dict(comp, pick="best")]}
  (c,) = F.evaluate(rows, [spec])[0].comparisons
  assert c.better.label == "sm width=4 wait=10 replay=0.0" and c.outcome == F.CLEAR_FOR
  assert "the best of 2 within comp_total: 1 vs 4" in c.note
  spec["comparisons"] = [comp]  # the default picks the one spending most: width 16, worse
  (c,) = F.evaluate(rows, [spec])[0].comparisons
  assert c.better.label == "sm width=16 wait=10 replay=0.0" and c.outcome == F.CLEAR_AGAINST


@pytest.mark.parametrize("bad", [{"pick": "cheapest"}, {"pick": "best", "within": None}])
def test_a_pick_that_is_unknown_or_has_no_budget_is_refused(bad):
  rows = _rows({"s4": (_sm(4), [2.0, 2.1, 1.9], {"comp_total": 1.0})})
  comp = dict({"better": [_sm(4)], "within": "comp_total", "worse": _sm(4)}, **bad)
  comp = {k: v for k, v in comp.items() if v is not None}
  with pytest.raises(F.FindingsError, match="pick is one of .'most', 'best'. and needs within"):
    F.evaluate(rows, [{"id": "F5", "claim": "", "comparisons": [comp]}])


def test_a_list_without_a_budget_compares_its_best_candidate():
  rows = _rows({"w1": (_sm(4, 1), [5.0, 5.2, 4.8]), "w10": (_sm(4, 10), [3.0, 3.2, 2.8]),
                "w50": (_sm(4, 50), [4.0, 4.2, 3.8]), "w500": (_sm(4, 500), [9.0, 9.2, 8.8])})
  spec = {"id": "F1", "claim": "", "comparisons": [
      {"better": [_sm(4, 10), _sm(4, 50)], "worse": _sm(4, w)} for w in (1, 500)]}
  (got,) = F.evaluate(rows, [spec])
  assert [c.better.label for c in got.comparisons] == ["sm width=4 wait=10"] * 2
  assert got.verdict == "reproduced" and "the best of 2" in got.comparisons[0].note


def test_only_finished_seeds_count_and_a_metric_must_be_present():
  rows = _rows({"a": (_sm(4), [1.0, 1.1, 0.9]), "b": (_sm(16), [2.0, 2.1, 1.9])})
  rows[0]["finished"] = "False"
  spec = {"id": "X", "claim": "", "comparisons": [{"better": _sm(4), "worse": _sm(16)}]}
  (got,) = F.evaluate(rows, [spec])
  assert got.comparisons[0].better.n == 2
  spec["metric"] = "final_error"
  with pytest.raises(F.FindingsError, match="no value of 'final_error'"):
    F.evaluate(rows, [spec])


def test_a_nan_or_a_text_where_a_number_belongs_is_an_error_not_evidence():
  # A nan mean compares false with any number: it read as a difference against the paper.
  rows = _rows({"a": (_sm(4), [1.0, 1.1, 0.9]), "b": (_sm(16), [2.0, 2.1, 1.9])})
  spec = {"id": "X", "claim": "", "comparisons": [{"better": _sm(4), "worse": _sm(16)}]}
  assert F.evaluate(rows, [spec])[0].verdict == "reproduced"
  for cell, message in (("nan", r"^finding X: cer_percent=nan of /runs/b/seed_2 in results.csv: "
                                r"a comparison needs a number for every finished seed$"),
                        ("n/a", r"^finding X: cer_percent='n/a' of /runs/b/seed_2 in "
                                r"results.csv is not a number$")):
    bad = [dict(r) for r in rows]
    bad[-1]["cer_percent"] = cell
    with pytest.raises(F.FindingsError, match=message):
      F.evaluate(bad, [spec])
  # A budget's field too; a nan budget only leaves no candidate within it.
  rows = _rows({"a": (_sm(4), [1.0, 1.1, 0.9], {"mem": 1.0}),
                "b": (_sm(16), [2.0, 2.1, 1.9], {"mem": 2.0})})
  within = {"id": "X", "claim": "",
            "comparisons": [{"better": [_sm(4)], "worse": _sm(16), "within": "mem"}]}
  assert F.evaluate(rows, [within])[0].verdict == "reproduced"
  rows[-1]["mem"] = "big"
  with pytest.raises(F.FindingsError, match=r"^finding X: mem='big' of /runs/b/seed_2 in "):
    F.evaluate(rows, [within])


def test_the_command_prints_the_table(tmp_path, capsys):
  rows = _rows({"a": (_sm(4), [1.0, 1.1, 0.9]), "b": (_sm(16), [2.0, 2.1, 1.9])})
  results = tmp_path / "results.csv"
  with open(results, "w", newline="") as f:
    writer = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
  grid = tmp_path / "grid.py"
  grid.write_text("GRID = {'seed': [0]}\nFINDINGS = [{'id': 'F2', 'claim': 'smaller is better',"
                  " 'comparisons': [{'better': {'model.width': 4}, 'worse': "
                  "{'model.width': 16}}]}]\n")
  assert F.main([f"--results={results}", f"--grid_file={grid}"]) == 0
  out = capsys.readouterr().out
  assert "| F2 | smaller is better | **reproduced** |" in out
  assert "| F2 | cer_percent | width=4: 1 ± 0.1 (n=3) | width=16: 2 ± 0.1 (n=3) | +12.2 |" in out
  grid.write_text("FINDINGS = 3\n")
  assert F.main([f"--results={results}", f"--grid_file={grid}"]) == 2
  assert "FINDINGS must be a list of dicts" in capsys.readouterr().err


def test_the_command_reads_a_grid_run_in_parts_as_one_file(tmp_path, capsys):
  rows = _rows({"a": (_sm(4), [1.0, 1.1, 0.9]), "b": (_sm(16), [2.0, 2.1, 1.9])})
  # Seed 0 at one commit; seeds 1 and 2 at a later one, whose summaries have a column more.
  parts = {"whole": rows, "seed0": [r for r in rows if r["seed"] == "0"],
           "seeds12": [{**r, "timings.xla_programs": "9"} for r in rows if r["seed"] != "0"],
           "other_fields": [{**r, "train.epochs": "5"} for r in rows if r["seed"] != "0"]}
  path = {}
  for name, these in parts.items():
    path[name] = tmp_path / f"{name}.csv"
    text = io.StringIO()
    writer = csv.DictWriter(text, list(these[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(these)
    path[name].write_text(text.getvalue())
  joined = F.read_parts(f"{path['seed0']}, {path['seeds12']}")
  assert [(r["group"], r["seed"]) for r in joined] == [
      ("a", "0"), ("b", "0"), ("a", "1"), ("a", "2"), ("b", "1"), ("b", "2")]
  assert [r["timings.xla_programs"] for r in joined] == ["", "", "9", "9", "9", "9"]
  grid = tmp_path / "grid.py"
  grid.write_text("FINDINGS = [{'id': 'F2', 'claim': 'smaller is better', 'comparisons': "
                  "[{'better': {'model.width': 4}, 'worse': {'model.width': 16}}]}]\n")
  assert F.main([f"--results={path['whole']}", f"--grid_file={grid}"]) == 0
  whole = capsys.readouterr().out
  assert "| F2 | cer_percent | width=4: 1 ± 0.1 (n=3) | width=16: 2 ± 0.1 (n=3) | +12.2 |" in whole
  assert F.main([f"--results={path['seed0']},{path['seeds12']}", f"--grid_file={grid}"]) == 0
  assert capsys.readouterr().out == whole
  # A run's seed in two parts, parts of other config fields, and no file at all are refused.
  def refused(results):
    assert F.main([f"--results={results}", f"--grid_file={grid}"]) == 2
    return capsys.readouterr().err
  assert (f"findings: error: --results: seed 0 of /runs/a/seed_0 is in both {path['seed0']} "
          f"(part 1) and {path['whole']} (part 2); give each run's seed in one part"
          in refused(f"{path['seed0']},{path['whole']}"))
  assert (f"findings: error: --results: {path['other_fields']} and {path['seed0']} hold other "
          "config fields (train.epochs): give the parts of one grid, run by the same code"
          in refused(f"{path['seed0']},{path['other_fields']}"))
  assert "findings: error: --results=' , ' names no file" in refused(" , ")


@pytest.mark.parametrize("content, message", [
    (None, r"^--results=\S+: No such file or directory$"),
    ("dir", r"^--results=\S+: Is a directory$"),
    (b"\xff\xfe\x00", r"^--results=\S+: 'utf-8' codec can't decode byte 0xff in position 0"),
    (b"", r"^--results=\S+ has no rows: a results.csv that the report wrote has a row per seed"),
    (b"group,cer_percent\n", r"^--results=\S+ has no rows"),
], ids=["missing", "directory", "not_text", "empty", "header_only"])
def test_a_results_file_that_is_not_one_is_named_by_its_flag(content, message, tmp_path):
  path = tmp_path / "results.csv"
  if content == "dir":
    path.mkdir()
  elif content is not None:
    path.write_bytes(content)
  with pytest.raises(F.FindingsError, match=message) as info:
    F.read_results(str(path))
  assert "\n" not in str(info.value)


def test_findings_of_a_shipped_grid_by_name_and_a_grid_that_fails_by_its_line(tmp_path):
  assert F.load_findings("findings") == F.load_findings("launch/grids/findings.py") != []
  with pytest.raises(F.FindingsError, match=r"^--findings=findngs: no such file, nor a grid of "
                                            r"alma_jax's \(names: .*findings, findings_cifar"):
    F.load_findings("findngs", "--findings")
  grid = tmp_path / "grid.py"
  grid.write_text("GRID = {}\nFINDINGS = [x]\n")
  with pytest.raises(F.FindingsError, match=rf"^--grid_file={grid}: {grid}, line 2: NameError: "
                                            "name 'x' is not defined$"):
    F.load_findings(str(grid))


@pytest.mark.parametrize("folder, grid, results", [
    ("mnist", "findings", "results.csv"), ("cifar10", "findings_cifar", "results.csv"),
    ("beyond", "beyond", "results.csv"), ("lm_growth", "lm_growth", "results.csv"),
    ("ten_seeds", "ten_seeds", "results.csv"),
    # The grids run again later (REPRODUCTION.md), every record the same: the same verdicts.
    ("cifar10", "findings_cifar",
     "rerun_3ca1fb9_seed0/results.csv,rerun_4563f95_seeds12/results.csv"),
    ("lm_growth", "lm_growth", "rerun_4563f95/results.csv")])
def test_a_committed_report_s_verdicts_are_those_of_its_results_and_grid(folder, grid, results):
  # REPRODUCTION.md quotes the verdicts of docs/reproduction/<folder>/report.md: the findings
  # computed again from the committed results.csv and the grid file as it is now are the same.
  base = os.path.join(helpers.ROOT, "docs", "reproduction", folder)
  found = F.evaluate(F.read_parts(",".join(os.path.join(base, r) for r in results.split(","))),
                     F.load_findings(grid))
  assert found
  with open(os.path.join(base, "report.md")) as f:
    assert F.table(found).strip() in f.read()


@pytest.mark.parametrize("folder, grid, rerun", [
    ("mnist", "findings", "rerun_3ca1fb9/results.csv"),
    ("cifar10", "findings_cifar",
     "rerun_3ca1fb9_seed0/results.csv,rerun_4563f95_seeds12/results.csv"),
    ("beyond", "beyond", "rerun_de7fe6a/results.csv"),
    ("lm_growth", "lm_growth", "rerun_4563f95/results.csv"),
    ("ten_seeds", "ten_seeds", "rerun_de7fe6a/results.csv")])
def test_every_grid_run_again_gives_the_committed_verdicts(folder, grid, rerun):
  # REPRODUCTION.md says of each grid run again at a later commit (or on another CPU model)
  # that every verdict is the one of the committed results; the numbers may differ.
  base = os.path.join(helpers.ROOT, "docs", "reproduction", folder)
  findings = F.load_findings(grid)
  committed = F.evaluate(F.read_results(os.path.join(base, "results.csv")), findings)
  again = F.evaluate(F.read_parts(",".join(os.path.join(base, r) for r in rerun.split(","))),
                     findings)
  assert committed and [(f.id, f.verdict) for f in again] == [
      (f.id, f.verdict) for f in committed]


def test_a_folder_named_like_a_shipped_grid_does_not_hide_it(tmp_path, monkeypatch):
  # `alma-jax sweep --grid_file=findings --root=findings`, run again from the same folder: the
  # sweep's root is a folder named `findings`, and the name still means the shipped grid.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "findings").mkdir()
  assert F.load_findings("findings") == F.load_findings("launch/grids/findings.py") != []
  (tmp_path / "no_grid").mkdir()
  with pytest.raises(F.FindingsError, match=r"^--grid_file=no_grid: a folder, not a grid file, "
                                            r"nor the name of a grid of alma_jax's \(names: "):
    F.load_findings("no_grid")
