"""Figures of ALMA runs (matplotlib, drawn without pyplot on the Agg canvas).

Every figure function computes the data it plots first — a list of series
per panel, each a dict with `label`, `x`, `y` and their standard deviations
over seeds (`xerr`, `yerr`) — draws exactly that, writes `<name>.png` and
`<name>.pdf`, and returns {name: {panel: series}} so that tests and callers
can check what was drawn. `run_error_png` is the small error-vs-time figure
that each finished run writes into its workdir; a run draws it in a child
process (`python -m alma_jax.plots` with the figure's JSON on stdin), so that
the training process never imports matplotlib.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Sequence

import numpy as np

from alma_jax import io_utils

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
TERA = 1e-12
Series = dict[str, Any]


def subplots(ncols: int, width: float = 4.2, height: float = 3.4, legend_entries: int = 0):
  """A figure (no pyplot) with `ncols` panels in a row, and room for a legend of
  `legend_entries` below them: (figure, [axes])."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  height += 0.16 * legend_entries
  fig = Figure(figsize=(width * ncols, height), layout="constrained")
  axes = fig.subplots(1, ncols, squeeze=False)[0]
  return fig, list(axes)


def save(fig, path_stem: str, formats: Sequence[str] = ("png", "pdf")) -> None:
  """Writes `fig` to `<path_stem>.<format>` for each format, each file atomically."""
  for fmt in formats:
    path = f"{path_stem}.{fmt}"
    with io_utils.output_errors(path), io_utils.atomic_writer(path, "wb") as f:
      fig.savefig(f, format=fmt, dpi=110)


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


def _colors(names: Sequence[str]) -> dict[str, str]:
  return {n: f"C{i % 10}" for i, n in enumerate(sorted(set(names)))}


def _markers(values) -> dict:
  return {v: MARKERS[i % len(MARKERS)] for i, v in enumerate(sorted(set(values)))}


def _draw(ax, series: Sequence[Series], *, line: bool = True) -> None:
  for s in series:
    ax.errorbar(s["x"], s["y"], xerr=s.get("xerr"), yerr=s.get("yerr"), label=s["label"],
                color=s.get("color"), marker=s.get("marker", "o"), capsize=2, markersize=5,
                markerfacecolor=None if s.get("filled", True) else "none",
                linestyle="-" if line else "none")


def _line_key(g, fields: Sequence[str]) -> tuple:
  return tuple(str(g.get(f)) for f in fields)


# -- CER vs compute and memory (Fig. 2/7), replay (Fig. 4) -----------------------------------------
def _stat_points(groups, xfield: str, yfield: str, xscale: float, yscale: float = 1.0):
  pts = [(g.stat(xfield), g.stat(yfield)) for g in groups]
  return {"x": [m * xscale for (m, _), _ in pts], "xerr": [s * xscale for (_, s), _ in pts],
          "y": [m * yscale for _, (m, _) in pts], "yerr": [s * yscale for _, (_, s) in pts]}


def tradeoff_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"comp": ..., "mem": ...}: one series per config across widths (finished runs only)."""
  groups = [g for g in groups if g.finished]
  line_fields = [f for f in fields if f != "model.width"]
  # A colour per method, and per variant of a method (e.g. gMoE with tree and flat gating): the
  # marker tells the waiting time and its fill the replay, so these are left out of the colour.
  color_fields = [f for f in line_fields if f not in ("stream.wait", "stream.replay")]
  colors = _colors([g.label(color_fields) for g in groups])
  markers = _markers([g.get("stream.wait") for g in groups])
  lines: dict[tuple, list] = {}
  for g in groups:
    lines.setdefault(_line_key(g, line_fields), []).append(g)
  out = {"comp": [], "mem": []}
  for members in lines.values():
    members = sorted(members, key=lambda g: float(g.get("model.width") or 0))
    style = {"label": members[0].label(line_fields), "color": colors[members[0].label(color_fields)],
             "marker": markers[members[0].get("stream.wait")],
             "filled": not members[0].get("stream.replay"),
             "widths": [m.get("model.width") for m in members]}
    out["comp"].append(dict(style, **_stat_points(members, "comp_paper", "cer_percent", TERA)))
    out["mem"].append(dict(style, **_stat_points(members, "mem", "cer_percent", 1.0)))
  return out


def _lines_over(groups, fields: Sequence[str], field: str):
  """(the other fields, a colour per method, [the finished groups of one config sorted by
  `field`]) for every config that has two or more values of `field`."""
  groups = [g for g in groups if g.finished]
  others = [f for f in fields if f != field]
  colors = _colors([str(g.get("method.name")) for g in groups])
  lines: dict[tuple, list] = {}
  for g in groups:
    lines.setdefault(_line_key(g, others), []).append(g)
  return others, colors, [sorted(m, key=lambda g: float(g.get(field) or 0))
                          for m in lines.values() if len({g.get(field) for g in m}) > 1]


def replay_series(groups, fields: Sequence[str]) -> list[Series]:
  """Segments from each config without replay to the same config with replay."""
  others, colors, lines = _lines_over(groups, fields, "stream.replay")
  return [dict(_stat_points(members, "comp_paper", "cer_percent", TERA),
               label=members[0].label(others), color=colors[str(members[0].get("method.name"))],
               replay=[g.get("stream.replay") for g in members]) for members in lines]


def wait_series(groups, fields: Sequence[str]) -> list[Series]:
  """CER against the waiting time w: one series per config over its waits (two or more)."""
  others, colors, lines = _lines_over(groups, fields, "stream.wait")
  markers = _markers([str(g.get("model.width")) for g in groups])
  out = []
  for members in lines:
    cer = [g.stat("cer_percent") for g in members]
    first = members[0]
    out.append({"label": first.label(others), "color": colors[str(first.get("method.name"))],
                "marker": markers[str(first.get("model.width"))],
                "filled": not first.get("stream.replay"),
                "x": [float(g.get("stream.wait")) for g in members],
                "y": [m for m, _ in cer], "yerr": [s for _, s in cer]})
  return out


# -- error over time (Fig. 1/3) ----------------------------------------------------------------------
def error_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"width=<w>": one series per config}: mean test error (%) over t, std over seeds."""
  others = [f for f in fields if f != "model.width"]
  colors = _colors([g.label(others) for g in groups])
  out: dict[str, list[Series]] = {}
  for g in sorted(groups, key=lambda g: float(g.get("model.width") or 0)):
    t, mean, std = g.curve("test_error")
    out.setdefault(f"width={g.get('model.width')}", []).append(
        {"label": g.label(others), "color": colors[g.label(others)], "x": t.tolist(),
         "y": (100 * mean).tolist(), "yerr": (100 * std).tolist()})
  return out


def _draw_curves(ax, series: Sequence[Series]) -> None:
  for s in series:
    x, y, e = np.asarray(s["x"]), np.asarray(s["y"]), np.asarray(s["yerr"])
    ax.plot(x, y, label=s["label"], color=s.get("color"))
    if np.any(e > 0):
      ax.fill_between(x, y - e, y + e, alpha=0.2, color=s.get("color"))


# -- language models (Fig. 5) --------------------------------------------------------------------------
PERPLEXITY_FIELD = "test_perplexity"


def has_perplexity(group) -> bool:
  return any(r.records and PERPLEXITY_FIELD in r.records[0] for r in group.runs)


def _lm_trajectory(run, n: int) -> dict[str, np.ndarray]:
  """Per mega-batch t = 1 .. n-1 of one run: the test perplexity averaged over 1 .. t (the
  summary's `mean_perplexity` at the end), the compute spent up to t, parameters and experts."""
  recs = run.records[1:n]
  ppl = np.asarray([float(r[PERPLEXITY_FIELD]) for r in recs])
  return {"y": np.cumsum(ppl) / np.arange(1, len(ppl) + 1),
          "comp": np.cumsum([float(r.get("train_macs", 0.0)) for r in run.records[:n]])[1:] * TERA,
          "params": np.asarray([float(r["num_params"]) for r in recs]),
          "experts": np.asarray([float(r.get("num_experts", math.nan)) for r in recs])}


def lm_series(groups, fields: Sequence[str]) -> dict[str, list[Series]]:
  """{"comp", "params", "experts"}: the paper's Fig. 5, one trajectory per config with a point
  per mega-batch t >= 1: the perplexity averaged over the mega-batches so far against the
  compute spent so far, the parameters and the experts at t (mean ± std over seeds);
  `experts` only when records carry `num_experts`. Compute and parameters are drawn on log
  axes, so the mega-batches before a learner first trains (no compute yet: the i.i.d. learner
  until it has waited for the whole stream) have no point in the compute panel."""
  groups = [g for g in groups if g.finished and has_perplexity(g)]
  colors = _colors([g.label(fields) for g in groups])
  markers = _markers([str(g.get("method.name")) for g in groups])
  out: dict[str, list[Series]] = {"comp": [], "params": [], "experts": []}
  for g in groups:
    n = min(len(r.records) for r in g.finished)
    if n < 2:
      continue
    runs = [_lm_trajectory(r, n) for r in g.finished]
    y, ystd = mean_std_columns([r["y"] for r in runs])
    for panel in out:
      x, xstd = mean_std_columns([r[panel] for r in runs])
      if np.isnan(x).any():
        continue
      keep = x > 0 if panel != "experts" else np.ones(len(x), bool)
      if not keep.any():
        continue
      out[panel].append({"label": g.label(fields), "color": colors[g.label(fields)],
                         "marker": markers[str(g.get("method.name"))],
                         "x": x[keep].tolist(), "xerr": xstd[keep].tolist(),
                         "y": y[keep].tolist(), "yerr": ystd[keep].tolist()})
  return {k: v for k, v in out.items() if v}


# -- the figures of one data set ---------------------------------------------------------------------
def _finish(ax, xlabel: str, ylabel: str, title: str = "", logx: bool = False) -> None:
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title, fontsize=9)
  if logx:
    ax.set_xscale("log")
  ax.grid(alpha=0.3)


def _legend(fig, axes) -> None:
  """One legend below the panels, each label once."""
  seen = {}
  for ax in axes:
    for h, l in zip(*ax.get_legend_handles_labels()):
      seen.setdefault(l, h)
  if seen:
    fig.legend(list(seen.values()), list(seen), fontsize=6, loc="outside lower center")


def dataset_figures(data: str, groups, fields: Sequence[str],
                    out: str) -> dict[str, dict[str, list[Series]]]:
  """Writes the figures of one data set's groups into `out`; returns their data.

  `fields`: the config fields that tell the groups apart (labels and lines).
  """
  figures = {}
  trade = tradeoff_series(groups, fields)
  if trade["comp"]:
    fig, axes = subplots(2, legend_entries=len(trade["comp"]))
    _draw(axes[0], trade["comp"])
    _finish(axes[0], "training TFLOPs (paper count)", "CER (%)", data, logx=True)
    _draw(axes[1], trade["mem"])
    _finish(axes[1], "Mem (sum of parameter counts)", "CER (%)", data, logx=True)
    _legend(fig, axes)
    save(fig, os.path.join(out, f"tradeoffs_{data}"))
    figures[f"tradeoffs_{data}"] = trade
  curves = error_series(groups, fields)
  if curves:
    fig, axes = subplots(len(curves), legend_entries=len({s["label"] for v in curves.values()
                                                          for s in v}))
    for ax, (panel, series) in zip(axes, curves.items()):
      _draw_curves(ax, series)
      _finish(ax, "mega-batch t", "test error (%)", f"{data} {panel}")
    _legend(fig, axes)
    save(fig, os.path.join(out, f"error_{data}"))
    figures[f"error_{data}"] = curves
  replay = replay_series(groups, fields)
  if replay:
    fig, axes = subplots(1, legend_entries=len(replay))
    _draw(axes[0], replay)
    _finish(axes[0], "training TFLOPs (paper count)", "CER (%)", f"{data}: replay", logx=True)
    _legend(fig, axes)
    save(fig, os.path.join(out, f"replay_{data}"))
    figures[f"replay_{data}"] = {"replay": replay}
  waits = wait_series(groups, fields)
  if waits:
    fig, axes = subplots(1, legend_entries=len(waits))
    _draw(axes[0], waits)
    _finish(axes[0], "waiting time w (mega-batches)", "CER (%)", f"{data}: waiting time",
            logx=True)
    axes[0].set_yscale("log")
    _legend(fig, axes)
    save(fig, os.path.join(out, f"wait_{data}"))
    figures[f"wait_{data}"] = {"wait": waits}
  lm = lm_series(groups, fields)
  if lm:
    labels = {"comp": "training TFLOPs (paper count)", "params": "parameters",
              "experts": "experts"}
    fig, axes = subplots(len(lm), legend_entries=len({s["label"] for v in lm.values()
                                                      for s in v}))
    for ax, (panel, series) in zip(axes, lm.items()):
      _draw(ax, series)
      _finish(ax, labels[panel], "average perplexity (mega-batches 1..t)", data,
              logx=panel != "experts")
      ax.set_yscale("log")
    _legend(fig, axes)
    save(fig, os.path.join(out, f"lm_{data}"))
    figures[f"lm_{data}"] = lm
  return figures


# -- one run -----------------------------------------------------------------------------------------
def run_error_png(path: str, curves: Sequence[tuple[str, Sequence[int], Sequence[float]]],
                  title: str = "") -> None:
  """Writes `path` (PNG): test error (%) vs mega-batch t, one line per (label, t, error)."""
  fig, (ax,) = subplots(1, 4.0, 3.0)
  for label, t, err in curves:
    ax.plot(t, 100 * np.asarray(err, float), label=label)
  _finish(ax, "mega-batch t", "test error (%)", title)
  if len(curves) > 1:
    ax.legend(fontsize=6)
  with io_utils.output_errors(path), io_utils.atomic_writer(path, "wb") as f:
    fig.savefig(f, format="png", dpi=90)


def run_error_png_in_child(path: str, curves, title: str = "") -> str | None:
  """`run_error_png` in a child process (`python -m alma_jax.plots`), so that the caller
  never imports matplotlib; returns why it failed (None: drawn)."""
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  spec = {"path": path, "curves": [list(c) for c in curves], "title": title}
  try:
    proc = subprocess.run([sys.executable, "-m", "alma_jax.plots"], input=json.dumps(spec),
                          env=env, capture_output=True, text=True, timeout=300, check=False)
  except (OSError, subprocess.SubprocessError) as e:
    return f"{type(e).__name__}: {e}"
  if proc.returncode:
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"
  return None


def main() -> int:
  """Draws `run_error_png` of {"path", "title", "curves": [[label, t, errors], ...]} on stdin."""
  spec = json.load(sys.stdin)
  run_error_png(spec["path"], [tuple(c) for c in spec["curves"]], spec.get("title", ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
