"""The gating tree of a gMoE run over a 2-D embedding of test inputs (early version, Fig. 5).

`gating_data(workdir)` rebuilds the run's learner from its last checkpoint
(the config in its `config.json`, the method's structure in the checkpoint),
routes the test inputs of the run's data set through every mixture layer
(`GrowingMoE.route`: the expert reached by following the more probable child
at each gate) and embeds the inputs in 2-D by PCA of their normalised pixels.
`draw` writes one panel per mixture layer: the embedded inputs coloured by
their expert, each expert labelled by its path from the root (L/R).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import ml_collections
import numpy as np

from alma_jax import methods
from alma_jax import tasks
from alma_jax.data import augment
from alma_jax.engine import population
from alma_jax.engine.optim import make_optimizer
from alma_jax.methods import expert_growth
from alma_jax.outputs import checkpoint as ckpt_lib
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as wd
from alma_jax.reports import plot_style
from alma_jax.reports import plots
from alma_jax.stream import validation

MAX_POINTS = 2000


class GatingError(ValueError):
  """The run cannot be drawn (not gMoE, no checkpoint)."""


@dataclasses.dataclass(frozen=True)
class GatingData:
  t: int  # the checkpoint's time step
  embedding: np.ndarray  # (n, 2) PCA of the test inputs
  experts: list[np.ndarray]  # per mixture layer: (n,) the expert of each input
  paths: list[dict[int, str]]  # per mixture layer: expert -> its path from the root


def pca_2d(x: np.ndarray) -> np.ndarray:
  """(n, d) -> (n, 2): the projection on the two leading principal components."""
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  x = x - x.mean(0)
  _, _, vt = np.linalg.svd(x, full_matrices=False)
  return x @ vt[:2].T


def leaf_paths(node: dict, prefix: str = "") -> dict[int, str]:
  """expert -> "LR..." from `GrowingMoE.gating_tree`'s nested dicts: its path of left and right
  turns from the root (flat gating: "softmax", one gate over all the experts)."""
  if "expert" in node:
    return {node["expert"]: prefix or "root"}
  kids = node["children"]
  names = "LR" if len(kids) == 2 else ["softmax"] * len(kids)
  out = {}
  for name, kid in zip(names, kids):
    out.update(leaf_paths(kid, prefix + name))
  return out


def _config(workdir: str):
  path = os.path.join(workdir, wd.CONFIG_FILE)
  try:
    return validation.validate(ml_collections.ConfigDict(io_utils.read_json(path)))
  except (OSError, ValueError) as e:
    raise GatingError(f"{path} cannot be read as a config: {e}") from e


def _restore(workdir: str, config, method):
  """The last checkpoint's learner (unstacked) and its t."""
  tx, keys = make_optimizer(config.optimizer), population.keys([int(config.seed)])
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def build(structure, has_opt_state):
    return ckpt_lib.abstract_state(method, tx, keys, structure, has_opt_state,
                                   lambda _, v: jax.tree.map(lambda _: device, v))

  directory = os.path.join(workdir, wd.CHECKPOINT_DIR)
  with ckpt_lib.Checkpointer(directory, int(config.checkpoint.max_to_keep)) as ckpt:
    snap = ckpt.restore_latest(build)
  return population.unstack(snap.learner, 0), snap.t


def gating_data(workdir: str, max_points: int = MAX_POINTS) -> GatingData:
  """Routes up to `max_points` test inputs through the last checkpoint of a gMoE run."""
  config = _config(workdir)
  if config.method.name != "gmoe" or config.num_seeds != 1:
    raise GatingError(f"{workdir}: the gating tree needs a gMoE run of one seed; this one has "
                      f"config.method.name={config.method.name!r}, "
                      f"config.num_seeds={config.num_seeds}")
  if expert_growth.has_own_experts(config.model):
    raise GatingError(f"{workdir}: config.model.name={config.model.name!r} routes through "
                      "expert layers of its own, not a gating tree")
  if not wd.checkpoint_steps(workdir):
    raise GatingError(f"{workdir} has no checkpoint to draw the gating of "
                      f"({os.path.join(workdir, wd.CHECKPOINT_DIR)} is missing or empty)")
  task = tasks.for_config(config)
  ds, _ = task.load(config, [int(config.seed)])
  method = methods.make(config, ds.train_x.shape[1:], ds.num_classes)
  learner, t = _restore(workdir, config, method)
  x = augment.prepare_batch(np.asarray(ds.test_x[:max_points]), ds.mean, ds.std, augment="none",
                            rng=None)
  layers = range(len(learner.structure))
  experts = [np.asarray(method.route(learner, x, layer)) for layer in layers]
  paths = [leaf_paths(method.gating_tree(learner, layer)) for layer in layers]
  return GatingData(t=t, embedding=pca_2d(np.asarray(x)), experts=experts, paths=paths)


def expert_colors(n: int) -> list[str]:
  """A colour per expert: Tableau 10, Tableau 20 beyond ten experts."""
  from matplotlib import colormaps, colors  # pylint: disable=g-import-not-at-top
  cmap = colormaps["tab10" if n <= 10 else "tab20"]
  return [colors.to_hex(cmap(i % cmap.N)) for i in range(n)]


def draw(data: GatingData, path_stem: str, title: str = "") -> dict:
  """Writes the figure to `<path_stem>.png/.pdf`, a panel per mixture layer (one above the
  other, each with its legend on the right); returns {"layer<l>": [series per expert]}."""
  fig, axes = plots.subplots(len(data.experts), width=5.2, height=3.0, max_cols=1)
  out = {}
  for layer, (ax, experts, paths) in enumerate(zip(axes, data.experts, data.paths)):
    series = []
    for e, color in zip(sorted(paths), expert_colors(len(paths))):
      sel = experts == e
      series.append({"label": f"expert {e} ({paths[e]})", "expert": e, "count": int(sel.sum()),
                     "color": color, "x": data.embedding[sel, 0].tolist(),
                     "y": data.embedding[sel, 1].tolist()})
      ax.scatter(series[-1]["x"], series[-1]["y"], s=6, alpha=0.8, color=color, linewidths=0,
                 label=series[-1]["label"])
    plot_style.finish(ax, "PC 1 of the test inputs", "PC 2", f"mixture layer {layer} at "
                      f"t={data.t}")
    ax.legend(fontsize=plot_style.FONT_PT, markerscale=2, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    out[f"layer{layer}"] = series
  if title:
    fig.suptitle(title, fontsize=plot_style.LABEL_PT)
  plots.save(fig, path_stem)
  return out
