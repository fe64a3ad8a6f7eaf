"""Figures of ALMA runs (matplotlib, drawn without pyplot on the Agg canvas).

Every figure function computes the data it plots first — a list of series
per panel, each a dict with `label`, `x`, `y` and their standard deviations
over seeds (`xerr`, `yerr`) — draws exactly that, writes `<name>.png` and
`<name>.pdf`, and returns {name: {panel: series}} so that tests and callers
can check what was drawn. `run_error_png` is the small error-vs-time figure
that each finished run writes into its workdir; a run draws it in a child
process (`PlotChild`: `python -m alma_jax.reports.plots` with the figure's JSON on stdin),
started when the stream starts so that its imports overlap the run, and the training
process never imports matplotlib.

The figures share one look (`alma_jax.reports.plot_style`): a colour per method, the
same in every figure and report, lighter or darker for its variants (e.g.
gMoE with tree and flat gating); a marker per waiting time (per width where
the wait is the x axis), hollow and dashed with replay; in the tradeoffs figure, a
marker's size by its model's width (or Switch Transformer size), keyed in the legend;
CER and perplexity axes logarithmic where their values span more than
`plot_style.LOG_SPAN` times; x-axis labels broken to fit their axes; fonts of at
least 8 pt.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib
from typing import Sequence

import numpy as np

from alma_jax.configuration import plugins
from alma_jax.outputs import io_utils
from alma_jax.reports import labels as labels_lib
from alma_jax.reports import plot_style as style
from alma_jax.reports.plot_style import Series

TERA = 1e-12
# The compute axis of every CER figure: the paper's count (forward multiply-adds x examples) of
# all the learner's work, growth's own passes over data and a waiting policy's evaluations
# included, so that a growing method is never drawn at less compute than it spent.
COMP_AXIS = "comp_paper_total"
PERPLEXITY_FIELD = "test_perplexity"
# Ignored when labelling language models: the Switch Transformer has presets, not widths.
LM_UNLABELLED = ("model.width",)
# Fields that `stream.iid` sets (wait B, B times the steps): an i.i.d. run is labelled by it.
IID_DERIVED = ("stream.wait", "train.steps_per_epoch", "stream.iid")
MARKED_STEPS = 40  # a run's error figure marks every step of a stream this long or shorter

# Re-exported for the report and the tests.
subplots, save, mean_std, mean_std_columns = (style.subplots, style.save, style.mean_std,
                                              style.mean_std_columns)


# -- a report's model sizes: image backbones' widths, Switch Transformers' sizes -----------------
# A report of Switch Transformers of several sizes (`labels_lib.SWITCH_SIZE_PATHS`) draws each
# size in panels of its own, or as the points that a config's line joins, as it does an image
# backbone's widths.
# Fields that may change with the size alone (a grid's steps per stage for each model): then
# they belong to its title, not to the configs' labels.
_SIZE_PREFIXES = ("model.", "data.", "train.")


class SwitchSizes:
  """The Switch Transformer sizes among a data set's groups: `fields` (empty unless all groups
  are Switch Transformers and two sizes differ) are those that set the sizes apart, with the
  fields that change with the size alone; `title(g)` names `g`'s size by them, a size field
  at 0 by what it stands for (the preset's value, `vocab_size=all`)."""

  def __init__(self, groups, fields: Sequence[str] = ()):
    self.fields: tuple[str, ...] = ()
    if not _all_switch(groups):
      return
    size = [f for f in labels_lib.SWITCH_SIZE_PATHS if _differs(f, groups)]
    if not size:
      return
    by_size: dict[tuple, list] = {}
    for g in groups:
      by_size.setdefault(tuple(labels_lib.value_text(g.get(f)) for f in size), []).append(g)

    def with_size(f):  # one value per size, and not the same for all
      return (f not in size and f.startswith(_SIZE_PREFIXES) and f != "model.num_experts"
              and all(not _differs(f, members) for members in by_size.values())
              and _differs(f, groups))

    self.fields = tuple(size + [f for f in fields if with_size(f)])

  def __bool__(self) -> bool:
    return bool(self.fields)

  def title(self, g) -> str:
    """`g`'s size: "dim=64 ffn_dim=128 vocab_size=all ..." ("" for a report of one size)."""
    return " ".join(labels_lib.size_label(g, f) for f in self.fields)

  def order(self, g) -> tuple:
    """A sort key of `g`'s size, numbers by value ("all" after any number)."""
    def key(v):
      return (0, float(v), "") if isinstance(v, (int, float)) else (1, 0.0, str(v))
    return tuple(key(labels_lib.resolved_size(g, f)) for f in self.fields)

  def others(self, fields: Sequence[str]) -> list[str]:
    """`fields` less the sizes' own."""
    return [f for f in fields if f not in self.fields]

  def same_data(self) -> bool:
    """Whether every size is measured on the same data: no data field (the vocabulary, which
    sets the tokens whose error and perplexity are measured) tells the sizes apart."""
    return not any(f.startswith("data.") for f in self.fields)


def _by_width(g) -> float:
  """A sort key of `g`'s model width (0 where it has none)."""
  return float(g.get("model.width") or 0)


def _all_switch(groups) -> bool:
  """Whether there are groups and all of them are Switch Transformers."""
  return bool(groups) and all(g.get("model.name") == "switch" for g in groups)


def _labeller(groups, fields: Sequence[str]):
  """g -> its label among `groups` in the trade-offs and error figures: `series_label` of
  `fields`; for Switch Transformers, of those that set them apart (`lm_label_fields`: not the
  wait and replay that all share), an i.i.d. run marked as such."""
  if not _all_switch(groups):
    return lambda g: series_label(g, groups, fields)
  shown = lm_label_fields(groups, fields)

  def label(g):
    if not _is_iid(g):
      return series_label(g, groups, shown)
    return series_label(g, groups, [f for f in shown if f not in IID_DERIVED]) + " i.i.d."
  return label


# -- CER vs compute and memory (Fig. 2/7), replay (Fig. 4) -----------------------------------------
def _stat_points(groups, xfield: str, yfield: str, xscale: float, yscale: float = 1.0):
  pts = [(g.stat(xfield), g.stat(yfield)) for g in groups]
  return {"x": [m * xscale for (m, _), _ in pts], "xerr": [s * xscale for (_, s), _ in pts],
          "y": [m * yscale for _, (m, _) in pts], "yerr": [s * yscale for _, (_, s) in pts]}


def _line_key(g, fields: Sequence[str]) -> tuple:
  return tuple(str(g.get(f)) for f in fields)


def tradeoff_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"comp": ..., "mem": ...}: one series per config across widths (finished runs only), or
  across the sizes of Switch Transformers (`SwitchSizes`; `widths` then holds their titles).
  A point's marker size tells its model: `marker_scale`, growing from the figure's smallest
  model to its largest (1 where all share one). Where the sizes are measured on other data
  (another vocabulary: other tokens, whose errors do not compare), a config's points are
  not joined by a line (`joined` False)."""
  sizes = SwitchSizes(groups, fields)
  looks = Looks(groups, sizes.others(fields))
  groups = [g for g in groups if g.finished]
  line_fields = [f for f in sizes.others(fields) if f != "model.width"]
  label = _labeller(groups, line_fields)
  lines: dict[tuple, list] = {}
  for g in groups:
    lines.setdefault(_line_key(g, line_fields), []).append(g)

  def model(g):
    return sizes.title(g) if sizes else g.get("model.width")

  def smallest_first(g):
    return sizes.order(g) if sizes else _by_width(g)

  models = list(dict.fromkeys(model(g) for g in sorted(groups, key=smallest_first)))
  scale = dict(zip(models, style.marker_scale(len(models))))
  out = {"comp": [], "mem": []}
  for members in lines.values():
    members = sorted(members, key=smallest_first)
    look = dict(looks.of(members[0]), label=label(members[0]),
                widths=[model(m) for m in members],
                marker_scale=[scale[model(m)] for m in members],
                **({} if not sizes or sizes.same_data() else {"joined": False}))
    out["comp"].append(dict(look, **_stat_points(members, COMP_AXIS, "cer_percent", TERA)))
    out["mem"].append(dict(look, **_stat_points(members, "mem", "cer_percent", 1.0)))
  return out


def _lines_over(groups, fields: Sequence[str], field: str):
  """(the other fields, [the finished groups of one config sorted by `field`]) for every
  config that has two or more values of `field`."""
  groups = [g for g in groups if g.finished]
  others = [f for f in fields if f != field]
  lines: dict[tuple, list] = {}
  for g in groups:
    lines.setdefault(_line_key(g, others), []).append(g)
  return others, [sorted(m, key=lambda g: float(g.get(field) or 0))
                  for m in lines.values() if len({g.get(field) for g in m}) > 1]


def replay_series(groups, fields: Sequence[str]) -> list[Series]:
  """Segments from each config without replay to the same config with replay (its end
  hollow)."""
  looks = Looks(groups, fields)
  others, lines = _lines_over(groups, fields, "stream.replay")
  return [dict(_stat_points(members, COMP_AXIS, "cer_percent", TERA),
               **looks.of(members[0]), label=series_label(members[0], groups, others),
               replay=[g.get("stream.replay") for g in members],
               hollow=[bool(g.get("stream.replay")) for g in members]) for members in lines]


def wait_series(groups, fields: Sequence[str]) -> list[Series]:
  """CER against the waiting time w: one series per config over its waits (two or more),
  a marker per width."""
  looks = Looks(groups, fields)
  others, lines = _lines_over(groups, fields, "stream.wait")
  out = []
  for members in lines:
    cer = [g.stat("cer_percent") for g in members]
    first = members[0]
    out.append(dict(looks.of(first), marker=looks.width_marker(first),
                    label=series_label(first, groups, others),
                    x=[float(g.get("stream.wait")) for g in members],
                    y=[m for m, _ in cer], yerr=[s for _, s in cer]))
  return out


# -- waiting and warm-start policies against the fixed waits --------------------------------------
# The paper's learner: fixed waits, fine-tuned (absent: a run written before the fields existed).
PLAIN_POLICIES = {"stream.wait_policy": (None, "fixed"), "stream.warm_start": (None, "finetune")}


def _plain(g) -> bool:
  return all(g.get(f) in values for f, values in PLAIN_POLICIES.items())


# A policy's colour, the same in every figure: the spare colours, then the methods' with SM's last
# (the fixed waits' line of SM, the usual baseline, keeps its blue to itself).
POLICY_PALETTE = (style.SPARE_COLORS + tuple(c for m, c in style.METHOD_COLORS.items() if m != "sm")
                  + (style.METHOD_COLORS["sm"],))


def policy_color(kind: str) -> str:
  """The colour of a warm start or waiting policy other than the paper's (`kind`, its name), by
  its place among the declared policies; a pair of them (`"redo + geometric"`) by its name."""
  names = [n for f, table in labels_lib.POLICY_TABLES.items() for n in table
           if n not in PLAIN_POLICIES[f]]
  if kind in names:
    return POLICY_PALETTE[names.index(kind) % len(POLICY_PALETTE)]
  return POLICY_PALETTE[zlib.crc32(kind.encode()) % (len(POLICY_PALETTE) - 1)]


def _policy_kind(g) -> str:
  """The policies of `g` other than the paper's, its warm start then its waiting policy, joined
  by " + " (`"redo"`, `"redo + geometric"`; "" for the paper's learner)."""
  return " + ".join(str(g.get(f)) for f, plain in PLAIN_POLICIES.items() if g.get(f) not in plain)


def _policy_fields() -> set[str]:
  """The fields that name a policy or set one, and `stream.init_from_scratch` (the older
  spelling of the warm start `scratch`)."""
  return ({f.path for f in plugins.policy_fields()} | set(labels_lib.POLICY_TABLES)
          | set(labels_lib.LEGACY_POLICY_FIELDS))


def _policy_parts(g, groups) -> list[str]:
  """`g`'s policies other than the paper's, by name, each with those of its own fields that are
  not at their defaults or whose values differ among the `groups` that use it (the fields of
  policies `g` does not use stay at their defaults and are left out)."""
  parts = []
  for field, table in labels_lib.POLICY_TABLES.items():
    name = str(g.get(field) or PLAIN_POLICIES[field][1])
    if name in PLAIN_POLICIES[field]:
      continue
    users = [o for o in groups if str(o.get(field)) == name]
    own = [f.path for f in (table[name].FIELDS if name in table else ())
           if _differs(f.path, users) or g.get(f.path) not in (None, f.default)]
    words = [name]
    for path in own:
      field_name, value = path.split(".")[-1], labels_lib.value_text(g.get(path))
      if field_name == name:  # the policy's one number, named after it: "l2_init=0.001"
        words[0] = f"{name}={value}"
      else:
        words.append(f"{policy_field_name(name, field_name)}={value}")
    parts.append(" ".join(words))
  return parts


def policy_field_name(policy: str, field_name: str) -> str:
  """A policy's field as its label names it, after the policy's name: without the word in
  front that repeats that name ("geometric_w0" of geometric: "w0"; "trigger_margin" of
  triggered: "margin"), else whole ("cbp_fraction", "shrink")."""
  head, _, rest = field_name.partition("_")
  return rest if rest and policy.startswith(head) else field_name


def _fixed_wait(g) -> bool:
  return str(g.get("stream.wait_policy") or "fixed") == "fixed"


def series_label(g, groups, fields: Sequence[str]) -> str:
  """`g`'s label among `groups`: its values of `fields` (`Group.label`), its policies named as
  `_policy_parts` does instead of every policy's fields, and no wait under a waiting policy
  (the run's w is not what it waited)."""
  policy = _policy_fields()
  keep = [f for f in fields if f not in policy and (_fixed_wait(g) or f != "stream.wait")]
  return ", ".join(x for x in [g.label(keep), *_policy_parts(g, groups)] if x)


def _policy_label(g, groups, fields: Sequence[str]) -> str:
  """`g`'s label in the policies figure: its policies (`_policy_parts`), then `w=<wait>` under
  a fixed wait and the other `fields` that differ among the `groups` but the width."""
  parts = _policy_parts(g, groups)
  if _fixed_wait(g):
    parts.append(f"w={labels_lib.value_text(g.get('stream.wait'))}")
  skip = _policy_fields() | {"model.width", "stream.wait"}
  rest = [f for f in fields if f not in skip and _differs(f, groups)]
  return ", ".join(parts + ([g.label(rest)] if g.label(rest) else []))


class Looks(style.Looks):
  """`plot_style.Looks`, but a config with another warm start or waiting policy than the
  paper's takes its policy's colour (`policy_color`), lighter or darker per setting
  (`_policy_parts`), and the paper's configs keep their method's colour and shades among
  themselves: a grid of policies reads by colour in every figure, not by label alone."""

  def __init__(self, groups, fields: Sequence[str]):
    super().__init__(groups, fields)
    self.groups = groups
    settings: dict[str, set] = {}
    for g in groups:
      if not _plain(g):
        settings.setdefault(_policy_kind(g), set()).add(self._setting(g))
    self.settings = {k: sorted(v) for k, v in settings.items()}

  def _variant_groups(self, groups):
    return [g for g in groups if _plain(g)]

  def _setting(self, g) -> str:
    return ", ".join(_policy_parts(g, self.groups))

  def color(self, g) -> str:
    if _plain(g):
      return super().color(g)
    kind = _policy_kind(g)
    return style.shade(policy_color(kind), self.settings[kind].index(self._setting(g)))


def policy_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"width=<w>": series} when a group uses another waiting or warm-start policy than the
  paper's: first each method's frontiers of the fixed waits (fine-tuned, without replay, joined
  in order of compute; one per setting of the other fields that differ among them), then one
  point per other config, labelled by its policies and their settings (`_policy_label`), a
  colour per policy and a marker per setting; CER against compute (finished runs only)."""
  groups = [g for g in groups if g.finished and not g.get("stream.replay")]
  if all(_plain(g) for g in groups):
    return {}
  looks = Looks(groups, fields)
  others = [g for g in groups if not _plain(g)]
  labels = {id(g): _policy_label(g, others, fields) for g in others}
  settings: dict[str, set] = {}  # each policy's settings (their labels), a marker each
  for g in others:
    settings.setdefault(_policy_kind(g), set()).add(labels[id(g)])
  markers = {label: style.MARKERS[i % len(style.MARKERS)]
             for kind_labels in settings.values() for i, label in enumerate(sorted(kind_labels))}
  skip = _policy_fields() | {"method.name", "model.width", "stream.wait"}
  out: dict[str, list[Series]] = {}
  for width in sorted({g.get("model.width") for g in groups}, key=lambda w: float(w or 0)):
    same = [g for g in groups if g.get("model.width") == width]
    plain = [g for g in same if _plain(g)]
    # A frontier per method and per setting of the other fields that differ among its
    # configs (gMoE's two gatings are two frontiers, not two waits of one).
    rest = [f for f in fields if f not in skip and _differs(f, plain)]
    lines: dict[tuple, list] = {}
    for g in plain:
      lines.setdefault((str(g.get("method.name")), _line_key(g, rest)), []).append(g)
    series = []
    for (method, _), members in sorted(lines.items()):
      fixed = sorted(members, key=lambda g: g.stat(COMP_AXIS)[0])
      waits = ", ".join(str(g.get("stream.wait")) for g in fixed)
      name = " ".join(x for x in (method, fixed[0].label(rest)) if x)
      series.append(dict(looks.of(fixed[0]), label=f"{name} fixed waits w = {waits} (finetune)",
                         **_stat_points(fixed, COMP_AXIS, "cer_percent", TERA)))
    for g in same:
      if _plain(g):
        continue
      series.append(dict(color=policy_color(_policy_kind(g)), filled=True,
                         marker=markers[labels[id(g)]], label=labels[id(g)],
                         **_stat_points([g], COMP_AXIS, "cer_percent", TERA)))
    out[f"width={width}"] = series
  return out


# -- error over time (Fig. 1/3) --------------------------------------------------------------------
def error_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"width=<w>": one series per config}: mean test error (%) over t, std over seeds. Switch
  Transformers have no width: a panel per size (`SwitchSizes.title`; "" when all share one)."""
  sizes = SwitchSizes(groups, fields)
  looks = Looks(groups, sizes.others(fields))
  switch = _all_switch(groups)
  label = _labeller(groups, [f for f in sizes.others(fields) if f != "model.width"])
  out: dict[str, list[Series]] = {}
  order = sizes.order if switch else _by_width
  for g in sorted(groups, key=order):
    t, mean, std = g.curve("test_error")
    out.setdefault(sizes.title(g) if switch else f"width={g.get('model.width')}", []).append(
        dict(looks.of(g), label=label(g), x=t.tolist(),
             y=(100 * mean).tolist(),
             yerr=(100 * std).tolist()))
  return out


# -- plasticity diagnostics over time (`log.plasticity`) -------------------------------------------
# Axis labels on two lines where one would be longer than a panel is high.
PLASTICITY_PANELS = (("dormant_fraction", "dormant units (%)", 100.0),
                     ("feature_rank", "effective rank of the\nlast hidden layer", 1.0),
                     ("init_distance", "distance from the\ninitial parameters", 1.0))


def plasticity_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"<diagnostic> width=<w>": one series per config that recorded it}: its mean over seeds
  against t (std over seeds as error bars); empty when no run recorded plasticity
  diagnostics. When the configs differ in their warm start, only the fixed-wait runs at the
  smallest wait that another warm start than finetune uses are drawn (the comparison of
  warm starts; the other waits would bury it). A config has the colour it has in every figure
  of the data set (`Looks` over all `groups`) and the label of its policies (`series_label`),
  and each drawn config a marker of its own."""
  drawn = [g for g in groups if len(g.curve(PLASTICITY_PANELS[0][0])[0])
           or len(g.curve(PLASTICITY_PANELS[-1][0])[0])]
  others = [g for g in drawn if (g.get("stream.warm_start") or "finetune") != "finetune"]
  if others:
    wait = min(int(g.get("stream.wait") or 1) for g in others)
    drawn = [g for g in drawn if (g.get("stream.wait_policy") or "fixed") == "fixed"
             and int(g.get("stream.wait") or 1) == wait]
  differ = [f for f in fields if f != "model.width" and _differs(f, drawn)]
  looks = Looks(groups, fields)

  # The fine-tuned config, named by nothing else, is named by its policy.
  labels = {id(g): series_label(g, groups, differ) or PLAIN_POLICIES["stream.warm_start"][1]
            for g in drawn}
  markers = {k: style.MARKERS[i % len(style.MARKERS)]
             for i, k in enumerate(sorted(set(labels.values())))}
  out: dict[str, list[Series]] = {}
  for field, _, scale in PLASTICITY_PANELS:
    for g in sorted(drawn, key=_by_width):
      t, mean, std = g.curve(field)
      if len(t):
        label = labels[id(g)]
        out.setdefault(f"{field} width={g.get('model.width')}", []).append(
            dict(color=looks.color(g), marker=markers[label], filled=True, label=label,
                 x=t.tolist(), y=(scale * mean).tolist(), yerr=(scale * std).tolist()))
  return out


def plasticity_figure(panels: dict[str, list[Series]], data: str):
  fig, axes = subplots(len(panels), height=2.6,
                       legend_entries=len({s["label"] for v in panels.values() for s in v}))
  names = {field: name for field, name, _ in PLASTICITY_PANELS}
  for ax, (panel, series) in zip(axes, panels.items()):
    field, width = panel.split(" ", 1)
    style.draw_curves(ax, series, "mega-batch t", names[field], f"{data} {width}")
  style.legend(fig, axes)
  return fig


# -- language models (Fig. 5) ----------------------------------------------------------------------
def has_perplexity(group) -> bool:
  return any(r.records and PERPLEXITY_FIELD in r.records[0] for r in group.runs)


def _is_iid(group) -> bool:
  return group.get("stream.iid") is True


def record_macs(record: dict) -> float:
  """The paper-count compute of one record: training, growth's passes and a waiting policy's
  evaluations (the per-step part of `COMP_AXIS`)."""
  return sum(float(record.get(k, 0.0)) for k in ("train_macs", "growth_macs", "trigger_macs"))


def _lm_trajectory(run, n: int, iid: bool) -> dict[str, np.ndarray]:
  """Per mega-batch t = 1 .. n-1 of one run: the test perplexity averaged over 1 .. t (the
  summary's `mean_perplexity` at the end), the compute spent up to t, parameters and experts.
  An i.i.d. run has one point, where it is evaluated after its training: t = n-1, its
  perplexity there."""
  recs = run.records[1:n]
  ppl = np.asarray([float(r[PERPLEXITY_FIELD]) for r in recs])
  out = {"y": np.cumsum(ppl) / np.arange(1, len(ppl) + 1),
         "comp": np.cumsum([record_macs(r) for r in run.records[:n]])[1:] * TERA,
         "params": np.asarray([float(r["num_params"]) for r in recs]),
         "experts": np.asarray([float(r.get("num_experts", math.nan)) for r in recs])}
  if iid:
    out = {k: v[-1:] for k, v in out.items()}
    out["y"] = ppl[-1:]
  return out


def _differs(field: str, groups) -> bool:
  return len({json.dumps(g.get(field), default=repr) for g in groups}) > 1


def lm_label_fields(groups, fields: Sequence[str]) -> list[str]:
  """The fields that tell language-model configs apart in labels: the method and those that
  differ, less the width of a Switch Transformer (it has presets) and the fields that
  `stream.iid` sets (wait B, B times the steps) where only it sets them apart."""
  sequential = [g for g in groups if not _is_iid(g)]
  switch = _all_switch(groups)
  return [f for f in fields if f == "method.name" or (
      not (switch and f in LM_UNLABELLED) and f != "stream.iid"
      and _differs(f, sequential if f in IID_DERIVED else groups))]


def lm_label(group, fields: Sequence[str]) -> str:
  """`group.label(fields)`; an i.i.d. run says so, without the fields `stream.iid` sets."""
  if not _is_iid(group):
    return group.label(fields)
  return group.label([f for f in fields if f not in IID_DERIVED]) + " i.i.d. (at t=B)"


def lm_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"comp", "params", "experts"}: the paper's Fig. 5, one trajectory per config with a point
  per mega-batch t >= 1: the perplexity averaged over the mega-batches so far against the
  compute spent so far, the parameters and the experts at t (mean ± std over seeds); an
  i.i.d. run is one point, its perplexity after its training at t = B. `experts` only when
  records carry `num_experts`; a panel whose points all share one x is left out (it says
  nothing). Compute and parameters are drawn on log axes, so the mega-batches before a
  learner first trains (no compute yet) have no point in the compute panel."""
  groups = [g for g in groups if g.finished and has_perplexity(g)]
  sizes = SwitchSizes(groups, fields)
  shown = lm_label_fields(groups, sizes.others(fields))
  looks = style.Looks(groups, shown + ["stream.iid"] * any(_is_iid(g) for g in groups))
  out: dict[str, list[Series]] = {"comp": [], "params": [], "experts": []}
  if sizes:
    groups = sorted(groups, key=sizes.order)
  for g in groups:
    n = min(len(r.records) for r in g.finished)
    if n < 2:
      continue
    runs = [_lm_trajectory(r, n, _is_iid(g)) for r in g.finished]
    y, ystd = mean_std_columns([r["y"] for r in runs])
    for panel in out:
      x, xstd = mean_std_columns([r[panel] for r in runs])
      if np.isnan(x).any():
        continue
      keep = x > 0 if panel != "experts" else np.ones(len(x), bool)
      if not keep.any():
        continue
      out[panel].append(dict(looks.of(g), label=lm_label(g, shown), iid=_is_iid(g),
                             size=sizes.title(g), x=x[keep].tolist(),
                             xerr=xstd[keep].tolist(), y=y[keep].tolist(),
                             yerr=ystd[keep].tolist()))
  kinds = {k: v for k, v in out.items()
           if v and (k == "comp" or len({x for s in v for x in s["x"]}) > 1)}
  if not sizes:
    return kinds
  # A row of panels per size, in the order of the sizes: "<kind>: <size>".
  drawn = {s["size"] for v in kinds.values() for s in v}
  titles = [t for t in dict.fromkeys(sizes.title(g) for g in groups) if t in drawn]
  return {f"{k}: {t}": [s for s in v if s["size"] == t] for t in titles
          for k, v in kinds.items()}


# -- the figures -----------------------------------------------------------------------------------
CER = "CER (%)"
TFLOPS = "TFLOPs, paper count (training, growth, waiting policy)"


def model_sizes_legend(series: Sequence[Series]) -> list[tuple[str, float]]:
  """(label, marker scale) of each model of a tradeoffs figure, smallest first; [] where all
  its points share one model (one marker size)."""
  scales = {w: f for s in series for w, f in zip(s.get("widths", ()), s.get("marker_scale", ()))}
  if len(scales) < 2:
    return []
  return [(w if isinstance(w, str) else f"width {w}", f)
          for w, f in sorted(scales.items(), key=lambda kv: kv[1])]


def tradeoffs_figure(trade: dict[str, list[Series]], data: str):
  models = model_sizes_legend(trade["comp"])
  fig, axes = subplots(2, legend_entries=len(trade["comp"]) + len(models))
  style.draw_points(axes[0], trade["comp"], TFLOPS, CER, data)
  style.draw_points(axes[1], trade["mem"], "Mem (sum of parameter counts)", CER, data,
                    engineering=True)
  for label, scale in models:  # the legend's key to the marker sizes
    axes[0].plot([], [], color=style.KEY_COLOR, marker="o", linestyle="none",
                 markersize=style.MARKER_SIZE * scale, label=label)
  style.legend(fig, axes)
  return fig


def error_figure(curves: dict[str, list[Series]], data: str):
  fig, axes = subplots(len(curves), height=2.6,
                       legend_entries=len({s["label"] for v in curves.values() for s in v}))
  for ax, (panel, series) in zip(axes, curves.items()):
    style.draw_curves(ax, series, "mega-batch t", "test error (%)", f"{data} {panel}".strip())
  style.legend(fig, axes)
  return fig


def replay_figure(replay: list[Series], data: str):
  fig, axes = subplots(1, legend_entries=len(replay))
  style.draw_points(axes[0], replay, TFLOPS, CER, f"{data}: replay (hollow: with replay)")
  style.legend(fig, axes)
  return fig


def wait_figure(waits: list[Series], data: str):
  """CER against the waiting time, with a tick at every plotted wait (and no other)."""
  fig, axes = subplots(1, legend_entries=len(waits))
  style.draw_points(axes[0], waits, "waiting time w (mega-batches)", CER,
                    f"{data}: waiting time")
  plotted = sorted({float(x) for s in waits for x in s["x"]})
  if plotted:
    from matplotlib import ticker  # pylint: disable=g-import-not-at-top
    axes[0].xaxis.set_major_locator(ticker.FixedLocator(plotted))
    axes[0].xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].xaxis.set_minor_locator(ticker.NullLocator())
  style.legend(fig, axes)
  return fig


LM_XLABELS = {"comp": TFLOPS, "params": "parameters", "experts": "experts"}


def policy_figure(panels: dict[str, list[Series]], data: str):
  fig, axes = subplots(len(panels), legend_entries=len({s["label"] for v in panels.values()
                                                       for s in v}))
  for ax, (panel, series) in zip(axes, panels.items()):
    style.draw_points(ax, series, TFLOPS, CER, f"{data} {panel}: policies vs fixed waits")
  style.legend(fig, axes)
  return fig


def lm_figure(lm: dict[str, list[Series]], data: str):
  """The panels of `lm_series`: a row per Switch Transformer size ("<kind>: <size>" keys),
  titled with it, each row's kinds in columns; one panel per kind for a single size."""
  kinds = list(dict.fromkeys(panel.split(":")[0] for panel in lm))
  fig, axes = subplots(len(lm), legend_entries=len({s["label"] for v in lm.values() for s in v}),
                       max_cols=max(2, len(kinds)) if len(kinds) < len(lm) else 2)
  for ax, (panel, series) in zip(axes, lm.items()):
    kind, _, size = panel.partition(": ")
    style.draw_points(ax, series, LM_XLABELS[kind], "mean test perplexity\nover mega-batches 1..t",
                      f"{data} {size}".strip(), logx=kind != "experts",
                      engineering=kind == "params")
  style.legend(fig, axes)
  return fig


# The figures drawn from the runs' summaries alone (the others need their records over t).
SUMMARY_FIGURES = ("tradeoffs", "replay", "wait", "policies")


def dataset_figures(data: str, groups, fields: Sequence[str], out: str,
                    over_t: bool = True) -> dict[str, dict[str, list[Series]]]:
  """Writes the figures of one data set's groups into `out`; returns their data.

  `fields`: the config fields that tell the groups apart (labels and lines). `over_t`: also
  the figures of the runs' records over t (False: `SUMMARY_FIGURES` only, for runs read
  without their records).
  """
  figures = {}
  trade = tradeoff_series(groups, fields)
  if trade["comp"]:
    figures[f"tradeoffs_{data}"] = (trade, tradeoffs_figure(trade, data))
  curves = error_series(groups, fields) if over_t else {}
  if curves:
    figures[f"error_{data}"] = (curves, error_figure(curves, data))
  replay = replay_series(groups, fields)
  if replay:
    figures[f"replay_{data}"] = ({"replay": replay}, replay_figure(replay, data))
  waits = wait_series(groups, fields)
  if waits:
    figures[f"wait_{data}"] = ({"wait": waits}, wait_figure(waits, data))
  panels = policy_series(groups, fields)
  if panels:
    figures[f"policies_{data}"] = (panels, policy_figure(panels, data))
  lm = lm_series(groups, fields) if over_t else {}
  if lm:
    figures[f"lm_{data}"] = (lm, lm_figure(lm, data))
  plasticity = plasticity_series(groups, fields) if over_t else {}
  if plasticity:
    figures[f"plasticity_{data}"] = (plasticity, plasticity_figure(plasticity, data))
  for name, (_, fig) in figures.items():
    save(fig, os.path.join(out, name))
  return {name: series for name, (series, _) in figures.items()}


# -- one run ---------------------------------------------------------------------------------------
def run_error_png(path: str, curves: Sequence[tuple[str, Sequence[int], Sequence[float]]],
                  title: str = "", ylabel: str = "test error (%)", scale: float = 100.0):
  """Writes `path` (PNG): test error (%) vs mega-batch t, one line per (label, t, error), or
  another per-step measure (`ylabel`, values times `scale`: a language model's perplexity, on a
  log axis where it spans more than `plot_style.LOG_SPAN` times); returns the figure."""
  fig, (ax,) = subplots(1, 4.0, 3.0)
  values = []
  for label, t, err in curves:
    y = scale * np.asarray(err, float)
    values.extend(y.tolist())
    # A marker on every step while they can be told apart.
    ax.plot(t, y, label=label, marker="o" if len(y) <= MARKED_STEPS else None, markersize=3)
  ax.set_yscale(style.axis_scale(values))
  style.whole_steps(ax.xaxis)
  style.finish(ax, "mega-batch t", ylabel, title)
  if len(curves) > 1:
    ax.legend(fontsize=style.FONT_PT)
  with io_utils.output_errors(path), io_utils.atomic_writer(path, "wb") as f:
    fig.savefig(f, format="png", dpi=90)
  return fig


class PlotChild:
  """A child process (`python -m alma_jax.reports.plots`) that draws one `run_error_png`, so
  that the caller never imports matplotlib.

  `start` launches it early: it imports matplotlib while the caller goes on, then waits for
  its figure's JSON on stdin. `draw` sends the figure and waits for it (a child that was not
  started, or has died, is replaced by a fresh one); `close` stops a child that was never
  told to draw.
  """

  def __init__(self):
    self._proc: subprocess.Popen | None = None

  def start(self) -> "PlotChild":
    if self._proc is None:
      try:
        self._proc = self._launch()
      except OSError:  # `draw` tries again, and reports why it cannot
        self._proc = None
    return self

  @staticmethod
  def _launch() -> subprocess.Popen:
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.Popen([sys.executable, "-m", "alma_jax.reports.plots"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)

  def draw(self, path: str, curves, title: str = "", ylabel: str = "test error (%)",
           scale: float = 100.0) -> str | None:
    """`run_error_png(path, curves, title, ylabel, scale)` in the child; returns why it failed
    (None: drawn)."""
    proc, self._proc = self._proc, None
    spec = json.dumps({"path": path, "curves": [list(c) for c in curves], "title": title,
                       "ylabel": ylabel, "scale": scale})
    try:
      if proc is not None and proc.poll() is not None:  # it died: reaped, then replaced
        proc.communicate()
        proc = None
      if proc is None:
        proc = self._launch()
      _, err = proc.communicate(spec, timeout=300)
    except subprocess.TimeoutExpired as e:
      proc.kill()
      proc.communicate()
      return f"{type(e).__name__}: {e}"
    except (OSError, subprocess.SubprocessError) as e:
      return f"{type(e).__name__}: {e}"
    if proc.returncode:
      lines = err.strip().splitlines()
      return lines[-1] if lines else f"exit code {proc.returncode}"
    return None

  def close(self) -> None:
    proc, self._proc = self._proc, None
    if proc is not None:  # it has written nothing: stopping it loses nothing
      proc.kill()
      proc.communicate()


def main() -> int:
  """Draws `run_error_png` of {"path", "title", "curves": [[label, t, errors], ...]} on stdin;
  nothing when stdin is empty. Before it reads, it imports what drawing needs."""
  import signal  # pylint: disable=g-import-not-at-top
  # A Ctrl-C at the terminal reaches the whole process group: the parent decides (it closes
  # this process's stdin), so the child neither dies half-way through a figure nor prints a
  # traceback.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  # What drawing imports (most of a drawing's time), before the figure is asked for.
  import matplotlib.backends.backend_agg  # pylint: disable=g-import-not-at-top,unused-import
  import matplotlib.figure  # pylint: disable=g-import-not-at-top,unused-import
  text = sys.stdin.read()
  if not text.strip():
    return 0
  spec = json.loads(text)
  run_error_png(spec["path"], [tuple(c) for c in spec["curves"]], spec.get("title", ""),
                spec.get("ylabel", "test error (%)"), float(spec.get("scale", 100.0)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
