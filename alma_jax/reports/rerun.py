"""A rerun of a grid against the results it repeats: is every difference within the seeds' spread?

Floating-point summation order differs between CPUs and between versions of
the code, and the difference compounds over hundreds of stages, so a rerun
of a grid on another host or at another commit does not give the same
digits. What it should give is values within the seeds' spread. This module
reads two `results.csv` files written by the report (one row per run and
seed), matches their groups (the runs that differ only by their seed) by the
config fields that tell the groups of either file apart (groups of one file
that differ only in fields the other lacks cannot be matched: an error
naming them where the other file has a group they could be, else they are
listed as found in one file only), and compares each metric of each matched
group: the mean ± sample standard deviation (ddof=1) over the finished seeds
on each side, and Welch's t of the difference
(`findings.welch_t`; positive when `--results` is higher). A difference is
called clear when |t| > `findings.CLEAR_T`, the rule of the findings. With
three seeds a side, |t| > 3 happens by chance alone in one comparison in
twenty-five (equal spreads: 4 degrees of freedom) to one in ten (very
unequal ones: 2), so a few clear differences in a large table are expected.
Mem does not depend on float order where the growth does not (it is then
identical); Comp counts the epochs that early stopping picks, so it moves
with the validation curve, as the errors do.

  python -m alma_jax.reports.rerun --results=new/results.csv --against=old/results.csv
  python -m alma_jax.reports.rerun --results=seed0/results.csv --against=old/results.csv --seeds=0
  python -m alma_jax.reports.rerun --results=new/results.csv --against=old/results.csv --choices
  python -m alma_jax.reports.rerun --results=seed0/results.csv,seeds12/results.csv \
      --against=old/results.csv

prints a Markdown table of every matched group and metric (either flag takes several
files, comma-separated, for a grid run in parts: `findings.read_parts`; `--seeds`: of
those seeds alone on both sides, as for a rerun of a grid's first seed; with
one seed a side a comparison is identical or not, with no t; `--choices`:
with a column saying how the speed choices of the group's runs differ
between the sides, as those change the order of float sums where the config
leaves them to be timed on the host), a count of the clear differences, the
groups found in only one file, those in both that no metric compares (a side
without a finished run that has one), and the config fields whose value differs
between the files but is the same within each (a field's new default,
other epochs: not used to match, so read them). Fields
that change no record (`config_lib.resumable_paths`: data paths, progress,
checkpointing) are left out, as the report's groups leave them out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Mapping, Sequence

from alma_jax.configuration import config_lib
from alma_jax.configuration import fields as F
from alma_jax.reports import findings as findings_lib
from alma_jax.reports import labels as labels_lib
from alma_jax.reports import report as report_lib

DEFAULT_METRICS = ("cer_percent", "final_error", "final_perplexity", "mem", "comp_paper_total")
IDENTICAL, CLEAR = "identical", "clear"
CHOICES = "choices."  # the columns of the speed choices a run made (`choices.train.step_fusion`)
ALIKE = "alike"  # the speed choices of both sides' runs (`choice_text`)


class RerunError(ValueError):
  """The two results cannot be compared (no groups, an unknown metric)."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One metric of one matched group on both sides."""

  group: str
  metric: str
  earlier: findings_lib.Side
  this: findings_lib.Side
  t: float
  outcome: str  # IDENTICAL, CLEAR or ""
  choices: str = ""  # with `compare(choices=True)`: `choice_text` of the group's runs


@dataclasses.dataclass(frozen=True)
class Comparison:
  rows: tuple[Row, ...]
  only_this: tuple[str, ...]
  only_earlier: tuple[str, ...]
  set_apart: tuple[tuple[str, str, str], ...]  # (field, value in --against, value in --results)
  # Groups in both files that no metric compares: a side without a finished run that has one.
  not_compared: tuple[str, ...] = ()


def _config_fields(columns: Sequence[str]) -> list[str]:
  ignore = set(report_lib.SEED_FIELDS) | set(config_lib.resumable_paths())
  return [c for c in findings_lib.config_columns(columns) if c not in ignore]


def _values(rows, field: str) -> set:
  return {findings_lib._norm(r.get(field, "")) for r in rows}  # pylint: disable=protected-access


def _key_fields(this, earlier) -> tuple[list[str], list[tuple[str, str, str]]]:
  """The config fields that tell groups apart (those whose value varies within either file),
  and those that are constant within each file but differ between them."""
  common = [c for c in _config_fields(list(this[0])) if c in earlier[0]]
  keys, apart = [], []
  for c in common:
    a, b = _values(earlier, c), _values(this, c)
    if len(a) > 1 or len(b) > 1:
      keys.append(c)
    elif a != b:
      apart.append((c, earlier[0].get(c, ""), this[0].get(c, "")))
  return keys, apart


def _labels(groups: Mapping[tuple, list], keys: Sequence[str]) -> dict[tuple, str]:
  """A short label per group: its data and method, then the key fields that differ among the
  groups of that data and method (the others are their settings, the same in each), but the
  fields of policies that the group does not use (`labels_lib.unused_policy_fields`, unless
  two groups would then share a label), by `labels_lib.label`."""
  kind = {k: (rows[0].get("data.name", ""), rows[0].get("method.name", ""))
          for k, rows in groups.items()}
  shown = {}
  for which in set(kind.values()):
    alike = [k for k in groups if kind[k] == which]
    shown[which] = [f for i, f in enumerate(keys) if f not in ("data.name", "method.name")
                    and len({k[i] for k in alike}) > 1]

  def named(key, skip=()):
    row = groups[key][0]
    return labels_lib.label(row, ["data.name", "method.name"]
                            + [f for f in shown[kind[key]] if f not in skip])

  out = {k: named(k, labels_lib.unused_policy_fields(groups[k][0])) for k in groups}
  if len(set(out.values())) < len(out):
    return {k: named(k) for k in groups}
  return out


def _by_key(rows, keys) -> dict[tuple, list[list]]:
  """The groups of `rows` by their values of `keys`: key -> its groups (more than one where
  groups differ only in fields that the other file lacks)."""
  out: dict[tuple, list[list]] = {}
  for group in findings_lib._groups(rows).values():  # pylint: disable=protected-access
    key = tuple(findings_lib._norm(group[0].get(k, "")) for k in keys)  # pylint: disable=protected-access
    out.setdefault(key, []).append(list(group))
  return out


def _differ(groups: Sequence[list]) -> list[str]:
  """The config fields whose value differs among `groups` (each a list of rows)."""
  return sorted(c for c in _config_fields(list(groups[0][0]))
                if len(_values([g[0] for g in groups], c)) > 1)


def _unmatched(by_key: dict[tuple, list[list]], other: dict, keys: Sequence[str],
               name: str) -> list[str]:
  """Labels of the groups of `by_key` that share a key (values of `keys`) with another group of
  their file, which the other file's groups (`other`) do not have; an error where the other
  file has that key, as its group cannot be matched to one of them."""
  named = [k for k in keys if k not in ("data.name", "method.name")]
  out = []
  for key, groups in by_key.items():
    if len(groups) < 2:
      continue
    differ = _differ(groups)
    if key in other:
      raise RerunError(f"{name}: groups differ in {differ}, which the other results.csv does "
                       "not have: they cannot be matched to its groups; compare a results.csv "
                       "that holds one value of these fields")
    out += [labels_lib.label(g[0], ["data.name", "method.name"] + named + differ)
            for g in groups]
  return out


def _by_seed(rows, metric: str) -> dict[float, float]:
  """Seed -> value of `metric`, over the finished runs that have one."""
  return {findings_lib.seed_of(r): findings_lib.cell_number(r, metric, f"--metrics={metric}")
          for r in rows if str(r.get("finished")) == "True" and r.get(metric) not in ("", None)}


def _side(values: Mapping[float, float], label: str) -> findings_lib.Side:
  return findings_lib.Side(label, tuple(values[s] for s in sorted(values)))


def _as_chosen(rows: Sequence[Mapping[str, str]]) -> list[Mapping[str, str]]:
  """`rows` with the cells of a field whose default changed (`fields.CHANGED_DEFAULTS`, e.g.
  gMoE's `method.slots`, pow2 before auto) that the run left to be chosen read as the value it
  chose (its `choices.<field>` cell), so a grid run again after the change matches the earlier
  run's groups where its runs chose what those set."""
  out = []
  for r in rows:
    chosen = {f: r[CHOICES + f] for f in F.CHANGED_DEFAULTS
              if f in r and r.get(CHOICES + f)}
    out.append({**r, **chosen} if chosen else r)
  return out


def _of_seeds(rows: Sequence[Mapping[str, str]], seeds: Sequence[float], name: str) -> list:
  """The rows of `rows` whose seed is one of `seeds`; an error naming the file's seeds if none
  is."""
  wanted = set(seeds)
  kept = [r for r in rows if findings_lib.seed_of(r) in wanted]
  if not kept:
    have = sorted({findings_lib.seed_of(r) for r in rows})
    raise RerunError(f"--seeds={','.join(f'{s:g}' for s in seeds)} keeps no row of {name}; "
                     f"its seeds: {', '.join(f'{s:g}' for s in have)}")
  return kept


def _choice_fields(rows: Sequence[Mapping[str, str]]) -> set[str]:
  return {c[len(CHOICES):] for r in rows for c in r if c.startswith(CHOICES)}


def _made(rows: Sequence[Mapping[str, str]], fields) -> dict[str, tuple[str, ...]]:
  """Field -> the values that the runs of `rows` chose for it or were set to (a speed choice:
  a run's `choices.<field>` cell where it has one, else the field's own cell)."""
  return {f: tuple(sorted({str(r.get(CHOICES + f) or r.get(f) or "") for r in rows}))
          for f in sorted(fields)}


def choice_text(earlier: Sequence[Mapping[str, str]], this: Sequence[Mapping[str, str]]) -> str:
  """How the speed choices of two groups' runs differ: "alike", or per field the values of
  each side ("train.step_fusion no_ynn -> same")."""
  fields = _choice_fields(earlier) | _choice_fields(this)
  a, b = _made(earlier, fields), _made(this, fields)
  differ = [f for f in sorted(fields) if a[f] != b[f]]
  if not differ:
    return ALIKE
  def side(values):
    return "/".join(v or "–" for v in values)
  return "; ".join(f"{f} {side(a[f])} -> {side(b[f])}" for f in differ)


def compare(this: Sequence[Mapping[str, str]], earlier: Sequence[Mapping[str, str]],
            metrics: Sequence[str] | None = None,
            seeds: Sequence[float] | None = None, choices: bool = False) -> Comparison:
  """Every metric of every group found in both `this` and `earlier` (rows of results.csv);
  `metrics`: the summary columns to compare (None: those of `DEFAULT_METRICS` either has);
  `seeds`: the seeds compared on both sides (None: every seed), e.g. a rerun of a grid's
  first seed against the whole grid; `choices`: each row says how the speed choices of the
  group's runs differ between the sides (`choice_text`)."""
  if not this or not earlier:
    raise RerunError("both results.csv files need at least one row")
  if seeds is not None:
    this, earlier = _of_seeds(this, seeds, "--results"), _of_seeds(earlier, seeds, "--against")
  known = set(this[0]) | set(earlier[0])
  if metrics is None:
    metrics = [m for m in DEFAULT_METRICS if m in known]
  unknown = [m for m in metrics if m not in known]
  if unknown:
    numeric = sorted(c for c in known if c not in _config_fields(sorted(known)))
    raise RerunError(f"--metrics: {unknown} is in neither results.csv; its columns include "
                     f"{numeric}")
  this, earlier = _as_chosen(this), _as_chosen(earlier)
  keys, apart = _key_fields(this, earlier)
  ours, theirs = _by_key(this, keys), _by_key(earlier, keys)
  spare_this = _unmatched(ours, theirs, keys, "--results")
  spare_earlier = _unmatched(theirs, ours, keys, "--against")
  ours = {k: g[0] for k, g in ours.items() if len(g) == 1}
  theirs = {k: g[0] for k, g in theirs.items() if len(g) == 1}
  labels = _labels({**theirs, **ours}, keys)
  rows, not_compared = [], []
  for key, mine in ours.items():
    if key not in theirs:
      continue
    label = labels[key]
    made = choice_text(theirs[key], mine) if choices else ""
    before = len(rows)
    for metric in metrics:
      by_a, by_b = _by_seed(theirs[key], metric), _by_seed(mine, metric)
      if not by_a or not by_b:
        continue
      a, b = _side(by_a, "earlier"), _side(by_b, "this")
      if by_a == by_b:  # every seed on both sides, with the same value
        rows.append(Row(label, metric, a, b, 0.0, IDENTICAL, made))
        continue
      # welch_t(better, worse) is (mean(worse) - mean(better)) / se: positive when this is higher.
      t = findings_lib.welch_t(a.values, b.values)
      rows.append(Row(label, metric, a, b, t,
                      CLEAR if abs(t) > findings_lib.CLEAR_T else "", made))
    if len(rows) == before:
      not_compared.append(label)
  only_this = tuple(labels[k] for k in ours if k not in theirs) + tuple(spare_this)
  only_earlier = tuple(labels[k] for k in theirs if k not in ours) + tuple(spare_earlier)
  return Comparison(tuple(rows), only_this, only_earlier, tuple(apart), tuple(not_compared))


def _num(v: float) -> str:
  return f"{v:,.4g}" if math.isfinite(v) else "–"


def _side_text(s: findings_lib.Side) -> str:
  spread = f" ± {_num(s.std)}" if s.n > 1 else ""
  return f"{_num(s.mean)}{spread} (n={s.n})"


def table(c: Comparison, earlier_name: str = "--against", this_name: str = "--results") -> str:
  """The Markdown text of a comparison."""
  made = any(r.choices for r in c.rows)  # a column of the speed choices (`compare(choices=True)`)
  lines = [f"| group | metric | {earlier_name} | {this_name} | Welch t | |"
           + (" speed choices |" if made else ""),
           "|---|---|---|---|---|---|" + ("---|" if made else "")]
  for r in c.rows:
    t = "–" if r.outcome == IDENTICAL else findings_lib._t_text(r.t)  # pylint: disable=protected-access
    lines.append(f"| {r.group} | {r.metric} | {_side_text(r.earlier)} | {_side_text(r.this)} "
                 f"| {t} | {r.outcome} |" + (f" {r.choices} |" if made else ""))
  lines.append("")
  groups = len({r.group for r in c.rows})
  clear = [r for r in c.rows if r.outcome == CLEAR]
  same = sum(r.outcome == IDENTICAL for r in c.rows)
  moved = [r for r in c.rows if r.outcome != IDENTICAL]
  both = groups + len(c.not_compared)
  lines.append(f"{both} group{'s' if both != 1 else ''} in both files"
               + (f" ({groups} compared)" if c.not_compared else "") + ", "
               f"{len(c.rows)} comparison{'s' if len(c.rows) != 1 else ''}: {same} identical, "
               f"{len(clear)} clearly different (|t| > {findings_lib.CLEAR_T:g})"
               + (": " + "; ".join(f"{r.group} {r.metric} t = {findings_lib._t_text(r.t)}"  # pylint: disable=protected-access
                                   for r in clear) if clear else "") + ".")
  if made:
    other = {r.group for r in c.rows if r.choices != ALIKE}
    lines.append(f"Speed choices: the runs of {len(other)} of the {groups} groups made other "
                 "ones on the two sides" + (
                     f"; of the {len(moved)} comparisons not identical, "
                     f"{sum(r.group in other for r in moved)} are of those groups" if moved
                     else "") + ".")
  listed = False
  for head, only in ((f"Only in {this_name}", c.only_this),
                     (f"Only in {earlier_name}", c.only_earlier),
                     ("In both files, not compared: a side has no finished run with a value of "
                      "the metrics", c.not_compared)):
    if only:  # a list, one group a line: a rerun of part of a grid leaves out many
      lines += ["", f"{head} ({len(only)} group{'s' if len(only) > 1 else ''}):", ""]
      lines += [f"- {g}" for g in only]
      listed = True
  if c.set_apart:
    if listed:  # a paragraph of its own after a list
      lines.append("")
    lines.append("The same within each file, different between them (not used to match): "
                 + "; ".join(f"{f} {a!r} -> {b!r}" for f, a, b in c.set_apart) + ".")
  return "\n".join(lines) + "\n"


def _seeds_flag(text: str) -> list[float]:
  """The seeds of `--seeds` (comma-separated whole numbers >= 0)."""
  parts = findings_lib.listed(text)
  if not parts or not all(s.isdigit() for s in parts):
    raise RerunError(f"--seeds={text!r}: give comma-separated seeds (whole numbers >= 0), "
                     "e.g. --seeds=0 or --seeds=0,1")
  return [float(s) for s in parts]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--results", required=True,
                 help="the rerun's results.csv (comma-separated: the parts of a rerun, e.g. "
                      "seed 0 run at one commit and seeds 1 and 2 at another)")
  p.add_argument("--against", required=True,
                 help="the results.csv it repeats (comma-separated: in parts, likewise)")
  p.add_argument("--metrics", default=None,
                 help="comma-separated summary columns to compare (default: those of "
                      f"{','.join(DEFAULT_METRICS)} that the files have)")
  p.add_argument("--seeds", default=None,
                 help="comma-separated seeds to compare on both sides (default: every seed), "
                      "e.g. 0 for a rerun of a grid's first seed against the whole grid")
  p.add_argument("--choices", action="store_true",
                 help="a column saying how the speed choices of each group's runs (its "
                      "choices.* cells: XLA's options, steps per call...) differ between the "
                      "sides: differences of float order that no config field shows")
  args = p.parse_args(argv)
  metrics = None if args.metrics is None else findings_lib.listed(args.metrics)
  try:
    if metrics == []:
      raise RerunError(f"--metrics={args.metrics!r} names no column; give comma-separated "
                       "summary columns, or leave the flag out for the defaults")
    seeds = None if args.seeds is None else _seeds_flag(args.seeds)
    this = findings_lib.read_parts(args.results, "--results")
    earlier = findings_lib.read_parts(args.against, "--against")
    print(table(compare(this, earlier, metrics, seeds, args.choices)), end="")
  except (RerunError, findings_lib.FindingsError) as e:
    print(f"rerun: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
