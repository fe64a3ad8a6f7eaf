"""Tests of the comparison of a rerun with the results it repeats (alma_jax/reports/rerun.py)."""

import csv
import glob
import io
import math
import os
import re
import shlex

import pytest

from alma_jax.reports import findings as F
from alma_jax.reports import rerun as R
from tests import helpers


def _csv_text(rows):
  text = io.StringIO()
  writer = csv.DictWriter(text, sorted(set().union(*rows)), lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  return text.getvalue()


def _rows(groups, common=None):
  """results.csv rows, through the CSV text as the report writes it: {group id: (config fields,
  {metric: [value per seed]})}; `common`: config fields of every row."""
  rows = []
  for gid, (fields, metrics) in groups.items():
    for seed in range(len(next(iter(metrics.values())))):
      row = {"workdir": f"/runs/{gid}/seed_{seed}", "finished": "True", "group": gid,
             "seed": str(seed), "provenance.commit": gid}
      row.update({k: str(v) for k, v in {**(common or {}), **fields}.items()})
      row.update({m: repr(v[seed]) for m, v in metrics.items()})
      rows.append(row)
  return F.read_rows(_csv_text(rows))


def _sm(width, wait=10):
  return {"data.name": "mnist", "method.name": "sm", "model.width": width, "stream.wait": wait}


def test_groups_match_by_the_fields_that_set_them_apart_whatever_their_ids_and_paths():
  earlier = _rows({"e1": (_sm(4), {"cer_percent": [10.0, 11.0, 12.0], "mem": [5.0] * 3}),
                   "e2": (_sm(64), {"cer_percent": [3.0, 3.1, 2.9], "mem": [9.0] * 3}),
                   "e3": (_sm(64, wait=50), {"cer_percent": [6.0, 6.1, 5.9], "mem": [9.0] * 3})},
                  common={"data.data_dir": "/old/tfds", "train.epochs": "20"})
  # The rerun: other group ids and data path (which changes no record), other epochs in every
  # run, a config field the earlier code did not have, and a point the earlier grid did not run.
  this = _rows({"n1": (_sm(4), {"cer_percent": [10.5, 11.5, 12.5], "mem": [5.0] * 3}),
                "n2": (_sm(64), {"cer_percent": [4.0, 4.1, 3.9], "mem": [9.0] * 3}),
                "n4": (_sm(16), {"cer_percent": [5.0, 5.1, 4.9], "mem": [7.0] * 3})},
               common={"data.data_dir": "/new/tfds", "train.epochs": "10",
                       "model.scan_layers": "True"})
  got = R.compare(this, earlier)
  by = {(r.group, r.metric): r for r in got.rows}
  # Labelled by the fields that differ among the groups of one data and method.
  small, wide = "mnist sm width=4 wait=10", "mnist sm width=64 wait=10"
  assert sorted(by) == [(small, "cer_percent"), (small, "mem"), (wide, "cer_percent"),
                        (wide, "mem")]
  # Welch's t of (this - earlier): the same spread (sd 1) on both sides, means 0.5 apart.
  row = by[(small, "cer_percent")]
  assert row.t == pytest.approx(0.5 / math.sqrt(2 / 3)) and row.outcome == ""
  assert (row.earlier.mean, row.this.mean) == (11.0, 11.5)
  # Means 1.0 apart with sd 0.1: t = 1 / sqrt(0.02 / 3) = 12.2, clear.
  row = by[(wide, "cer_percent")]
  assert row.t == pytest.approx(1.0 / math.sqrt(0.02 / 3)) and row.outcome == R.CLEAR
  assert by[(small, "mem")].outcome == R.IDENTICAL
  assert got.only_this == ("mnist sm width=16 wait=10",)
  assert got.only_earlier == ("mnist sm width=64 wait=50",)
  assert got.set_apart == (("train.epochs", "20", "10"),)
  text = R.table(got)
  assert f"| {wide} | cer_percent | 3 ± 0.1 (n=3) | 4 ± 0.1 (n=3) | +12.2 | clear |" in text
  assert ("2 groups in both files, 4 comparisons: 2 identical, 1 clearly different (|t| > 3): "
          f"{wide} cer_percent t = +12.2.") in text
  assert "\n\nOnly in --results (1 group):\n\n- mnist sm width=16 wait=10\n" in text
  assert "\n\nOnly in --against (1 group):\n\n- mnist sm width=64 wait=50\n" in text
  assert ("The same within each file, different between them (not used to match): "
          "train.epochs '20' -> '10'.") in text


def test_a_lower_rerun_has_a_negative_t_and_unfinished_seeds_are_left_out():
  earlier = _rows({"a": (_sm(4), {"cer_percent": [2.0, 2.1, 1.9, 99.0]})})
  this = _rows({"b": (_sm(4), {"cer_percent": [1.0, 1.1, 0.9, 0.0]})})
  earlier[3]["finished"] = this[3]["finished"] = "False"
  (row,) = R.compare(this, earlier, ["cer_percent"]).rows
  assert (row.earlier.n, row.this.n) == (3, 3)
  assert row.t == pytest.approx(-1.0 / math.sqrt(0.02 / 3)) and row.outcome == R.CLEAR


def test_identical_means_every_seed_the_same_not_only_the_mean():
  earlier = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]})})
  swapped = _rows({"a": (_sm(4), {"cer_percent": [2.0, 1.0, 3.0]})})
  (row,) = R.compare(swapped, earlier).rows
  assert row.outcome == "" and row.t == 0.0
  same = R.compare(earlier, earlier)
  (row,) = same.rows
  assert row.outcome == R.IDENTICAL
  assert "\n1 group in both files, 1 comparison: 1 identical," in R.table(same)


def test_a_group_in_both_files_that_no_metric_compares_is_listed():
  earlier = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]}),
                   "b": (_sm(16), {"cer_percent": [4.0, 5.0, 6.0]})})
  this = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]}),
                "b": (_sm(16), {"cer_percent": [4.0, 5.0, 6.0]})})
  for r in this[3:]:  # width 16 not finished in the rerun
    r["finished"] = "False"
  c = R.compare(this, earlier)
  assert [r.group for r in c.rows] == ["mnist sm width=4"]
  assert c.not_compared == ("mnist sm width=16",)
  text = R.table(c)
  assert ("\n2 groups in both files (1 compared), 1 comparison: 1 identical," in text
          and text.endswith("\n\nIn both files, not compared: a side has no finished run with a "
                            "value of the metrics (1 group):\n\n- mnist sm width=16\n")), text
  assert "compared" not in R.table(R.compare(earlier, earlier))


def test_a_text_where_a_metric_s_number_belongs_is_named(tmp_path, capsys):
  rows = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]})})
  rows[1]["provenance.jax"] = rows[0]["provenance.jax"] = "0.10.2"
  (tmp_path / "r.csv").write_text(_csv_text(rows))
  assert R.main([f"--results={tmp_path / 'r.csv'}", f"--against={tmp_path / 'r.csv'}",
                 "--metrics=provenance.jax"]) == 2
  assert capsys.readouterr().err == (
      "rerun: error: --metrics=provenance.jax: provenance.jax='0.10.2' of /runs/a/seed_0 in "
      "results.csv is not a number\n")


def test_default_metrics_are_those_the_files_have_and_an_unknown_one_is_named(tmp_path, capsys):
  earlier = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0], "final_error": [.25] * 3})})
  this = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.5], "final_error": [.25] * 3})})
  assert [r.metric for r in R.compare(this, earlier).rows] == ["cer_percent", "final_error"]
  with pytest.raises(R.RerunError, match=r"--metrics: \['perplexity'\] is in neither"):
    R.compare(this, earlier, ["perplexity"])
  paths = {}
  for name, rows in (("this", this), ("earlier", earlier)):
    paths[name] = tmp_path / f"{name}.csv"
    paths[name].write_text(_csv_text(rows))
  assert R.main([f"--results={paths['this']}", f"--against={paths['earlier']}"]) == 0
  out = capsys.readouterr().out
  assert "| mnist sm | final_error | 0.25 ± 0 (n=3) | 0.25 ± 0 (n=3) | – | identical |" in out
  assert R.main([f"--results={paths['this']}", f"--against={tmp_path / 'none.csv'}"]) == 2
  assert R.main([f"--results={paths['this']}", f"--against={paths['earlier']}",
                 "--metrics=cer_percent,wall"]) == 2
  assert "rerun: error: --metrics: ['wall']" in capsys.readouterr().err
  # An empty list (an unset shell variable) is not taken for the defaults.
  for empty in ("", " , "):
    assert R.main([f"--results={paths['this']}", f"--against={paths['earlier']}",
                   f"--metrics={empty}"]) == 2
    assert (f"rerun: error: --metrics={empty!r} names no column; give comma-separated summary "
            "columns, or leave the flag out for the defaults") in capsys.readouterr().err
  assert R.main([f"--results={paths['this']}", f"--against={paths['earlier']}",
                 "--metrics= final_error"]) == 0
  assert "| mnist sm | final_error |" in capsys.readouterr().out


def test_seeds_compare_a_rerun_of_some_seeds_with_the_same_seeds_of_the_whole_grid(
    tmp_path, capsys):
  earlier = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]}),
                   "b": (_sm(16), {"cer_percent": [4.0, 5.0, 6.0]})})
  first = _rows({"a": (_sm(4), {"cer_percent": [1.0]}), "b": (_sm(16), {"cer_percent": [4.5]})})
  # Every seed of both: seed 0 alone against three, never identical.
  assert {r.outcome for r in R.compare(first, earlier).rows} == {""}
  same, moved = R.compare(first, earlier, seeds=[0]).rows
  assert (same.outcome, same.earlier.values, same.this.values) == (R.IDENTICAL, (1.0,), (1.0,))
  assert moved.outcome == "" and math.isnan(moved.t)
  assert (moved.earlier.values, moved.this.values) == ((4.0,), (4.5,))
  # Two seeds of three, and a seed that one side lacks is left out of the other's side too.
  two = R.compare(earlier, earlier, seeds=[1, 2])
  assert [r.earlier.values for r in two.rows] == [(2.0, 3.0), (5.0, 6.0)]
  assert {r.outcome for r in two.rows} == {R.IDENTICAL}
  with pytest.raises(R.RerunError, match=r"--seeds=5 keeps no row of --results; its seeds: 0$"):
    R.compare(first, earlier, seeds=[5])
  paths = {}
  for name, rows in (("first", first), ("earlier", earlier)):
    paths[name] = tmp_path / f"{name}.csv"
    paths[name].write_text(_csv_text(rows))
  args = [f"--results={paths['first']}", f"--against={paths['earlier']}"]
  assert R.main(args + ["--seeds=0"]) == 0
  out = capsys.readouterr().out
  assert "| mnist sm width=4 | cer_percent | 1 (n=1) | 1 (n=1) | – | identical |" in out
  assert "2 groups in both files, 2 comparisons: 1 identical," in out
  for bad in ("", "a", "0,-1", "1.5"):
    assert R.main(args + [f"--seeds={bad}"]) == 2
    assert (f"rerun: error: --seeds={bad!r}: give comma-separated seeds (whole numbers >= 0)"
            in capsys.readouterr().err)


def test_choices_say_which_groups_ran_with_other_speed_choices(tmp_path, capsys):
  auto = {"train.step_fusion": "auto", "train.steps_per_call": "0"}
  earlier = _rows({"a": ({**_sm(4), **auto}, {"cer_percent": [1.0, 2.0, 3.0]}),
                   "b": ({**_sm(16), **auto}, {"cer_percent": [4.0, 5.0, 6.0]}),
                   "c": ({**_sm(64), **auto}, {"cer_percent": [7.0, 8.0, 9.0]})})
  this = _rows({"a": ({**_sm(4), **auto}, {"cer_percent": [1.0, 2.0, 3.0]}),
                "b": ({**_sm(16), **auto}, {"cer_percent": [4.5, 5.0, 6.0]}),
                # A run that set the value the earlier runs chose chose alike.
                "c": ({**_sm(64), "train.step_fusion": "no_ynn", "train.steps_per_call": "0"},
                      {"cer_percent": [7.0, 8.0, 9.0]})})
  for rows, made in ((earlier, {"a": "onednn", "b": "same", "c": "no_ynn"}),
                     (this, {"a": "onednn", "b": "no_ynn", "c": ""})):
    for r in rows:
      r["choices.train.step_fusion"] = made[r["group"]]
      r["choices.train.steps_per_call"] = "1"
  this[4]["choices.train.steps_per_call"] = "4"  # one seed of b chose otherwise
  assert {r.choices for r in R.compare(this, earlier).rows} == {""}  # not asked for
  rows = {r.group: r for r in R.compare(this, earlier, choices=True).rows}
  assert rows["mnist sm width=4"].choices == R.ALIKE
  assert rows["mnist sm width=64"].choices == R.ALIKE
  assert rows["mnist sm width=16"].choices == ("train.step_fusion same -> no_ynn; "
                                                "train.steps_per_call 1 -> 1/4")
  paths = {}
  for name, rows in (("this", this), ("earlier", earlier)):
    paths[name] = tmp_path / f"{name}.csv"
    paths[name].write_text(_csv_text(rows))
  assert R.main([f"--results={paths['this']}", f"--against={paths['earlier']}", "--choices"]) == 0
  out = capsys.readouterr().out
  assert "| group | metric | --against | --results | Welch t | | speed choices |" in out
  assert ("| mnist sm width=4 | cer_percent | 2 ± 1 (n=3) | 2 ± 1 (n=3) | – | identical "
          "| alike |") in out
  assert ("Speed choices: the runs of 1 of the 3 groups made other ones on the two sides; of "
          "the 1 comparisons not identical, 1 are of those groups.") in out
  assert R.main([f"--results={paths['this']}", f"--against={paths['earlier']}"]) == 0
  assert "speed choices" not in capsys.readouterr().out.lower()


def test_groups_that_differ_only_in_a_field_the_other_file_lacks_match_none_of_its_groups():
  earlier = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]})})
  this = _rows({"s": ({**_sm(4), "model.scan_layers": True}, {"cer_percent": [1.0, 2.0, 3.0]}),
                "u": ({**_sm(4), "model.scan_layers": False}, {"cer_percent": [1.5, 2.5, 3.5]})})
  with pytest.raises(R.RerunError, match=r"--results: groups differ in \['model.scan_layers'\]"):
    R.compare(this, earlier)
  # With one value of the field, the groups match.
  (row,) = R.compare(this[:3], earlier).rows
  assert row.outcome == R.IDENTICAL
  # Where the other file has no group of their key (a rerun of part of a grid), they are listed
  # as found in one file only, named by the field, and the other groups are compared.
  other = _rows({"a": (_sm(16), {"cer_percent": [1.0, 2.0, 3.0]}),
                 "b": (_sm(4, wait=50), {"cer_percent": [4.0, 5.0, 6.0]})})
  wider = _rows({"s": ({**_sm(16), "model.scan_layers": True}, {"cer_percent": [1.0, 2.0, 3.0]}),
                 "u": ({**_sm(16), "model.scan_layers": False}, {"cer_percent": [1.0, 2.0, 3.0]}),
                 "w": ({**_sm(4, wait=50), "model.scan_layers": False},
                       {"cer_percent": [4.0, 5.0, 6.0]})})
  with pytest.raises(R.RerunError, match=r"--results: groups differ in \['model.scan_layers'\]"):
    R.compare(wider, other)
  part = R.compare(other[3:], wider)
  assert [(r.group, r.outcome) for r in part.rows] == [("mnist sm", R.IDENTICAL)]
  assert part.only_earlier == ("mnist sm width=16 wait=10 scan_layers=True",
                               "mnist sm width=16 wait=10 scan_layers=False")
  assert "\n- mnist sm width=16 wait=10 scan_layers=True\n" in R.table(part)


def test_a_switch_size_at_zero_is_labelled_by_what_it_stands_for():
  def lm(vocab, dim, ffn):
    return {"data.name": "tiny_shakespeare", "method.name": "lm_sm", "model.name": "switch",
            "model.preset": "tiny", "data.vocab_size": vocab, "model.dim": dim,
            "model.ffn_dim": ffn, "stream.wait": 1.0}
  runs = {"t": (lm(0, 0, 0), {"cer_percent": [1.0, 2.0, 3.0]}),
          "b": (lm(2048, 128, 256), {"cer_percent": [4.0, 5.0, 6.0]})}
  got = R.compare(_rows(runs), _rows(runs))
  # The preset's sizes and the whole vocabulary, not the zeros that stand for them; a field that
  # sizes no model keeps its value as the file writes it.
  assert sorted({r.group for r in got.rows}) == [
      "tiny_shakespeare lm_sm vocab_size=2048 dim=128 ffn_dim=256",
      "tiny_shakespeare lm_sm vocab_size=all dim=64 ffn_dim=128"]
  runs["b"][0]["stream.wait"] = 2.0
  assert "tiny_shakespeare lm_sm vocab_size=2048 dim=128 ffn_dim=256 wait=2.0" in {
      r.group for r in R.compare(_rows(runs), _rows(runs)).rows}


def test_a_run_that_chose_the_old_default_of_a_changed_field_matches_the_runs_set_to_it():
  def gmoe(wait, slots, chosen=None):
    fields = {"data.name": "mnist", "method.name": "gmoe", "stream.wait": wait,
              "method.slots": slots}
    return {**fields, "choices.method.slots": chosen} if chosen else fields

  # Written when gMoE's slots defaulted to pow2, beside a method without the field.
  earlier = _rows({"s": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]}),
                   "g": (gmoe(10, "pow2"), {"cer_percent": [4.0, 5.0, 6.0]}),
                   "h": (gmoe(50, "pow2"), {"cer_percent": [7.0, 8.0, 9.0]})})
  # Run again at the new default, auto: pow2 chosen for one point, planned for the other.
  this = _rows({"s": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0]}),
                "g": (gmoe(10, "auto", "pow2"), {"cer_percent": [4.0, 5.0, 6.0]}),
                "h": (gmoe(50, "auto", "planned"), {"cer_percent": [7.0, 8.0, 9.0]})})
  got = R.compare(this, earlier)
  assert sorted(r.group for r in got.rows) == ["mnist gmoe slots=pow2 wait=10", "mnist sm"]
  assert {r.outcome for r in got.rows} == {R.IDENTICAL}
  assert got.only_this == ("mnist gmoe slots=planned wait=50",)
  assert got.only_earlier == ("mnist gmoe slots=pow2 wait=50",)
  # Without the choice (a field that kept its default), `auto` is a value of its own.
  plain = _rows({"g": (gmoe(10, "auto"), {"cer_percent": [4.0, 5.0, 6.0]})})
  assert R.compare(plain, earlier).rows == ()


def test_a_rerun_in_parts_is_compared_as_one_and_a_seed_in_two_parts_is_refused(
    tmp_path, capsys):
  earlier = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0], "mem": [5.0] * 3}),
                   "b": (_sm(16), {"cer_percent": [4.0, 5.0, 6.0], "mem": [7.0] * 3})})
  rerun = _rows({"a": (_sm(4), {"cer_percent": [1.0, 2.0, 3.0], "mem": [5.0] * 3}),
                 "b": (_sm(16), {"cer_percent": [4.0, 5.5, 6.0], "mem": [7.0] * 3})})
  # Seed 0 ran at one commit, seeds 1 and 2 at a later one whose summaries have a column more.
  parts = {"first": [r for r in rerun if r["seed"] == "0"],
           "rest": [{**r, "timings.xla_programs": "12"} for r in rerun if r["seed"] != "0"],
           "other_fields": [{**r, "train.epochs": "5"} for r in rerun if r["seed"] != "0"],
           "earlier0": [r for r in earlier if r["seed"] == "0"],
           "earlier12": [r for r in earlier if r["seed"] != "0"], "earlier": earlier}
  path = {}
  for name, rows in parts.items():
    path[name] = tmp_path / f"{name}.csv"
    path[name].write_text(_csv_text(rows))
  joined = F.read_parts(f"{path['first']}, {path['rest']}", "--results")
  assert [(r["group"], r["seed"]) for r in joined] == [
      ("a", "0"), ("b", "0"), ("a", "1"), ("a", "2"), ("b", "1"), ("b", "2")]
  assert [r["timings.xla_programs"] for r in joined] == ["", "", "12", "12", "12", "12"]
  for against in (f"{path['earlier']}", f"{path['earlier0']},{path['earlier12']}"):
    assert R.main([f"--results={path['first']},{path['rest']}", f"--against={against}"]) == 0
    out = capsys.readouterr().out
    assert "| mnist sm width=4 | cer_percent | 2 ± 1 (n=3) | 2 ± 1 (n=3) | – | identical |" in out
    assert "| mnist sm width=16 | cer_percent | 5 ± 1 (n=3) | 5.167 ± 1.041 (n=3) |" in out
    assert "2 groups in both files, 4 comparisons: 3 identical, 0 clearly different" in out
  # A run's seed in two parts, parts of other config fields, and no file at all are refused.
  def refused(results):
    assert R.main([f"--results={results}", f"--against={path['earlier']}"]) == 2
    return capsys.readouterr().err
  err = refused(f"{path['first']},{path['first']}")
  assert (f"rerun: error: --results: seed 0 of /runs/a/seed_0 is in both {path['first']} "
          f"(part 1) and {path['first']} (part 2); give each run's seed in one part") in err
  err = refused(f"{path['first']},{path['other_fields']}")
  assert (f"rerun: error: --results: {path['other_fields']} and {path['first']} hold other "
          "config fields (train.epochs): give the parts of one grid, run by the same code") in err
  assert "rerun: error: --results=',' names no file" in refused(",")


def _policy(wait_policy="fixed", warm_start="finetune", **fields):
  """An SM group's policy fields as a results.csv holds them: every policy's, at the defaults
  but where `fields` (paths with "__" for ".") set them, and the older spelling of the warm
  start."""
  return {**_sm(64, wait=1), "stream.wait_policy": wait_policy, "stream.warm_start": warm_start,
          "stream.geometric_w0": 1.0, "stream.shrink": 1.0, "stream.perturb": 0.0,
          "train.l2_init": 0.0, "stream.init_from_scratch": warm_start == "scratch",
          **{k.replace("__", "."): v for k, v in fields.items()}}


def test_a_group_is_labelled_without_the_fields_of_policies_it_does_not_use():
  groups = {"fine": _policy(), "scratch": _policy(warm_start="scratch"),
            "sp": _policy(warm_start="shrink_perturb", stream__shrink=0.6, stream__perturb=0.8),
            "l2": _policy(warm_start="l2_init", train__l2_init=0.001),
            "geo": _policy("geometric", stream__geometric_w0=10.0)}
  rows = _rows({g: (f, {"cer_percent": [1.0, 2.0, 3.0]}) for g, f in groups.items()})
  assert sorted({r.group for r in R.compare(rows, rows).rows}) == [
      "mnist sm geometric_w0=10.0 wait_policy=geometric warm_start=finetune",
      "mnist sm perturb=0.8 shrink=0.6 wait_policy=fixed warm_start=shrink_perturb",
      "mnist sm wait_policy=fixed warm_start=finetune",
      "mnist sm wait_policy=fixed warm_start=l2_init l2_init=0.001",
      "mnist sm wait_policy=fixed warm_start=scratch"]
  # Two groups that only an unused policy's field tells apart keep every field in their labels.
  rows = _rows({"a": (_policy(), {"cer_percent": [1.0, 2.0, 3.0]}),
                "b": (_policy(stream__shrink=0.5), {"cer_percent": [1.0, 2.0, 3.0]})})
  assert sorted({r.group for r in R.compare(rows, rows).rows}) == [
      "mnist sm shrink=0.5", "mnist sm shrink=1.0"]


def _reproduction_commands() -> list[list[str]]:
  """The arguments of every `alma_jax.reports.rerun` command in REPRODUCTION.md's code blocks
  (continued lines joined), but those that a shell variable completes."""
  with open(os.path.join(helpers.ROOT, "REPRODUCTION.md"), encoding="utf-8") as f:
    text = f.read().replace("\\\n", " ")
  found = re.findall(r"python -m alma_jax\.reports\.rerun ([^\n#]*)", text)
  return [shlex.split(c) for c in found if "$" not in c]


def test_every_committed_comparison_is_what_its_command_in_reproduction_prints(capsys,
                                                                                monkeypatch):
  # REPRODUCTION.md names each committed comparison (docs/reproduction/**/*_vs_*.md) as the
  # output of a command it shows: every such file is what one of its commands prints now (the
  # others' outputs are quoted in its text).
  monkeypatch.chdir(helpers.ROOT)
  committed = {p: open(p, encoding="utf-8").read()
               for p in sorted(glob.glob("docs/reproduction/**/*_vs_*.md", recursive=True))}
  printed = set()
  commands = _reproduction_commands()
  assert len(commands) >= len(committed) > 10
  for args in commands:
    assert R.main(args) == 0, args
    printed.add(capsys.readouterr().out)
  assert [p for p, text in committed.items() if text not in printed] == []
