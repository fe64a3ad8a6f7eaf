"""The look of the report's figures: colours, markers, axes, fonts (see `alma_jax.reports.plots`).

* A colour per method, fixed (`METHOD_COLORS`: the same in every figure and
  every report; a language-model method takes the colour of its image
  counterpart, `lm_sm` that of `sm`); the variants of one method in a figure
  (configs that differ in a field other than the width, the waiting time and
  replay, e.g. gMoE's tree and flat gating) take lighter and darker shades of
  it (`shade`).
* A marker per waiting time (per width where the wait is the x axis), in the
  order of the values; replay draws it hollow, its line dashed. Series whose
  points share an x are drawn a few points apart on the page (`dodge`), so
  that no marker hides another; the shift is in display space, the same
  however far the axis is zoomed, and the data stay exact. The x axis keeps
  room at both ends for the widest shift, so that a dodged marker at the
  first or last x is not cut off (`dodge_margin`). An axis with one x value
  only is never dodged.
* An axis of CER, test error or perplexity is logarithmic where its values
  span more than `LOG_SPAN` times, or more than `SQUASH_SPAN` times with most
  of them in the bottom fifth of a linear axis (`axis_scale`), linear
  otherwise. Log axes get few major
  ticks with plain or engineering labels (`tidy_log_axis`), no labelled minor
  ticks, so tick labels do not overlap.
* Fonts: `FONT_PT` (8 pt) for ticks and legends, `LABEL_PT` for axis labels
  and titles, on panels sized for a printed page (two side by side are 7
  inches wide).
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, Sequence

import numpy as np

from alma_jax.outputs import io_utils

Series = dict[str, Any]
FONT_PT = 8
LEGEND_HANDLE_PT = 40.0  # a legend entry's marker, line and padding, in points
TITLE_MARGIN_PT = 12.0  # a panel's title keeps this far from the next panel's, in points
LEGEND_LINE_IN = 0.15  # the height of a legend label's line, in inches
LABEL_PT = 9
LOG_SPAN = 10.0
SQUASH_SPAN = 3.0
MARKER_SIZE = 5.0
# A series' `marker_scale` runs from the first to the last of these (a figure's smallest model
# to its largest), so that a marker's size tells which model the point is.
MARKER_SCALES = (0.7, 1.4)
KEY_COLOR = "#4d4d4d"  # the legend's key to the marker sizes: a grey that no method has
PANEL_W, PANEL_H = 3.5, 2.9  # inches
DPI = 150
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
# Tableau 10, one per method; methods outside this map get one of SPARE_COLORS by their name.
METHOD_COLORS = {"sm": "#1f77b4", "ens": "#ff7f0e", "umix": "#2ca02c", "gens": "#d62728",
                 "gmoe": "#9467bd", "ff": "#8c564b"}
SPARE_COLORS = ("#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
# Shades of a method's variants: the colour mixed with white (> 0) or black (< 0).
SHADES = (0.0, 0.45, -0.35, 0.7, -0.55)
DODGE_PT = 3.0  # the shift between two dodged series, in points on the page
AXES_SHARE = 0.7  # the least share of a panel's width that its axes take
# Fields that have a look of their own (colour family, marker, fill): not variants.
OWN_LOOK_FIELDS = ("method.name", "model.width", "stream.wait", "stream.replay")


def method_color(name: str) -> str:
  """The colour of method `name` (the same in every figure)."""
  base = name[3:] if name.startswith("lm_") else name
  if base in METHOD_COLORS:
    return METHOD_COLORS[base]
  return SPARE_COLORS[zlib.crc32(base.encode()) % len(SPARE_COLORS)]


def shade(color: str, k: int) -> str:
  """Variant `k` of `color` ("#rrggbb"): 0 is the colour itself, then lighter and darker."""
  f = SHADES[k % len(SHADES)]
  rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
  mixed = [c + (255 - c) * f if f >= 0 else c * (1 + f) for c in rgb]
  return "#" + "".join(f"{int(round(c)):02x}" for c in mixed)


def _order(values) -> list:
  return sorted(set(values), key=lambda v: (v is None, float(v) if _numeric(v) else 0, str(v)))


def _numeric(v) -> bool:
  try:
    float(v)
    return True
  except (TypeError, ValueError):
    return False


class Looks:
  """The colour, marker and fill of every config (group) of one data set's figures, from all of
  its groups, so that a config looks the same in each figure."""

  def __init__(self, groups, fields: Sequence[str]):
    self.variant_fields = [f for f in fields if f not in OWN_LOOK_FIELDS]
    self.waits = _order(g.get("stream.wait") for g in groups)
    self.widths = _order(g.get("model.width") for g in groups)
    variants: dict[str, set] = {}
    for g in self._variant_groups(groups):
      variants.setdefault(str(g.get("method.name")), set()).add(self._variant(g))
    self.variants = {m: sorted(v) for m, v in variants.items()}

  def _variant_groups(self, groups):
    """The groups whose variants share out their method's shades (all of them here)."""
    return groups

  def _variant(self, g) -> str:
    return g.label(self.variant_fields)

  def color(self, g) -> str:
    method = str(g.get("method.name"))
    return shade(method_color(method), self.variants[method].index(self._variant(g)))

  def wait_marker(self, g) -> str:
    return MARKERS[self.waits.index(g.get("stream.wait")) % len(MARKERS)]

  def width_marker(self, g) -> str:
    return MARKERS[self.widths.index(g.get("model.width")) % len(MARKERS)]

  def of(self, g) -> Series:
    """{"color", "marker" (the wait's), "filled" (no replay)} of group `g`."""
    return {"color": self.color(g), "marker": self.wait_marker(g),
            "filled": not g.get("stream.replay")}


# -- statistics ------------------------------------------------------------------------------------
def mean_std(vals) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value) of `vals`: the
  error bars of every figure and table."""
  vals = np.asarray(vals, np.float64)
  return float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else 0.0


def mean_std_columns(rows) -> tuple[np.ndarray, np.ndarray]:
  """Per column of `rows` (one row per seed): mean and sample standard deviation (as
  `mean_std`)."""
  rows = np.asarray(rows, np.float64)
  return rows.mean(0), rows.std(0, ddof=1) if len(rows) > 1 else np.zeros(rows.shape[1:])


# -- figures and axes ------------------------------------------------------------------------------
def subplots(n: int, width: float = PANEL_W, height: float = PANEL_H, legend_entries: int = 0,
             max_cols: int = 2):
  """A figure (no pyplot) with `n` panels, `max_cols` to a row, and room for a legend of
  `legend_entries` below them: (figure, [axes])."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  cols = min(n, max_cols)
  rows = math.ceil(n / cols)
  legend_rows = math.ceil(legend_entries / legend_columns(legend_entries)) if legend_entries else 0
  fig = Figure(figsize=(width * cols, height * rows + 0.2 * legend_rows), layout="constrained")
  axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
  for ax in axes[n:]:
    ax.set_visible(False)
  return fig, axes[:n]


def legend_columns(entries: int) -> int:
  return 1 if entries <= 3 else 2


def save(fig, path_stem: str, formats: Sequence[str] = ("png", "pdf")) -> None:
  """Writes `fig` to `<path_stem>.<format>` for each format, each file atomically."""
  for fmt in formats:
    path = f"{path_stem}.{fmt}"
    with io_utils.output_errors(path), io_utils.atomic_writer(path, "wb") as f:
      fig.savefig(f, format=fmt, dpi=DPI)


def axis_scale(values) -> str:
  """"log" when the finite values are all > 0 and span more than LOG_SPAN times, or more than
  SQUASH_SPAN times with most of them in the bottom fifth of a linear axis (a few large values
  would squash the others); else "linear"."""
  v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
  if not len(v) or (v <= 0).any():
    return "linear"
  lo, hi = v.min(), v.max()
  squashed = hi > SQUASH_SPAN * lo and np.mean(v < lo + 0.2 * (hi - lo)) > 0.5
  return "log" if hi > LOG_SPAN * lo or squashed else "linear"


def _plain(v: float, _=None) -> str:
  return f"{v:g}".replace("e-0", "e-").replace("e+0", "e+")


def tidy_log_axis(axis, values, engineering: bool = False) -> None:
  """Few major ticks on log `axis` (a matplotlib Axis) for data `values`: every decade over
  2.5 decades or more, 1 and 3 per decade over one or more, 1, 2, 3 and 5 over less (so that
  an axis from 10,000 to 45,000 has a label above 20,000), evenly spaced ticks within 0.4
  decades; no labelled minor ticks; labels plain (0.01, 200) or engineering (2M, 100k)."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  v = [x for x in values if x is not None and math.isfinite(x) and x > 0]
  decades = math.log10(max(v) / min(v)) if v else 0.0
  if decades >= 0.4:
    subs = ((1.0,) if decades >= 2.5 else (1.0, 3.0) if decades >= 1.0
            else (1.0, 2.0, 3.0, 5.0))
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=8))
  else:
    axis.set_major_locator(ticker.MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]))
  axis.set_minor_formatter(ticker.NullFormatter())
  axis.set_major_formatter(ticker.EngFormatter(sep="") if engineering
                           else ticker.FuncFormatter(_plain))


def whole_steps(axis) -> None:
  """Major ticks on whole numbers only, on `axis` (a matplotlib Axis) of mega-batches t."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  axis.set_major_locator(ticker.MaxNLocator(integer=True))


def finish(ax, xlabel: str, ylabel: str, title: str = "") -> None:
  """Axis labels, ticks and grid; `title` broken into lines that fit the panel's width (a
  title wider than its panel would run into its neighbour's), and `xlabel` into lines that
  fit the least width of its axes (`fit_axis_label`: centred under the axes, a wider label
  runs off a figure's right-hand panel)."""
  grid = ax.get_gridspec()
  panel_pt = ax.figure.get_figwidth() * 72 / (grid.ncols if grid else 1)
  ax.set_xlabel(fit_axis_label(xlabel, AXES_SHARE * panel_pt, LABEL_PT), fontsize=LABEL_PT)
  ax.set_ylabel(ylabel, fontsize=LABEL_PT)
  if title:
    ax.set_title(fit_label(title, panel_pt - TITLE_MARGIN_PT, LABEL_PT), fontsize=LABEL_PT)
  ax.tick_params(labelsize=FONT_PT)
  ax.grid(alpha=0.3)


def legend(fig, axes) -> None:
  """One legend below the panels, each label once."""
  seen = {}
  for ax in axes:
    for h, l in zip(*ax.get_legend_handles_labels()):
      seen.setdefault(l, h)
  if seen:
    cols = legend_columns(len(seen))
    room = fig.get_figwidth() * 72 / cols - LEGEND_HANDLE_PT
    labels = [fit_label(label, room) for label in seen]
    # The figure was sized for a line per legend row: it grows by the lines added.
    rows = math.ceil(len(labels) / cols)
    added = max(sum(1 + l.count("\n") for l in labels[c * rows:(c + 1) * rows])
                for c in range(cols)) - rows
    fig.set_figheight(fig.get_figheight() + LEGEND_LINE_IN * added)
    fig.legend(list(seen.values()), labels, fontsize=FONT_PT, loc="outside lower center",
               ncols=cols, frameon=False)


def text_width_pt(text: str, size: float = FONT_PT) -> float:
  """The width of `text` set in the figures' font at `size` points, in points."""
  if not text.strip():
    return 0.0
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib.font_manager import FontProperties  # pylint: disable=g-import-not-at-top
  return _ink_width(text, float(size), FontProperties(),
                    tuple(matplotlib.rcParams[k] for k in _TEXT_PATH_PARAMS))


# What else decides a text's outline: whether it is read as math, and the fonts of math.
_TEXT_PATH_PARAMS = ("text.parse_math", "mathtext.fontset")


@functools.lru_cache(maxsize=4096)
def _ink_width(text: str, size: float, font, params: tuple) -> float:
  """`text_width_pt` for the font `font` (a `FontProperties`) under rcParams `params`: the
  width of the text's outline. Building the outline takes ~15 ms on a CPU, and a report
  measures most labels again (each figure breaks the same legend labels)."""
  del params  # part of the key: the outline below reads them from rcParams
  from matplotlib.textpath import TextPath  # pylint: disable=g-import-not-at-top
  return TextPath((0, 0), text, size=size, prop=font).get_extents().width


def fit_label(label: str, room_pt: float, size: float = FONT_PT) -> str:
  """`label` broken at spaces into lines of at most `room_pt` points each, set at `size` (a
  word wider than that keeps a line of its own)."""
  lines: list[str] = []
  for word in label.split(" "):
    if lines and text_width_pt(f"{lines[-1]} {word}", size) <= room_pt:
      lines[-1] = f"{lines[-1]} {word}"
    else:
      lines.append(word)
  return "\n".join(lines)


def fit_axis_label(label: str, room_pt: float, size: float = LABEL_PT) -> str:
  """`label` with each of its lines that is wider than `room_pt` points broken: before its
  first parenthesis where that leaves a head that fits (a unit or a gloss goes to a line of
  its own), then at spaces (`fit_label`)."""
  out = []
  for line in label.split("\n"):
    head, paren, tail = line.partition(" (")
    if text_width_pt(line, size) <= room_pt:
      out.append(line)
    elif paren and text_width_pt(head, size) <= room_pt:
      out += [head, fit_label("(" + tail, room_pt, size)]
    else:
      out.append(fit_label(line, room_pt, size))
  return "\n".join(out)


def dodge(series: Sequence[Series], log: bool = True) -> list[float]:
  """The horizontal shift of each series as drawn, in points: the series whose points share
  an x with another series' are spread `DODGE_PT` apart, centred on the data; none where the
  whole axis has one x value (nothing to tell apart along it)."""
  xs = [np.asarray(s["x"], np.float64) for s in series]
  keys = [{round(math.log10(x) if log else x, 6) for x in v if not log or x > 0} for v in xs]
  shared = [i for i in range(len(xs)) if any(keys[i] & keys[j] for j in range(len(xs)) if j != i)]
  out = [0.0] * len(xs)
  if len(set().union(*keys)) <= 1:
    return out
  for rank, i in enumerate(shared):
    out[i] = (rank - (len(shared) - 1) / 2) * DODGE_PT
  return out


def marker_scale(n: int) -> list[float]:
  """The marker sizes (times `MARKER_SIZE`) of n models, smallest first: growing evenly from
  `MARKER_SCALES[0]` to `MARKER_SCALES[1]`; [1.0] for a single model."""
  if n <= 1:
    return [1.0] * n
  lo, hi = MARKER_SCALES
  return [round(lo + (hi - lo) * i / (n - 1), 3) for i in range(n)]


def dodge_margin(shifts: Sequence[float], width_in: float = PANEL_W,
                 marker_pt: float = MARKER_SIZE) -> float:
  """The x margin (matplotlib's fraction of the data's span, each side) that keeps a marker
  `marker_pt` points wide shifted by up to max |shifts| points inside an axes of a panel
  `width_in` inches wide, 0 where nothing is shifted. The axes take at least `AXES_SHARE`
  of the panel's width (the rest: the y axis' ticks and label); a margin m leaves
  m / (1 + 2m) of the axes' width at each end, which must hold the shift and the marker's
  half width."""
  widest = max((abs(p) for p in shifts), default=0.0)
  if not widest:
    return 0.0
  need = widest + marker_pt / 2 + 1.0  # points: the shift, half the widest marker, its edge
  axes_pt = AXES_SHARE * width_in * 72.0
  return need / (axes_pt - 2 * need)


def _shifted(ax, artists, points: float) -> None:
  """Draws `artists` (data coordinates) `points` to the right on the page."""
  if not points:
    return
  from matplotlib import transforms  # pylint: disable=g-import-not-at-top
  shift = ax.transData + transforms.ScaledTranslation(points / 72.0, 0.0,
                                                      ax.figure.dpi_scale_trans)
  for a in artists:
    a.set_transform(shift)


def draw_points(ax, series: Sequence[Series], xlabel: str, ylabel: str, title: str = "",
                logx: bool = True, engineering: bool = False) -> None:
  """Markers with error bars, a line through each series' points (dashed with replay; none
  where the series says it is not `joined`; a segment's hollow ends drawn hollow; each
  marker `MARKER_SIZE` times the series' `marker_scale` of its point, where it has one);
  log x (tidy ticks), y log where it spans > LOG_SPAN."""
  shifts = dodge(series, logx)
  for s, points in zip(series, shifts):
    x = np.asarray(s["x"], np.float64)
    filled = s.get("filled", True)
    hollow = s.get("hollow", [not filled] * len(x))
    line = ("-" if filled else "--") if s.get("joined", True) else "none"
    bars = ax.errorbar(x, s["y"], xerr=s.get("xerr"), yerr=s.get("yerr"), color=s["color"],
                       linestyle=line, linewidth=1.2, capsize=2,
                       marker="none", elinewidth=0.8, label=None)
    drawn = list(bars.get_children())
    scale = s.get("marker_scale") or [1.0] * len(x)
    for filled_pts in (True, False):
      for size in sorted(set(scale)):
        sel = [i for i in range(len(x)) if hollow[i] != filled_pts and scale[i] == size]
        if sel:
          drawn += ax.plot(x[sel], np.asarray(s["y"])[sel], linestyle="none",
                           marker=s["marker"], markersize=MARKER_SIZE * size, color=s["color"],
                           markeredgewidth=1.0,
                           markerfacecolor=s["color"] if filled_pts else "white")
    _shifted(ax, drawn, points)
    ax.plot([], [], color=s["color"], marker=s["marker"], markersize=MARKER_SIZE,
            linestyle=line, markerfacecolor=s["color"] if filled else "white",
            label=s["label"])
  grid = ax.get_gridspec()
  widest = MARKER_SIZE * max((max(s.get("marker_scale") or [1.0]) for s in series), default=1.0)
  margin = dodge_margin(shifts, ax.figure.get_figwidth() / (grid.ncols if grid else 1), widest)
  if margin > ax.margins()[0]:
    ax.set_xmargin(margin)
  _scales(ax, series, logx, engineering)
  finish(ax, xlabel, ylabel, title)


def _scales(ax, series, logx: bool, engineering: bool) -> None:
  xs = [x for s in series for x in s["x"] if math.isfinite(x)]  # nan: a point not drawn
  ys = [y for s in series for y in s["y"]]
  if logx and xs and min(xs) > 0:
    ax.set_xscale("log")
    tidy_log_axis(ax.xaxis, xs, engineering)
  if axis_scale(ys) == "log":
    ax.set_yscale("log")
    tidy_log_axis(ax.yaxis, ys)


def draw_curves(ax, series: Sequence[Series], xlabel: str, ylabel: str, title: str = "") -> None:
  """Lines over t with a band of ± one standard deviation; the wait's marker every ~t/6
  points, staggered between series; dashed with replay; y log where it spans > LOG_SPAN."""
  for k, s in enumerate(series):
    x, y, e = np.asarray(s["x"]), np.asarray(s["y"]), np.asarray(s["yerr"])
    every = max(1, len(x) // 6)
    filled = s.get("filled", True)
    ax.plot(x, y, label=s["label"], color=s["color"], linewidth=1.2,
            linestyle="-" if filled else "--", marker=s.get("marker"), markersize=MARKER_SIZE,
            markevery=(k * every // max(1, len(series)) % every, every),
            markerfacecolor=s["color"] if filled else "white")
    if np.any(e > 0):
      ax.fill_between(x, y - e, y + e, alpha=0.15, color=s["color"], linewidth=0)
  ys = [y for s in series for y in s["y"]]
  if axis_scale(ys) == "log":  # limits from the means: a band may reach down to 0
    ax.set_yscale("log")
    ax.set_ylim(min(ys) / 1.3, max(ys) * 1.3)
    tidy_log_axis(ax.yaxis, ys)
  whole_steps(ax.xaxis)
  finish(ax, xlabel, ylabel, title)
