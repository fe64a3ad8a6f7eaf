"""Verdicts on the paper's findings, computed from the per-seed rows of `results.csv`.

A grid file (`launch/grids/findings.py`) names, next to its points, the
findings it tests as `FINDINGS`: a list of dicts

  {"id": "F2", "claim": "bigger models have a lower CER",
   "metric": "cer_percent",                      # lower is better
   "comparisons": [{"better": {"model.width": 16, ...}, "worse": {"model.width": 4, ...}},
                   ...]}

Each comparison states the paper's direction: the group that `better`
selects has a lower `metric` than the group that `worse` selects. A selector
is a dict of config fields (flattened paths) and values; it must pick out
exactly one group of `results.csv` (the runs that differ only by their seed,
its `group` column). A comparison may set its own `metric`, and `better` may
be a list of selectors: with `"within": "comp_total"` (or another summary
field) the candidates whose mean `comp_total` does not exceed that of `worse`
are eligible, and `"pick"` says which of them is compared: `"most"` (the
default), the one spending most (a fixed model against a growing one at no
more compute), or `"best"`, the one with the lowest mean metric (is any
cheaper choice at least as good?). Without `within`, the candidate with the
lowest mean metric is compared (the best of
the intermediate waits against an extreme one: a choice made on the same
seeds, which favours the paper's side a little, and the table says so).

Each comparison gets Welch's t over the seeds (sample standard deviations,
ddof=1): t = (mean_worse - mean_better) / sqrt(s_b^2/n_b + s_w^2/n_w),
positive when the paper's direction holds. It is *clear* when |t| > 3. A
finding's verdict, from its comparisons:

* `reproduced`: every comparison clear in the paper's direction;
* `partly`: some clear in its direction, none against, the rest in its
  direction without being clear, equal or missing;
* `not reproduced`: some clear in its direction, and others against it
  (clear or not);
* `against`: some clear against the paper, none clear in its direction;
* `not shown`: no clear difference (or groups missing from the results).

A comparison whose two means are equal (both sides without spread, e.g. no
dormant unit left under either) is `equal`: neither for the paper nor against.

  python -m alma_jax.reports.findings --results=results.csv --grid_file=launch/grids/findings.py
  python -m alma_jax.reports.findings --results=seed0/results.csv,seeds12/results.csv \
      --grid_file=launch/grids/findings.py

prints the table that the report writes into `report.md`. `--results` takes several files,
comma-separated, for a grid run in parts (`read_parts`: seed 0 at one commit, seeds 1 and 2
at another), whose rows are read as one file's.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import sys
from typing import Any, Iterable, Mapping, Sequence

from alma_jax import errors
from alma_jax.configuration import config_lib
from alma_jax.reports import grid_files
from alma_jax.reports import labels as labels_lib

CLEAR_T = 3.0
VERDICTS = ("reproduced", "partly", "not reproduced", "against", "not shown")
# Outcomes of one comparison.
CLEAR_FOR, FOR, AGAINST, CLEAR_AGAINST, EQUAL, MISSING = (
    "clear, as the paper", "as the paper, not clear", "against, not clear",
    "clear, against the paper", "equal", "missing")
GROUP_COLUMN = "group"


class FindingsError(ValueError):
  """A finding's specification does not fit the results (an ambiguous selector, a bad field)."""


@dataclasses.dataclass(frozen=True)
class Side:
  """One compared group: its label and the finished seeds' values of the metric."""

  label: str
  values: tuple[float, ...]

  @property
  def n(self) -> int:
    return len(self.values)

  @property
  def mean(self) -> float:
    return math.fsum(self.values) / self.n if self.values else math.nan

  @property
  def std(self) -> float:
    """Sample standard deviation (ddof=1); nan below two seeds."""
    if self.n < 2:
      return math.nan
    m = self.mean
    return math.sqrt(math.fsum((v - m) ** 2 for v in self.values) / (self.n - 1))

  def text(self, fmt: str = "{:,.4g}") -> str:
    if not self.values:
      return f"{self.label}: no finished run"
    spread = f" ± {fmt.format(self.std)}" if self.n > 1 else ""
    return f"{self.label}: {fmt.format(self.mean)}{spread} (n={self.n})"


@dataclasses.dataclass(frozen=True)
class Comparison:
  metric: str
  better: Side | None  # None: no group matched
  worse: Side | None
  t: float
  outcome: str
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Finding:
  id: str
  claim: str
  comparisons: tuple[Comparison, ...]
  verdict: str


def welch_t(better: Sequence[float], worse: Sequence[float]) -> float:
  """(mean(worse) - mean(better)) / its standard error, sample variances (ddof=1).

  nan when a side has fewer than two values; +-inf when both sides have no
  spread and different means; 0 when they have neither spread nor difference.
  """
  a, b = Side("", tuple(better)), Side("", tuple(worse))
  if a.n < 2 or b.n < 2:
    return math.nan
  diff = b.mean - a.mean
  se = math.sqrt(a.std ** 2 / a.n + b.std ** 2 / b.n)
  if se == 0.0:
    return 0.0 if diff == 0.0 else math.copysign(math.inf, diff)
  return diff / se


def outcome(t: float, better: Side, worse: Side) -> str:
  """The comparison's outcome; with too few seeds for t, the sign of the mean difference."""
  if worse.mean == better.mean:
    return EQUAL
  if math.isnan(t):
    return FOR if worse.mean > better.mean else AGAINST
  if t > CLEAR_T:
    return CLEAR_FOR
  if t < -CLEAR_T:
    return CLEAR_AGAINST
  return FOR if t > 0 else AGAINST


def verdict(outcomes: Iterable[str]) -> str:
  """A finding's verdict from its comparisons' outcomes (the rule in the module docstring); a
  comparison whose groups are missing counts as not clear."""
  outcomes = list(outcomes)
  clear_for = outcomes.count(CLEAR_FOR)
  if clear_for:
    if clear_for == len(outcomes):
      return "reproduced"
    return "not reproduced" if AGAINST in outcomes or CLEAR_AGAINST in outcomes else "partly"
  return "against" if CLEAR_AGAINST in outcomes else "not shown"


# -- rows of results.csv --------------------------------------------------------------------------
def _norm(v: Any) -> Any:
  """A value of a selector or of a CSV cell, comparable across the two (4 == "4" == "4.0")."""
  if isinstance(v, bool):
    return v
  if isinstance(v, (int, float)):
    return float(v)
  if isinstance(v, str):
    if v in ("True", "False"):
      return v == "True"
    try:
      return float(v)
    except ValueError:
      pass
    if v[:1] in "[{":
      try:
        return json.dumps(json.loads(v), sort_keys=True)
      except ValueError:
        return v
    return v
  if isinstance(v, (list, tuple, dict)):
    return json.dumps(v, sort_keys=True)
  return v


def read_rows(text: str) -> list[dict]:
  """The rows of a `results.csv` text."""
  return list(csv.DictReader(io.StringIO(text)))


def _groups(rows: Sequence[Mapping[str, str]]) -> dict[str, list[Mapping[str, str]]]:
  if rows and GROUP_COLUMN not in rows[0]:
    raise FindingsError(f"results.csv has no '{GROUP_COLUMN}' column (written by the report "
                        "since verdicts are computed): regenerate it with "
                        "`python -m alma_jax.reports.report`")
  out: dict[str, list] = {}
  for r in rows:
    out.setdefault(r[GROUP_COLUMN], []).append(r)
  return out


def _describe(selector: Mapping[str, Any], row: Mapping[str, Any]) -> str:
  """The label of the group that `selector` picked (`row`: one of its rows)."""
  return labels_lib.label({**row, **selector}, list(selector))


def _select(groups, selector: Mapping[str, Any], finding: str) -> tuple[str, list] | None:
  """(label, rows) of the one group all of whose rows match `selector`; None: no group."""
  if not isinstance(selector, Mapping) or not selector:
    raise FindingsError(f"finding {finding}: a selector must be a non-empty dict of config "
                        f"fields, got {selector!r}")
  want = {k: _norm(v) for k, v in selector.items()}
  found = [(g, rows) for g, rows in groups.items()
           if all(k in r and _norm(r[k]) == v for r in rows for k, v in want.items())]
  if len(found) > 1:
    differ = sorted(k for k in found[0][1][0] if k not in want and k not in (
        "workdir", "finished", GROUP_COLUMN, "seed", "num_seeds")
                    and len({_norm(rows[0].get(k)) for _, rows in found}) > 1)
    raise FindingsError(f"finding {finding}: the selector {dict(selector)} matches "
                        f"{len(found)} groups; they differ in {differ[:6]}: add one of these "
                        "fields to it")
  return (_describe(selector, found[0][1][0]), found[0][1]) if found else None


def _finished(picked) -> list[Mapping[str, str]]:
  """The rows of a picked group whose runs finished (the rest are left out everywhere)."""
  return [r for r in picked[1] if str(r.get("finished")) == "True"]


def cell_number(row: Mapping[str, str], field: str, what: str) -> float:
  """The number in `row`'s cell of `field`; `FindingsError` (starting with `what`, naming the
  run) where it holds something else."""
  cell = row.get(field)
  try:
    return float(cell)
  except (TypeError, ValueError):
    raise FindingsError(f"{what}: {field}={cell!r} of {row.get('workdir')} in results.csv is "
                        "not a number") from None


def _side(picked, metric: str, finding: str) -> Side | None:
  """The finished seeds' values of `metric` in a picked group; every one must have a value: a
  missing or nan value would count as a difference from the paper."""
  if picked is None:
    return None
  values = []
  for r in _finished(picked):
    if r.get(metric, "") in ("", None):
      raise FindingsError(f"finding {finding}: results.csv has no value of {metric!r} for "
                          f"{r.get('workdir')}")
    value = cell_number(r, metric, f"finding {finding}")
    if math.isnan(value):
      raise FindingsError(f"finding {finding}: {metric}=nan of {r.get('workdir')} in "
                          "results.csv: a comparison needs a number for every finished seed")
    values.append(value)
  return Side(picked[0], tuple(values))


def _mean_of(picked, field: str, finding: str) -> float:
  vals = [cell_number(r, field, f"finding {finding}") for r in _finished(picked)
          if r.get(field) not in ("", None)]
  return math.fsum(vals) / len(vals) if vals else math.nan


PICKS = ("most", "best")  # within a budget: the candidate spending most, or the best one


def _lowest(scored):
  """The pick whose score is lowest, of (score, pick) pairs; NaN scores never win."""
  scored = [(s, p) for s, p in scored if not math.isnan(s)]
  return min(scored, key=lambda sp: sp[0])[1] if scored else None


def compare(groups, spec: Mapping[str, Any], metric: str, finding: str) -> Comparison:
  metric = spec.get("metric", metric)
  unknown = set(spec) - {"better", "worse", "metric", "within", "pick", "note"}
  if unknown or "better" not in spec or "worse" not in spec:
    raise FindingsError(f"finding {finding}: a comparison has the keys better, worse and "
                        f"optionally metric, within, pick, note; got {sorted(spec)}")
  within, pick = spec.get("within"), spec.get("pick", "most")
  if pick not in PICKS or ("pick" in spec and not within):
    raise FindingsError(f"finding {finding}: pick is one of {list(PICKS)} and needs within; "
                        f"got pick={spec.get('pick')!r}, within={within!r}")
  worse_pick = _select(groups, spec["worse"], finding)
  notes = [spec["note"]] if spec.get("note") else []
  candidates = spec["better"] if isinstance(spec["better"], (list, tuple)) else [spec["better"]]
  picks = [p for p in (_select(groups, c, finding) for c in candidates) if p is not None]
  if within:
    budget = _mean_of(worse_pick, within, finding) if worse_pick else math.nan
    fit = [p for p in picks if _mean_of(p, within, finding) <= budget]
    if pick == "most":
      better_pick = _lowest((-_mean_of(p, within, finding), p) for p in fit)
    else:
      better_pick = _lowest((_mean_of(p, metric, finding), p) for p in fit)
    if better_pick is not None:
      spent = f"{_mean_of(better_pick, within, finding):.3g} vs {budget:.3g}"
      notes.append(f"the best of {len(fit)} within {within}: {spent}" if pick == "best"
                   else f"{within} {spent}")
    elif picks and worse_pick:
      notes.append(f"no candidate within {within} {budget:.3g}")
  elif len(candidates) > 1:  # the best of the candidates
    better_pick = _lowest((_mean_of(p, metric, finding), p) for p in picks)
    if len(picks) > 1 and better_pick is not None:
      notes.append(f"the best of {len(picks)}")
  else:
    better_pick = picks[0] if picks else None
  note = "; ".join(notes)
  better, worse = _side(better_pick, metric, finding), _side(worse_pick, metric, finding)
  if better is None or worse is None or not better.values or not worse.values:
    return Comparison(metric, better, worse, math.nan, MISSING, note)
  t = welch_t(better.values, worse.values)
  return Comparison(metric, better, worse, t, outcome(t, better, worse), note)


def evaluate(rows: Sequence[Mapping[str, str]], findings: Sequence[Mapping[str, Any]]
             ) -> list[Finding]:
  """Every finding's comparisons and verdict from the rows of `results.csv`."""
  groups = _groups(rows)
  out = []
  for f in findings:
    fid = str(f.get("id", "?"))
    if not f.get("comparisons"):
      raise FindingsError(f"finding {fid}: it has no comparisons")
    comps = tuple(compare(groups, c, f.get("metric", "cer_percent"), fid)
                  for c in f["comparisons"])
    out.append(Finding(fid, str(f.get("claim", "")), comps, verdict(c.outcome for c in comps)))
  return out


def _t_text(t: float) -> str:
  if math.isnan(t):
    return "–"
  return f"{t:+.1f}" if math.isfinite(t) else ("+∞" if t > 0 else "−∞")


def table(found: Sequence[Finding]) -> str:
  """Markdown: a verdict per finding, then one row per comparison."""
  lines = ["| finding | claim | verdict |", "|---|---|---|"]
  lines += [f"| {f.id} | {f.claim} | **{f.verdict}** |" for f in found]
  lines += ["", "| finding | metric | paper: lower | paper: higher | Welch t | outcome |",
            "|---|---|---|---|---|---|"]
  for f in found:
    for c in f.comparisons:
      better = c.better.text() if c.better else "not in the results"
      worse = c.worse.text() if c.worse else "not in the results"
      note = f" ({c.note})" if c.note else ""
      lines.append(f"| {f.id} | {c.metric} | {better} | {worse} | {_t_text(c.t)} | "
                   f"{c.outcome}{note} |")
  return "\n".join(lines) + "\n"


def load_findings(path: str, flag: str = "--grid_file") -> list[dict]:
  """The FINDINGS of the grid file that `flag=path` names (`grid_files.path`: a path, or a
  shipped grid's name); an empty list when it defines none."""
  try:
    found = grid_files.scope(grid_files.path(path, flag), flag).get("FINDINGS", [])
  except grid_files.GridFileError as e:
    raise FindingsError(str(e)) from e
  if not isinstance(found, (list, tuple)) or not all(isinstance(f, dict) for f in found):
    raise FindingsError(f"{flag}={path}: FINDINGS must be a list of dicts")
  return list(found)


def read_results(path: str, flag: str = "--results") -> list[dict]:
  """The rows of the `results.csv` that `flag=path` names; a `FindingsError` naming the flag
  for a file that cannot be read as one, or that has no rows."""
  try:
    with open(path, encoding="utf-8") as f:
      rows = read_rows(f.read())
  except OSError as e:
    raise FindingsError(f"{flag}={path}: {e.strerror or errors.one_line(e)}") from e
  except (UnicodeDecodeError, csv.Error) as e:
    raise FindingsError(f"{flag}={path}: {errors.one_line(e)}") from e
  if not rows:
    raise FindingsError(f"{flag}={path} has no rows: a results.csv that the report wrote has "
                        "a row per seed of every run")
  return rows


def config_columns(columns: Sequence[str]) -> list[str]:
  """The columns of a `results.csv` that hold config fields: those under the config's
  sections (`checkpoint.`, ..., `train.`, and `seed`, `num_seeds`); the others are the
  summaries' (`cer_percent`, `timings.train_s`, ...)."""
  sections = {f.path.split(".")[0] for f in config_lib.base_fields()}
  return [c for c in columns if c.split(".")[0] in sections]


def listed(text: str) -> list[str]:
  """The items of a comma-separated flag value, stripped, empty ones left out."""
  return [s.strip() for s in text.split(",") if s.strip()]


def seed_of(row: Mapping[str, str]) -> float:
  """The seed of a `results.csv` row, as a number (`0` and `0.0` are one seed)."""
  return float(row.get("seed") or 0)


def read_parts(text: str, flag: str = "--results") -> list[dict]:
  """The rows of the results.csv files that `flag=text` names, comma-separated: a grid run
  in parts (seed 0 at one commit, seeds 1 and 2 at another) is read as one. The parts must
  hold the same config fields (`config_columns`); a summary column that some parts lack is
  empty in their rows. A `FindingsError` names the flag where they differ or where a run's
  seed stands in two parts."""
  paths = listed(text)
  if not paths:
    raise FindingsError(f"{flag}={text!r} names no file; give a results.csv, or several "
                        "comma-separated")
  parts = [read_results(p, flag) for p in paths]
  if len(parts) == 1:
    return parts[0]
  fields = [set(config_columns(list(rows[0]))) for rows in parts]
  for path, these in zip(paths[1:], fields[1:]):
    if these != fields[0]:
      odd = sorted(these ^ fields[0])
      raise FindingsError(f"{flag}: {path} and {paths[0]} hold other config fields "
                          f"({', '.join(odd[:6])}{', ...' if len(odd) > 6 else ''}): give the "
                          "parts of one grid, run by the same code")
  where: dict[tuple, int] = {}
  for i, rows in enumerate(parts):
    for r in rows:
      run = (r.get(GROUP_COLUMN, ""), seed_of(r))
      if where.setdefault(run, i) != i:
        raise FindingsError(f"{flag}: seed {r.get('seed', '')} of {r.get('workdir', '')} is in "
                            f"both {paths[where[run]]} (part {where[run] + 1}) and {paths[i]} "
                            f"(part {i + 1}); give each run's seed in one part")
  columns = dict.fromkeys(c for rows in parts for c in rows[0])
  return [{c: r.get(c, "") for c in columns} for rows in parts for r in rows]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--results", required=True,
                 help="a results.csv written by the report (comma-separated: the parts of a "
                      "grid run in parts, e.g. seed 0 at one commit and seeds 1 and 2 at "
                      "another)")
  p.add_argument("--grid_file", required=True, help="a grid file that defines FINDINGS")
  args = p.parse_args(argv)
  try:
    rows = read_parts(args.results)
    print(table(evaluate(rows, load_findings(args.grid_file))), end="")
  except FindingsError as e:
    print(f"findings: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
