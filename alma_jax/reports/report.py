"""The paper's figures and a table from the outputs of finished runs.

  python -m alma_jax.reports.report --workdirs=/tmp/sweep/* --out=/tmp/report

reads every run's `config.json`, `log.jsonl` and `summary.json` (the
`seed_<k>/` folders of a `num_seeds` run are its seeds), groups the runs that
differ only by their seed, and writes into `--out`, per data set:

* `tradeoffs_<data>.png/.pdf`: CER (%) vs paper-comparable TFLOPs of all the
  learner's work (`comp_paper_total`, forward multiply-adds x examples of training,
  growth's passes over data and a waiting policy's evaluations) and vs Mem, one colour per
  method, a line across widths (Switch Transformers: across sizes, `plots.SwitchSizes`, not
  joined where the sizes use other vocabularies), a marker per waiting time (paper Fig. 2/7);
  error bars are one sample standard deviation (ddof=1) over seeds.
* `error_<data>.png/.pdf`: test error vs mega-batch t, one panel per width
  (Switch Transformers: per size) (Fig. 1/3), the band one standard deviation over seeds.
* `wait_<data>.png/.pdf`: CER vs waiting time w, a line per config over its
  waits (paper Fig. 2's question: which wait is best), when a config has two
  or more.
* `replay_<data>.png/.pdf`: CER vs compute, a segment from each config
  without replay to the same config with replay (Fig. 4), when both exist.
* `policies_<data>.png/.pdf`: when some run uses another waiting policy
  (`stream.wait_policy`) or warm start (`stream.warm_start`) than the
  paper's: CER vs compute per width, each method's fixed waits (fine-tuned,
  no replay) as a line in order of compute, every other policy config a point.
* `lm_<data>.png/.pdf`: average perplexity vs compute, parameters and
  experts (Fig. 5), for runs whose records carry `test_perplexity`; a row of
  panels per size where Switch Transformers of several sizes are compared.
* `plasticity_<data>.png/.pdf`: when some run recorded plasticity diagnostics
  (`log.plasticity`): dormant units (%), the effective rank of the last hidden layer and
  the distance from the initial parameters against t, a line per config.
* `gating_<run>.png/.pdf`: for each gMoE config, its first seed's gating
  tree over a 2-D PCA embedding of test inputs, from its last checkpoint
  (`alma_jax.reports.gating_plot`; `--nogating` skips it).
* `report.md`: per data set, a table with one row per group (mean ± sample
  std over its seeds; also the tasks' own summary fields, `Task.SUMMARY_STATS`:
  language models' final and mean test perplexity) and the figures.
* `results.csv`: one row per run and seed: `workdir`, `finished`, every config
  field (flattened paths: `model.width`) and every summary metric (nested ones
  flattened: `timings.train_s`), for `pandas.read_csv`.

  python -m alma_jax.reports.report --results=docs/reproduction/mnist/results.csv --out=/tmp/redrawn

draws again, from a `results.csv` that a report wrote, the figures that need only the runs'
summaries (`plots.SUMMARY_FIGURES`: tradeoffs, wait, replay and policies) and writes `report.md`
with its table (and verdicts, with `--findings`): the runs' folders are not needed, and the
figures over t and the gating trees, which are, are left out.

A run without a summary (unfinished) is listed in the table but left out of
the CER figures. A folder that is not a run is an error naming what it lacks;
a pattern (`--workdirs=/tmp/sweep/*`, quoted or not: the shell does not expand
it after `=`) stands for the runs it matches, so a sweep's `logs/` and
`report/` folders beside them are passed over. A run given twice (the same
folder after resolving links), or a folder with the same config and seed as
another (a copy), counts once, with a warning. Bad inputs (a
folder that is not a run, unreadable or malformed files, an `--out` that is
not a writable directory) end the command with one line and exit code 2.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import glob
import hashlib
import io
import json
import math
import numbers
import os
import sys
from typing import Any, Sequence

import numpy as np
from absl import app
from absl import flags
from absl import logging

from alma_jax import errors
from alma_jax.configuration import config_lib
from alma_jax.configuration import plugins
from alma_jax.outputs import io_utils
from alma_jax.outputs import log_lines
from alma_jax.outputs import workdir as wd
from alma_jax.reports import findings as findings_lib
from alma_jax.reports import labels as labels_lib
from alma_jax.reports import plots

# Config fields that tell groups apart in labels and table columns, in this order.
KEY_FIELDS = ("method.name", "model.width", "stream.wait", "stream.replay")
SEED_FIELDS = ("seed", "num_seeds")
# Fields that change how a run is executed, not what it computes: groups that differ in them stay
# apart, but labels and table columns leave them out (a config that evaluates in smaller batches
# to bound its memory would otherwise carry "eval_batch_size=..." on every other line).
UNLABELLED_FIELDS = ("train.eval_batch_size", "train.steps_per_call", "model.conv_impl",
                     "method.strategy", "train.autotune", "train.cpu_fusion",
                     "train.step_fusion", "train.eval_fusion")


class ReportError(ValueError):
  """A workdir cannot be reported (not a run, unreadable files)."""


@dataclasses.dataclass(frozen=True)
class Run:
  """The outputs of one seed of one run."""

  path: str
  config: dict
  records: tuple[dict, ...]
  summary: dict | None  # None: the run has not finished

  @functools.cached_property
  def flat(self) -> dict:
    """The config as {"a.b.c": value} (read, never changed: a report asks for it often)."""
    return wd.flatten(self.config)

  @property
  def finished(self) -> bool:
    return self.summary is not None

  def curve(self, field: str = "test_error") -> np.ndarray:
    return np.asarray([float(r[field]) for r in self.records])


# -- loading -----------------------------------------------------------------------------------
_PLAIN_NUMBERS = frozenset((int, float, bool))  # what JSON reads; checked first, as it is fast


def _is_number(v: Any) -> bool:
  return type(v) in _PLAIN_NUMBERS or isinstance(v, numbers.Real)  # bools too: `trained`


def _read_json(path: str) -> dict:
  try:
    obj = io_utils.read_json(path)
  except (OSError, ValueError) as e:
    raise ReportError(f"{path} cannot be read: {e}") from e
  if not isinstance(obj, dict):
    raise ReportError(f"{path} is not a run's output: it holds a JSON {type(obj).__name__}, not "
                      "an object")
  return obj


# Config fields the report reads as numbers (grouping, sorting, labels).
_NUMERIC_CONFIG = ("seed",) + KEY_FIELDS[1:]
# Summary fields of the table (a run's own summary.json holds numbers there).
_SUMMARY_STATS = ("cer_percent", "final_error", "mem", "comp_paper", "comp", "comp_total",
                  "comp_paper_total", "wall_s", "final_perplexity", "mean_perplexity")


def with_totals(summary: dict | None) -> dict | None:
  """`summary` with `comp_total` and `comp_paper_total` (training, growth's passes over data and
  a waiting policy's evaluations) for a run written before the summary carried them: FLOPs as
  `comp` + `comp_growth`; multiply-adds as `comp_paper` where growth ran no pass, else nan (the
  older records do not count growth's multiply-adds)."""
  if summary is None or not all(k in summary for k in ("comp", "comp_paper")):
    return summary
  out = dict(summary)
  growth = float(out.get("comp_growth", 0.0))
  out.setdefault("comp_total", float(out["comp"]) + growth)
  out.setdefault("comp_paper_total", float(out["comp_paper"]) if growth == 0 else math.nan)
  return out


def _not_numbers(values: dict | None, fields: Sequence[str]) -> str | None:
  """The first of `fields` that `values` holds as something other than a number (None: none)."""
  return next((k for k in fields if values and values.get(k) is not None
               and not _is_number(values[k])), None)


def _check_seed(path: str, config: dict, records, summary) -> None:
  """Raises `ReportError` naming the file whose contents are not a run's."""
  flat = wd.flatten(config)
  bad = _not_numbers(flat, _NUMERIC_CONFIG)
  if bad:
    raise ReportError(f"{os.path.join(path, wd.CONFIG_FILE)}: {bad}={flat[bad]!r} is not a number")
  log = os.path.join(path, wd.LOG_FILE)
  for i, r in enumerate(records):
    # Numbers, and the text of a waiting policy's decision (`wait_decision`, `wait_reason`).
    if not (isinstance(r, dict) and {"t", "test_error"} <= set(r)
            and _is_number(r["t"]) and _is_number(r["test_error"])
            and all(_is_number(v) or isinstance(v, str) for v in r.values())):
      raise ReportError(f"{log}: record {i + 1} ({json.dumps(r)[:80]}) is not a run's record (a "
                        "JSON object of numbers and texts with the numbers 't' and "
                        "'test_error')")
  bad = _not_numbers(summary, _SUMMARY_STATS)
  if bad:
    raise ReportError(f"{os.path.join(path, wd.SUMMARY_FILE)}: {bad}={summary[bad]!r} is "
                      "not a number")


# Fields of a several-seed run's own summary that hold for each of its seeds: the speed choices
# made once for the programs that trained them all. (Its timings are the process's, not a seed's.)
_RUN_FIELDS = ("choices",)


def _with_run_fields(seed: Run, run_summary: dict | None) -> Run:
  """`seed`, a seed of a several-seed run whose own summary is `run_summary` (None: not
  written), with the `_RUN_FIELDS` of that summary where the seed's lacks them (seeds'
  summaries written before they carried them)."""
  if seed.summary is None or run_summary is None:
    return seed
  missing = {k: run_summary[k] for k in _RUN_FIELDS if k in run_summary and k not in seed.summary}
  return dataclasses.replace(seed, summary=dict(seed.summary, **missing)) if missing else seed


def _read_seed(path: str) -> Run:
  config = _read_json(os.path.join(path, wd.CONFIG_FILE))
  try:
    records = tuple(io_utils.read_jsonl(os.path.join(path, wd.LOG_FILE)))
  except (OSError, ValueError) as e:
    raise ReportError(f"{os.path.join(path, wd.LOG_FILE)} cannot be read: {e}") from e
  summary_path = os.path.join(path, wd.SUMMARY_FILE)
  summary = _read_json(summary_path) if os.path.exists(summary_path) else None
  _check_seed(path, config, records, summary)
  summary = with_totals(summary)
  return Run(path, config, records, summary)


def load_runs(path: str) -> list[Run]:
  """The seeds of the run in `path` (one, or those of its `seed_<k>/` folders)."""
  if not os.path.isdir(path):
    raise ReportError(f"--workdirs: {path} is not a directory")
  seeds = wd.output_dirs(path)[1:]
  if seeds and os.path.exists(os.path.join(path, wd.CONFIG_FILE)):
    summary_path = os.path.join(path, wd.SUMMARY_FILE)
    run_summary = _read_json(summary_path) if os.path.exists(summary_path) else None
    return [_with_run_fields(_read_seed(s), run_summary) for s in seeds]
  missing = [n for n in (wd.CONFIG_FILE, wd.LOG_FILE) if not os.path.exists(os.path.join(path, n))]
  if missing:
    raise ReportError(f"--workdirs: {path} is not a run's workdir: it lacks {' and '.join(missing)}"
                      " (a run writes config.json and log.jsonl when it starts)")
  return [_read_seed(path)]


# -- groups: runs that differ only by their seed -------------------------------------------------
def group_key(run: Run) -> str:
  ignore = set(SEED_FIELDS) | set(config_lib.resumable_paths())
  return json.dumps({k: v for k, v in run.flat.items() if k not in ignore}, sort_keys=True,
                    default=repr)


@dataclasses.dataclass(frozen=True)
class Group:
  """Runs of one config that differ only by their seed."""

  runs: tuple[Run, ...]

  @property
  def flat(self) -> dict:
    return self.runs[0].flat

  def get(self, field: str, default: Any = None) -> Any:
    return self.flat.get(field, default)

  @property
  def dataset(self) -> str:
    return str(self.get("data.name", "data"))

  @property
  def finished(self) -> tuple[Run, ...]:
    return tuple(r for r in self.runs if r.finished)

  @property
  def seeds(self) -> list[int]:
    return [int(r.flat.get("seed", 0)) for r in self.runs]

  def values(self, field: str) -> list[float]:
    """Summary `field` of the finished seeds that have it."""
    return [float(r.summary[field]) for r in self.finished if field in r.summary]

  def stat(self, field: str) -> tuple[float, float]:
    """(mean, standard deviation) of summary `field` over the finished seeds (nan: none)."""
    vals = self.values(field)
    if not vals:
      return math.nan, math.nan
    return plots.mean_std(vals)

  def curve(self, field: str = "test_error") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t, mean, std) of a per-step field over the seeds, up to the shortest log."""
    runs = [r for r in self.runs if r.records and field in r.records[0]]
    if not runs:
      return np.zeros(0), np.zeros(0), np.zeros(0)
    curves = [r.curve(field) for r in runs]
    n = min(len(c) for c in curves)
    t = np.asarray([int(r["t"]) for r in runs[0].records[:n]])
    return (t,) + plots.mean_std_columns([c[:n] for c in curves])

  def label(self, fields: Sequence[str]) -> str:
    """The values of `fields` that this group has (another method's fields are left out)."""
    return " ".join(_fmt(self.get(f)) if f == "method.name" else
                    f"{f.split('.')[-1]}={_fmt(self.get(f))}" for f in fields
                    if self.get(f) is not None)


def _fmt(v: Any) -> str:
  return "–" if v is None else labels_lib.value_text(v)  # None: a field of another method


def group_runs(runs: Sequence[Run]) -> list[Group]:
  by_key: dict[str, list[Run]] = collections.OrderedDict()
  for r in runs:
    by_key.setdefault(group_key(r), []).append(r)
  groups = [Group(tuple(sorted(rs, key=lambda r: int(r.flat.get("seed", 0)))))
            for rs in by_key.values()]
  return sorted(groups, key=lambda g: tuple(str(g.get(f)) for f in ("data.name", "method.name"))
                + tuple(float(g.get(f) or 0) for f in KEY_FIELDS[1:]))


def varying_fields(groups: Sequence[Group]) -> list[str]:
  """KEY_FIELDS plus the other config fields whose values differ between groups."""
  if not groups:
    return list(KEY_FIELDS)
  keys = (set().union(*(g.flat for g in groups)) - set(SEED_FIELDS) - set(UNLABELLED_FIELDS)
          - set(config_lib.resumable_paths()))
  def differs(k):  # among the groups that have the field (methods declare their own)
    return len({json.dumps(g.flat[k], default=repr) for g in groups if k in g.flat}) > 1
  other = sorted(k for k in keys - set(KEY_FIELDS) if differs(k))
  return list(KEY_FIELDS) + other


# -- the table -----------------------------------------------------------------------------------
TABLE_STATS = (("cer_percent", "CER (%)", "{:.2f}"), ("final_error", "final error", "{:.4f}"),
               ("mem", "Mem", "{:.4g}"),
               ("comp_paper_total", "Comp (TFLOPs, paper count, all work)", "{:.4g}"),
               ("comp_total", "Comp (TFLOPs, train steps and growth)", "{:.4g}"),
               ("wall_s", "wall (s)", "{:.1f}"))
_TERA = ("comp_paper", "comp", "comp_paper_total", "comp_total")


def _cell(group: Group, field: str, fmt: str) -> str:
  mean, std = group.stat(field)
  if math.isnan(mean):
    return "–"
  scale = 1e-12 if field in _TERA else 1.0
  text = fmt.format(mean * scale)
  return text + (" ± " + fmt.format(std * scale) if len(group.values(field)) > 1 else "")


def table(groups: Sequence[Group]) -> str:
  """A Markdown table: one row per group, mean ± std over its finished seeds."""
  fields = varying_fields(groups)
  # The tasks' own fields (language models: perplexities), columns only where a group has them.
  stats = TABLE_STATS + tuple(s for s in plugins.summary_stats()
                              if any(not math.isnan(g.stat(s[0])[0]) for g in groups))
  head = ["data"] + [f.split(".")[-1] if f in KEY_FIELDS else f for f in fields] + ["seeds"]
  head += [name for _, name, _ in stats]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for g in groups:
    n_done = len(g.finished)
    seeds = f"{n_done}" if n_done == len(g.runs) else f"{n_done} of {len(g.runs)} finished"
    cells = [g.dataset] + [_fmt(g.get(f)) for f in fields] + [seeds]
    cells += [_cell(g, f, fmt) for f, _, fmt in stats]
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows) + "\n"


# -- results.csv -----------------------------------------------------------------------------------
RESULTS_CSV = "results.csv"


def _csv_value(v: Any) -> Any:
  if v is None:
    return ""
  return json.dumps(v, sort_keys=True, default=repr) if isinstance(v, (list, tuple, dict)) else v


def results_csv(groups: Sequence[Group]) -> str:
  """The text of results.csv: one row per run and seed with its workdir, whether it finished,
  its config fields (sorted paths) and its summary metrics (in summary order; empty for an
  unfinished run)."""
  runs = [r for g in groups for r in g.runs]
  config_cols = sorted(set().union(*(r.flat for r in runs)))
  metric_cols = list(dict.fromkeys(k for r in runs for k in wd.flatten(r.summary or {})
                                   if k not in config_cols))
  text = io.StringIO()
  writer = csv.DictWriter(text, ["workdir", "finished", findings_lib.GROUP_COLUMN] + config_cols
                          + metric_cols, lineterminator="\n")
  writer.writeheader()
  for g in groups:
    for r in g.runs:
      writer.writerow(_csv_row(r, group_id(g), config_cols))
  return text.getvalue()


def group_id(group: "Group") -> str:
  """10 hex digits naming a group: its config less the seed (`group_key`)."""
  return hashlib.sha256(group_key(group.runs[0]).encode()).hexdigest()[:10]


def _csv_row(r: Run, group: str, config_cols) -> dict:
  row = {"workdir": r.path, "finished": r.finished, findings_lib.GROUP_COLUMN: group}
  row.update((k, _csv_value(v)) for k, v in r.flat.items())
  row.update((k, _csv_value(v)) for k, v in wd.flatten(r.summary or {}).items()
             if k not in config_cols)
  return row


# -- results.csv read back ------------------------------------------------------------------------
def _csv_cell(text: str) -> Any:
  """A value of results.csv as the run's JSON held it (`_csv_value` wrote it): "" is None,
  True and False, JSON for lists and dicts, then an int, a float, else the text."""
  if text == "":
    return None
  if text in ("True", "False"):
    return text == "True"
  if text[0] in "[{":
    try:
      return json.loads(text)
    except ValueError:
      return text
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def _nest(flat: dict) -> dict:
  """{"a.b": v} -> {"a": {"b": v}} (the inverse of `wd.flatten`)."""
  out: dict = {}
  for path, value in flat.items():
    *parents, leaf = path.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def results_groups(text: str, path: str) -> list[Group]:
  """The groups of the runs in `text`, a `results.csv` that a report wrote (read from `path`,
  which errors name): a row per seed, its config from the columns under the config's sections
  (`findings.config_columns`) and, where it finished, its summary from the others; no
  records, so only what the summaries give can be drawn from them
  (`plots.SUMMARY_FIGURES`)."""
  try:
    rows = list(csv.DictReader(io.StringIO(text)))
  except csv.Error as e:
    raise ReportError(f"--results={path} cannot be read: {e}") from e
  head = list(rows[0]) if rows else []
  missing = [c for c in ("workdir", "finished", "method.name", "data.name") if c not in head]
  if not rows or missing:
    raise ReportError(f"--results={path} is not a report's results.csv: " +
                      ("it has no rows" if not rows else f"it has no {', '.join(missing)} "
                       "column" + "s" * (len(missing) > 1)))
  config_cols = set(findings_lib.config_columns(head))
  skip = config_cols | {"workdir", "finished", findings_lib.GROUP_COLUMN}
  runs = []
  for i, row in enumerate(rows, start=2):
    if None in row or None in row.values():  # more or fewer cells than the header has
      raise ReportError(f"--results={path}: line {i} does not have the header's {len(head)} "
                        "cells")
    config = _nest({c: _csv_cell(v) for c, v in row.items() if c in config_cols and v != ""})
    summary = _nest({c: _csv_cell(v) for c, v in row.items() if c not in skip and v != ""})
    bad = _not_numbers(wd.flatten(config), _NUMERIC_CONFIG) or _not_numbers(summary,
                                                                            _SUMMARY_STATS)
    if bad:
      raise ReportError(f"--results={path}: line {i}: {bad}={row[bad]!r} is not a number")
    runs.append(Run(row["workdir"], config, (),
                    with_totals(summary) if row["finished"] == "True" else None))
  return group_runs(runs)


# -- the whole report ----------------------------------------------------------------------------
def run_identity(run: Run) -> str:
  """What a run computes: its config less the fields that do not change its records
  (`group_key`), and its seed. Two folders with one identity hold the same run (a copy, or the
  same config and seed run twice) and count once."""
  return json.dumps([group_key(run), run.flat.get("seed", 0)], default=repr)


def load_groups(workdirs: Sequence[str]) -> list[Group]:
  """The groups of the runs in `workdirs`; a run given twice (a repeated or linked folder, or a
  seed folder of a run also given) counts once, with a warning, and so does a run whose config
  and seed another folder already holds (a copy: it is not another seed)."""
  runs, seen, identities = [], {}, {}
  for path in workdirs:
    for r in load_runs(path):
      real = os.path.realpath(r.path)
      if real in seen:
        same = "" if seen[real] == r.path else f" (the run {seen[real]})"
        logging.warning("--workdirs: %s%s is given more than once; it counts once", r.path, same)
        continue
      seen[real] = r.path
      identity = run_identity(r)
      if identity in identities:
        logging.warning("--workdirs: %s holds the same config and seed (%s) as %s: the same run, "
                        "not another seed; it counts once, as %s", r.path,
                        r.flat.get("seed", 0), identities[identity], identities[identity])
        continue
      identities[identity] = r.path
      runs.append(r)
  if not runs:
    raise ReportError("--workdirs: no runs given")
  return group_runs(runs)


def gating_figures(groups: Sequence[Group], out: str,
                   fields: Sequence[str] = KEY_FIELDS) -> dict:
  """`gating_<workdir name>` of the first seed of every gMoE group, titled with its values of
  `fields` (a run that cannot be drawn, e.g. without checkpoints, is skipped with a
  warning)."""
  # Restoring a run's learner takes JAX: imported here, so that a report without gating
  # figures starts without it.
  from alma_jax.outputs import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from alma_jax.reports import gating_plot  # pylint: disable=g-import-not-at-top
  figures = {}
  for g in groups:
    if g.get("method.name") != "gmoe":
      continue
    run = g.runs[0]
    name = f"gating_{os.path.basename(os.path.normpath(run.path))}"
    try:
      data = gating_plot.gating_data(run.path)
    except (gating_plot.GatingError, ckpt_lib.CheckpointError) as e:
      logging.warning("no gating figure of %s: %s", run.path, e)
      continue
    figures[name] = gating_plot.draw(data, os.path.join(out, name), g.label(fields))
  return figures


NO_FIGURES = ("no figures: drawing them needs matplotlib, which is not installed (pip install "
              "'alma-jax[report]', or pip install matplotlib); the table and results.csv are "
              "complete")


def can_draw() -> bool:
  """Whether matplotlib, which the figures need, can be imported."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def write_report(workdirs: Sequence[str], out: str, *, gating: bool = True,
                 findings: Sequence[dict] = (), results: str | None = None) -> dict:
  """Writes the figures, `results.csv` and `report.md` into `out`; returns {figure name: its
  plotted data}. `findings` (a grid file's FINDINGS, `alma_jax.reports.findings`) adds their
  verdicts, computed from the rows of `results.csv`, to `report.md`. With `results` (a
  `results.csv` that a report wrote) instead of `workdirs`: the figures that its rows give
  (`plots.SUMMARY_FIGURES`) and `report.md`, from those rows alone."""
  if not out:
    raise ReportError("--out is empty; give the directory for the figures and report.md")
  if os.path.exists(out) and not os.path.isdir(out):
    raise ReportError(f"--out={out} exists and is not a directory")
  if results is not None and workdirs:
    raise ReportError("give --workdirs or --results, not both")
  csv_text = _results_text(results) if results is not None else None
  groups = (results_groups(csv_text, results) if results is not None
            else load_groups(workdirs))
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise ReportError(f"--out={out} cannot be created: {e.strerror or e}") from e
  figures = {}
  by_data = collections.OrderedDict()
  for g in groups:
    by_data.setdefault(g.dataset, []).append(g)
  source = (f"[{RESULTS_CSV}]({RESULTS_CSV}) holds one row per run and seed: its config fields "
            "and summary metrics." if results is None else
            f"Drawn from `{results}` alone (one row per run and seed: its config fields and "
            "summary metrics): the figures over t and the gating trees need the runs' folders "
            "(`--workdirs`).")
  text = ["# ALMA report", "", f"{sum(len(g.runs) for g in groups)} runs in {len(groups)} "
          "groups (runs that differ only by their seed); mean ± sample standard deviation "
          "(ddof=1) over seeds. Comp (paper count) counts forward multiply-adds × examples, the "
          "unit of the paper's figures, of all the learner's work: training, growth's passes over "
          "data and a waiting policy's evaluations (`comp_paper_total`; `comp_total` counts the "
          f"same work in FLOPs of the compiled steps). {source}", ""]
  csv_text = results_csv(groups) if results is None else csv_text
  if findings:
    try:
      found = findings_lib.evaluate(findings_lib.read_rows(csv_text), findings)
    except findings_lib.FindingsError as e:
      raise ReportError(str(e)) from e
    text += ["## Findings", "", f"Verdicts computed from [{RESULTS_CSV}]({RESULTS_CSV}) by "
             "`alma_jax.reports.findings`: Welch's t over the seeds (sample standard "
             f"deviations), a difference clear when |t| > {findings_lib.CLEAR_T:g}; a finding "
             "is *reproduced* when every comparison is clear in the paper's direction, *partly* "
             "when some are and the rest point its way, *not reproduced* when others point "
             "against it, *against* when a clear difference goes against it and none its way, "
             "*not shown* when no difference is clear.", "", findings_lib.table(found)]
  drawing = can_draw()
  if not drawing:
    logging.warning(NO_FIGURES)
    text += [f"*{NO_FIGURES}*", ""]
  for data, gs in by_data.items():
    fields = varying_fields(gs)
    drawn = (plots.dataset_figures(data, gs, fields, out, over_t=results is None) if drawing
             else {})
    if gating and drawing and results is None:
      drawn.update(gating_figures(gs, out, fields))
    figures.update(drawn)
    text += [f"## {data}", "", table(gs)] + [f"![{name}]({name}.png)\n" for name in drawn]
  written = [("report.md", "\n".join(text))]
  for name, content in ([(RESULTS_CSV, csv_text)] if results is None else []) + written:
    try:
      io_utils.write_text_atomic(os.path.join(out, name), content)
    except (OSError, io_utils.WorkdirWriteError) as e:
      why = (os.strerror(e.errno) if isinstance(e, io_utils.WorkdirWriteError)
             else e.strerror or e)
      raise ReportError(f"--out={out}: cannot write {name}: {why}") from e
  return figures


def _results_text(results: str) -> str:
  """The text of the results.csv that `--results` names, or of several, comma-separated (a
  grid run in parts: `findings.read_parts`), joined as one file's."""
  if "," not in results:
    return _read_text(results)
  try:
    rows = findings_lib.read_parts(results)
  except findings_lib.FindingsError as e:
    raise ReportError(str(e)) from e
  text = io.StringIO()
  writer = csv.DictWriter(text, list(rows[0]), lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  return text.getvalue()


def _read_text(path: str) -> str:
  try:
    with open(path, newline="") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ReportError(f"--results={path} cannot be read: {getattr(e, 'strerror', None) or e}"
                      ) from e


FLAGS = flags.FLAGS
flags.DEFINE_list("workdirs", None, "run workdirs (comma-separated; shell globs expand to several)")
flags.DEFINE_string("results", None, "instead of --workdirs: a results.csv that a report wrote "
                    "(comma-separated: the parts of a grid run in parts); draws the figures its "
                    "rows give (CER against compute, memory and the wait, replay, policies) and "
                    "report.md, without the runs' folders")
flags.DEFINE_string("out", None, "output directory of the figures and report.md")
flags.DEFINE_bool("gating", True, "draw the gating tree of gMoE runs from their last checkpoint")
flags.DEFINE_string("findings", None, "a grid file whose FINDINGS get verdicts in report.md "
                    "(e.g. launch/grids/findings.py)")


def expand_workdirs(items: Sequence[str]) -> list[str]:
  """`items` with each pattern (`*`, `?`, `[`) replaced by the run workdirs it matches, in
  order; a pattern that matches no run is kept, so that the error names it."""
  out = []
  for item in items:
    if not glob.has_magic(item):
      out.append(item)
      continue
    runs = [d for d in sorted(glob.glob(item))
            if os.path.isfile(os.path.join(d, wd.CONFIG_FILE))]
    out.extend(runs or [item])
  return out


def check_matched(workdirs: Sequence[str]) -> None:
  """A `ReportError` naming the first pattern that `expand_workdirs` kept in `workdirs`
  because it matched no run."""
  for item in workdirs:
    if glob.has_magic(item) and not os.path.isdir(item):
      raise ReportError(f"--workdirs: {item} matches no run's workdir (a folder with "
                        f"{wd.CONFIG_FILE})")


def _fail(message: str) -> None:
  """Ends the command with one line on stderr and exit code 2 (a bad input)."""
  print(f"report: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  sys.exit(2)


def main(argv):
  log_lines.plain()
  workdirs = expand_workdirs(list(FLAGS.workdirs or []) +
                             [a for a in argv[1:] if not a.startswith("-")])
  if (not workdirs and FLAGS.results is None) or FLAGS.out is None:
    _fail("give --workdirs=DIR[,DIR...] (or directories as arguments), or --results=FILE "
          "(a results.csv that a report wrote), and --out=DIR")
  try:
    check_matched(workdirs)
    found = findings_lib.load_findings(FLAGS.findings, "--findings") if FLAGS.findings else ()
    figures = write_report(workdirs, FLAGS.out, gating=FLAGS.gating, findings=found,
                           results=FLAGS.results)
  except (ReportError, findings_lib.FindingsError) as e:
    _fail(str(e))
  print(f"wrote {os.path.join(FLAGS.out, 'report.md')} and {len(figures)} figures")


def _parse_flags(argv):
  """absl's parse, with a flag it refuses said in one line (exit code 2) with the flags."""
  try:
    return errors.help_succeeds(FLAGS, argv)
  except flags.Error as e:
    _fail(f"{errors.flag_error(e).rstrip('.')}; the flags: --workdirs, --results, --out, "
          "--gating, --findings (--helpshort says what they take)")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
