"""Backbones by name: `config.model.name` -> the `BackboneSpec` its module declares.

A backbone is one module of `alma_jax/models/` that builds a Flax Linen
module from `config.model` and declares, in a module-level `SPEC`, what the
rest of the code may do with it: the data it models, whether convolutions
dominate its train step (the CPU speed rules read this, never the name), how
Firefly grows its width and where gMoE mixes experts. A capability left
undeclared (None) makes the methods that need it refuse the backbone with an
error naming it. `alma_jax.models` registers the package's backbones; a
backbone defined elsewhere is `register`ed the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax

from alma_jax.configuration.plugins import backbones as declared_backbones
from alma_jax.errors import ConfigError

Path = tuple[str, ...]
ModelConfig = Any  # the `config.model` ConfigDict


def leaf_at(tree, path: Path):
  """The leaf of the nested dict `tree` at `path` (a `WidthLayout` path)."""
  return functools.reduce(lambda d, k: d[k], path, tree)


def has_leaf(tree, path: Path) -> bool:
  """Whether the nested dict `tree` holds a leaf at `path`."""
  for k in path:
    if not isinstance(tree, dict) or k not in tree:
      return False
    tree = tree[k]
  return True


def replace_leaves(tree, edits: dict):
  """A new tree with the leaves at the paths of `edits` replaced (the input is untouched);
  lists in the tree (e.g. channel-slot masks) are walked by their indices."""
  def keys(path):
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)

  return jax.tree_util.tree_map_with_path(lambda p, x: edits.get(keys(p), x), tree)


@dataclasses.dataclass(frozen=True)
class WidthLayout:
  """A backbone's growable layers (Firefly) and where their weights live.

  A layer's output channels are the last axis of every one of its leaves,
  and the next layer's kernel (the classifier's, after the last layer) takes
  them on its axis -2: the classifier must see the last layer's channels
  alone (a 1x1 map, no pooling over positions).

  Attributes:
    kernels: per growable layer, the path of its kernel (..., inputs, outputs) in params.
    vectors: per layer, (path in params, value of a new neuron) of its per-neuron params.
    stats: per layer, (path in the model state, value of a new neuron) of its per-neuron state.
    build: `build(widths)`, the backbone with one width per growable layer; equal widths
      give the parameters of `make_backbone`'s module of that width.
    head: the path of the classifier kernel (inputs, classes).
    units: per layer, the path in the `intermediates` collection where the backbone sows the
      layer's output after its activation (`Module.sow`, kept only when an apply asks for
      that collection): what the plasticity diagnostics and unit resets read.
    readers: per layer, further kernels that take its channels on axis -2 besides the next
      layer's (a gMoE layer's output feeds the next mixture's gates too); a path the
      learner does not hold (a mixture with one expert has no gates) is skipped. A reader
      whose axis -2 is k times the layer's width takes the channels at k positions,
      position-major (row p * width + j reads channel j: a flattened, pooled image map).
    slotted: per layer, whether its leaves hold one copy of the layer per expert slot on
      their leading axis, each with units of its own (an inner layer of gMoE's experts):
      its units are then every slot's, slot-major (unit j of slot s is s * width + j), and
      its next kernel is the same slot's; () : none is.
  """

  kernels: tuple[Path, ...]
  vectors: tuple[tuple[tuple[Path, float], ...], ...]
  stats: tuple[tuple[tuple[Path, float], ...], ...]
  build: Callable[[tuple[int, ...]], nn.Module] | None = dataclasses.field(compare=False)
  head: Path = ("head", "kernel")
  units: tuple[Path, ...] = ()
  readers: tuple[tuple[Path, ...], ...] = ()
  slotted: tuple[bool, ...] = ()

  def outgoing(self, layer: int, params) -> tuple[Path, ...]:
    """The kernels that take `layer`'s channels on their axis -2: the next layer's (or the
    classifier's) and the `readers` of the layer (e.g. the gates of a mixture that reads it)
    that `params` holds."""
    extra = self.readers[layer] if layer < len(self.readers) else ()
    return (self.next_kernel(layer),) + tuple(p for p in extra if has_leaf(params, p))

  def is_slotted(self, layer: int) -> bool:
    return layer < len(self.slotted) and self.slotted[layer]

  def within(self, at: Path, stats_at: Path | None = None) -> "WidthLayout":
    """This layout of a sub-network whose parameters sit at `at` in the whole network's
    (its sown outputs too) and its model state's collections at `stats_at` (default
    `at`): every path prefixed."""
    stats_at = at if stats_at is None else stats_at
    return dataclasses.replace(
        self, kernels=tuple(at + k for k in self.kernels),
        vectors=tuple(tuple((at + p, v) for p, v in l) for l in self.vectors),
        stats=tuple(tuple((p[:1] + stats_at + p[1:], v) for p, v in l) for l in self.stats),
        units=tuple(at + u for u in self.units),
        readers=tuple(tuple(at + p for p in l) for l in self.readers))

  @property
  def num_layers(self) -> int:
    return len(self.kernels)

  def next_kernel(self, layer: int) -> Path:
    return self.kernels[layer + 1] if layer + 1 < len(self.kernels) else self.head


def joined(parts, **fields) -> WidthLayout:
  """The layers of the layouts `parts` in order, as one layout (`fields` replace its other
  attributes: `build`, `head`, ...); `readers` and `slotted` are kept per layer."""
  parts = tuple(parts)
  per_layer = lambda name, empty: tuple(
      (getattr(p, name)[l] if l < len(getattr(p, name)) else empty)
      for p in parts for l in range(p.num_layers))
  return WidthLayout(
      kernels=sum((p.kernels for p in parts), ()), vectors=sum((p.vectors for p in parts), ()),
      stats=sum((p.stats for p in parts), ()), build=fields.pop("build", None),
      units=sum((p.units for p in parts), ()), readers=per_layer("readers", ()),
      slotted=per_layer("slotted", False), **fields)


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Where a backbone mixes experts (gMoE, `alma_jax.models.moe`): stem -> mixtures -> head.

  Attributes:
    experts: per mixture layer, the expert sub-network; the layer's experts are copies of
      it with parameters (and BatchNorm statistics) of their own.
    stem: shared layers before the first mixture (None: none).
    head: the shared classifier (None: a linear map of the flattened features).
    pooled_gates: whether a gate sees its image input average-pooled (to
      `method.gate_pool`) rather than flattened as it is.
    gather_hard_eval: with hard gating at test time, run only each example's chosen expert
      by gathering its parameters (cheap for dense layers; a batch-sized grouped
      convolution otherwise); else every expert runs and the chosen output is selected.
    expert_units: per mixture layer, the hidden layers of its expert sub-network (a
      `WidthLayout` with paths inside one expert; `units`: where it sows the output of each
      layer but the last, at least): gMoE's plasticity diagnostics and unit resets see an
      expert's inner layers as units of each expert slot, and its last layer as the
      channels of the mixture's output (the same output of every expert, read from the
      mixture; the classifier, then the default linear head, and the next mixture read
      them); None: the backbone's mixtures expose no hidden units.
    stem_units: the stem's hidden layers, as `expert_units` (None: none exposed).
  """

  experts: tuple[nn.Module, ...]
  stem: nn.Module | None = None
  head: nn.Module | None = None
  pooled_gates: bool = True
  gather_hard_eval: bool = False
  expert_units: tuple[WidthLayout, ...] | None = None
  stem_units: WidthLayout | None = None


@dataclasses.dataclass(frozen=True)
class BackboneSpec:
  """What a backbone is and what it can do (each backbone module declares one as `SPEC`).

  Attributes:
    name: its `config.model.name`.
    build: `build(config.model, num_classes)`, the Flax Linen module; called as
      `module.apply(variables, x, train=..., mask=...)`, it returns the logits and keeps
      BatchNorm statistics, if any, in the `batch_stats` collection.
    tasks: the data it models (`alma_jax.tasks`): "images", "text".
    conv_heavy: whether convolutions dominate its train step. The CPU speed rules apply
      to it (`model.conv_impl` and `train.cpu_fusion` are chosen for it, ensemble members
      run as a loop, seeds as separate runs), and it reads `config.model.conv_impl`.
    width_layout: `width_layout(config.model, num_classes)`, its `WidthLayout` for Firefly;
      None: its width cannot grow.
    mixture: `mixture(config.model, num_classes)`, its `Mixture` for gMoE; None: it has no
      mixture-of-experts version.
    side_multiple: the height and width of the images it takes are multiples of this
      (e.g. 2**k for k 2x2 max-pools that halve them exactly); 1: images of any size.
  """

  name: str
  build: Callable[[ModelConfig, int], nn.Module]
  tasks: tuple[str, ...] = ("images",)
  conv_heavy: bool = False
  width_layout: Callable[[ModelConfig, int], WidthLayout] | None = None
  mixture: Callable[[ModelConfig, int], Mixture] | None = None
  side_multiple: int = 1


# What each optional capability is, for the error of a method that needs it.
CAPABILITIES = {
    "width_layout": "the growable layers of Firefly",
    "mixture": "the mixture points and expert sub-network of gMoE",
}

BACKBONES: dict[str, BackboneSpec] = {}


def register(backbone: BackboneSpec) -> BackboneSpec:
  """Makes `backbone` available as `config.model.name=backbone.name`; returns it."""
  if backbone.name in BACKBONES and BACKBONES[backbone.name] is not backbone:
    raise ValueError(f"backbone name {backbone.name!r} registered twice")
  cls = getattr(backbone.build, "__self__", backbone.build)
  declared_backbones.declare(backbone.name, declared_backbones.Backbone(
      tuple(backbone.tasks), own_experts=callable(getattr(cls, "copy_experts", None))))
  BACKBONES[backbone.name] = backbone
  return backbone


def names(where: Callable[[BackboneSpec], bool] | None = None) -> list[str]:
  """The registered names (those whose spec satisfies `where`), sorted."""
  return sorted(n for n, s in BACKBONES.items() if where is None or where(s))


def spec(name: str) -> BackboneSpec:
  """The spec registered under `name`."""
  if name not in BACKBONES:
    raise ConfigError(f"config.model.name={name!r} is not a backbone; valid names: {names()}")
  return BACKBONES[name]


def get_backbone(name: str):
  """The Flax module class that builds backbone `name` (its spec's `build` is the class's
  `from_config`), for the class-level facts some methods read (e.g. the Switch
  Transformer's `copy_experts`); `ConfigError` for an unknown name."""
  build = spec(name).build
  return getattr(build, "__self__", build)


def make_backbone(model_config, num_classes: int) -> nn.Module:
  """The backbone module described by `config.model`."""
  return spec(model_config.name).build(model_config, num_classes)


def check_task(name: str, task: str) -> None:
  """Raises `ConfigError` unless backbone `name` models data of kind `task`."""
  if task not in spec(name).tasks:
    raise ConfigError(f"config.model.name={name!r} cannot model {task}; valid names: "
                      f"{names(lambda s: task in s.tasks)}")


def takes(spec_: BackboneSpec, input_shape: Sequence[int]) -> bool:
  """Whether the backbone of `spec_` takes inputs of `input_shape` (one example's)."""
  m = spec_.side_multiple
  return len(input_shape) != 3 or (input_shape[0] % m == 0 and input_shape[1] % m == 0)


def check_input_shape(name: str, input_shape: Sequence[int], data: str) -> None:
  """Raises `ConfigError` unless backbone `name` takes images of `input_shape` (HWC), those
  of `data` (named in the message)."""
  backbone = spec(name)
  if takes(backbone, input_shape):
    return
  h, w = input_shape[:2]
  able = names(lambda s: "images" in s.tasks and takes(s, input_shape))
  raise ConfigError(f"config.model.name={name!r} needs images whose height and width are "
                    f"multiples of {backbone.side_multiple}; {data} has {h}x{w} images; valid "
                    f"names for them: {able}")


def capability(name: str, field: str, method: str):
  """The spec's `field` ("width_layout" or "mixture") that `method` needs; a `ConfigError`
  naming the undeclared capability when backbone `name` has none."""
  value = getattr(spec(name), field)
  if value is None:
    able = names(lambda s: getattr(s, field) is not None)
    raise ConfigError(f"config.model.name={name!r} cannot be used by config.method.name="
                      f"{method!r}: its BackboneSpec declares no {field} ({CAPABILITIES[field]});"
                      f" valid names: {able}")
  return value
