"""A decoder-only Switch Transformer (Fedus et al., 2021) for language modelling.

Pre-LayerNorm blocks: `x + attention(LN(x))` with a causal mask, then
`x + ffn(LN(x))`. The feed-forward layer of every `moe_every`-th block
(blocks moe_every - 1, 2 moe_every - 1, ...; the presets base and large: every
other block, as in Switch Transformers) is a mixture of E experts stacked on
a leading axis (`expert_wi` (E, d, f), `expert_wo` (E, f, d) and their
biases) and a linear router (`router_kernel` (d, E), `router_bias` (E,));
the other blocks' is one dense two-layer ReLU network of the same size. The
token embedding is tied to the output projection; positions have learned
embeddings. Dropout (`dropout`, in training) applies to the embeddings and
to the output of every attention and feed-forward layer.

Routing is top-1: each token goes to the expert of its largest router
probability, and the expert's output is scaled by that probability. Experts
whose router logits are exactly equal (an expert and its copy right after
`copy_experts`) count as one: each one's mass is their summed probability,
and a token routed to them goes to the first. So right after a copy every
token keeps its expert weights and its gate; without ties (the case of any
trained router, and of a copied pair after its first update) it is the plain
Switch rule. The copy preserves the function only while no capacity binds
(see `copy_experts`).
Every expert has room for `capacity = ceil(capacity_factor * T / E)` tokens
of a batch of T tokens, taken in order; a token beyond it is dropped: the
layer outputs zero for it, so it passes through the residual unchanged. The
capacity applies in training (`capacity_factor`, the paper's 1.0) and, at
evaluation, `eval_capacity_factor` (0: no limit).

The tokens are dispatched to a (E, capacity, d) buffer by a scatter and
gathered back, so the arithmetic counted for a step is that of E x capacity
expert slots, not of a dense dispatch tensor.

Expert slots: a model may hold its E experts in C >= E slots (gMoE's
`method.slots`), so that growth inside the slots keeps every array's shape
and compiled program. The active count is the variable
`routing/active_experts` (absent: all E are active); the router's logits of
the padding slots are -inf, so no token goes there and their probabilities
are 0; capacities and the balance loss use the active count; the dispatch
buffer has room for the capacity of `min_experts`, the fewest experts the
slots are to hold (fewer active experts than that keep what the buffer holds).

The load-balancing loss of a layer is `E * sum_e f_e * P_e`, f_e the
fraction of the (unmasked) tokens whose top-1 expert is e and P_e their mean
router probability of e: 1 for uniform routing, E when every token goes to
one expert with probability 1. The model returns the sum over layers.

With `scan_layers` (the default) the blocks are one compiled loop: the
repeated group of `moe_every` blocks (the dense ones, then the one with a
mixture) is a `flax.linen.scan` over `num_layers // moe_every` groups, its
parameters stacked on a leading axis under `params["layers"]["block<j>"]`,
and blocks beyond the last whole group follow unrolled (`block<i>`). XLA then
compiles one group instead of every block. The unrolled form
(`scan_layers=False`, `params["block<i>"]`) is the same function:
`init_variables` initialises both the same way (the scanned form stacks the
unrolled form's initial values), so they differ only in the order of float
operations, and in the dropout masks (each layer's key is drawn differently).
`stack_layers` and `unstack_layers` convert parameters between the forms.
A FLOP count traces the scanned form as the unrolled one (`as_unrolled`):
autodiff places a few scalar operations differently around a loop, and the
count is of the function, not of its compiled form.

The model declares its expert layers to gMoE (`alma_jax.methods.gmoe`), which
grows them instead of adding gated mixtures of its own: `copy_experts` (a
copy of chosen experts of every block, which keeps every token's routing and
gate) and
`expert_losses` (the loss routed to each expert), and `LEAF_AXES` (the
experts' axis, for sharding).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alma_jax.configuration import fields as F
from alma_jax.configuration.plugins import backbones as declared_backbones
from alma_jax.models import inference
from alma_jax.models import registry
from alma_jax.models import slots

# The presets' sizes, declared where configs and reports read them without importing JAX.
PRESETS = declared_backbones.SWITCH_PRESETS
SIZE_FIELDS = declared_backbones.SWITCH_SIZE_FIELDS
INIT_STD = 0.02


def capacity(num_tokens: int, num_experts: int, factor: float) -> int:
  """Slots per expert for a batch of `num_tokens` tokens; factor 0 means no limit."""
  if factor <= 0:
    return num_tokens
  return max(1, min(num_tokens, math.ceil(factor * num_tokens / num_experts)))


@dataclasses.dataclass(frozen=True)
class Routing:
  """Top-1 routing of T tokens among E experts."""

  probs: jax.Array  # (T, E) router probabilities
  expert: jax.Array  # (T,) the chosen expert
  position: jax.Array  # (T,) the token's slot in its expert's buffer
  kept: jax.Array  # (T,) bool: routed (unmasked and within capacity)
  gate: jax.Array  # (T,) the scale of the expert's output


def route(logits: jax.Array, mask: jax.Array, cap: int | jax.Array) -> Routing:
  """Top-1 routing of router `logits` (T, E) for the tokens where `mask` (T,) is true (`cap`
  may be traced: the tokens each expert keeps)."""
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  # An expert's mass: its probability times the number of experts whose logit equals its own
  # (1 unless a copy ties with it). Routing takes the largest mass, the first one on ties.
  count = jnp.sum(logits[:, :, None] == logits[:, None, :], axis=-1).astype(probs.dtype)
  mass = count * probs
  expert = jnp.argmax(mass, axis=-1)
  gate = jnp.take_along_axis(mass, expert[:, None], axis=-1)[:, 0]
  one_hot = jax.nn.one_hot(expert, logits.shape[-1], dtype=jnp.int32) * mask[:, None]
  position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)
  kept = mask & (position < cap)
  return Routing(probs, expert, position, kept, gate)


def balance_loss(r: Routing, mask: jax.Array, active: jax.Array | None = None) -> jax.Array:
  """E * sum_e f_e P_e over the tokens where `mask` is true (see the module docstring); E is
  `active`, the active experts, when they sit in slots (padding slots have f = P = 0)."""
  num_slots = r.probs.shape[-1]
  m = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(m), 1.0)
  f = jnp.sum(jax.nn.one_hot(r.expert, num_slots) * m[:, None], axis=0) / count
  p = jnp.sum(r.probs * m[:, None], axis=0) / count
  num_experts = num_slots if active is None else active.astype(jnp.float32)
  return num_experts * jnp.sum(f * p)


def dispatch(x: jax.Array, r: Routing, num_experts: int, cap: int) -> jax.Array:
  """Tokens x (T, d) into expert buffers (E, cap, d); dropped tokens go nowhere."""
  slot = jnp.where(r.kept, r.position, cap)  # out of bounds: dropped by the scatter
  buf = jnp.zeros((num_experts, cap, x.shape[-1]), x.dtype)
  return buf.at[r.expert, slot].set(x, mode="drop")


def combine(out: jax.Array, r: Routing) -> jax.Array:
  """Expert outputs (E, cap, d) back to the tokens (T, d), scaled by the gate; zero when dropped."""
  slot = jnp.clip(r.position, 0, out.shape[1] - 1)
  y = out[r.expert, slot]
  return y * (r.gate * r.kept).astype(y.dtype)[:, None]


class SwitchFFN(nn.Module):
  """A top-1 mixture of E two-layer ReLU experts with a capacity; returns (y, balance, experts).

  `active` (traced, or None: all): the active experts when the E are slots; `min_experts` (0:
  E) the fewest active experts the dispatch buffer must have room for."""

  num_experts: int
  ffn_dim: int
  capacity_factor: float = 1.0
  eval_capacity_factor: float = 2.0
  min_experts: int = 0

  @nn.compact
  def __call__(self, x, mask, train: bool = False, active=None):
    b, l, d = x.shape
    e, f = self.num_experts, self.ffn_dim
    init = nn.initializers.normal(INIT_STD)
    router_kernel = self.param("router_kernel", init, (d, e))
    router_bias = self.param("router_bias", nn.initializers.zeros, (e,))
    wi = self.param("expert_wi", init, (e, d, f))
    bi = self.param("expert_bi", nn.initializers.zeros, (e, f))
    wo = self.param("expert_wo", init, (e, f, d))
    bo = self.param("expert_bo", nn.initializers.zeros, (e, d))
    tokens, tmask = x.reshape(b * l, d), mask.reshape(b * l)
    factor = self.capacity_factor if train else self.eval_capacity_factor
    cap = capacity(b * l, self.min_experts or e, factor)  # the buffer's room per expert
    logits = tokens.astype(jnp.float32) @ router_kernel + router_bias
    kept = cap
    if active is not None:  # experts in slots: the padding ones take no token
      logits = jnp.where(jnp.arange(e) < active, logits, -jnp.inf)
      kept = jnp.asarray([min(cap, capacity(b * l, max(n, 1), factor)) for n in range(e + 1)],
                         jnp.int32)[active]  # within the buffer, for fewer than min_experts
    r = route(logits, tmask, kept)
    buf = dispatch(tokens, r, e, cap)
    h = nn.relu(jnp.einsum("ecd,edf->ecf", buf, wi) + bi[:, None, :])
    out = jnp.einsum("ecf,efd->ecd", h, wo) + bo[:, None, :]
    y = combine(out, r).reshape(b, l, d)
    return y, balance_loss(r, tmask, active), r.expert.reshape(b, l)


class Block(nn.Module):
  """Pre-LN decoder block: causal self-attention, then the Switch feed-forward layer (`moe`)
  or a dense one; returns (x, balance loss, experts (b, L), or None for a dense block)."""

  num_heads: int
  num_experts: int
  ffn_dim: int
  capacity_factor: float
  eval_capacity_factor: float
  moe: bool = True
  dropout: float = 0.0
  min_experts: int = 0

  @nn.compact
  def __call__(self, x, mask, train: bool = False, active=None):
    causal = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    init = nn.initializers.normal(INIT_STD)
    drop = nn.Dropout(self.dropout, deterministic=not train)
    h = nn.LayerNorm(name="ln_attn")(x)
    x = x + drop(nn.MultiHeadDotProductAttention(self.num_heads, kernel_init=init, name="attn")(
        h, mask=causal, deterministic=True))
    h = nn.LayerNorm(name="ln_ffn")(x)
    if not self.moe:
      y = nn.Dense(self.ffn_dim, kernel_init=init, name="ffn_wi")(h)
      y = nn.Dense(x.shape[-1], kernel_init=init, name="ffn_wo")(nn.relu(y))
      return x + drop(y), jnp.float32(0.0), None
    y, balance, experts = SwitchFFN(self.num_experts, self.ffn_dim, self.capacity_factor,
                                    self.eval_capacity_factor, self.min_experts,
                                    name="moe")(h, mask, train, active)
    return x + drop(y), balance, experts


class Group(nn.Module):
  """`size` consecutive blocks, dense ones then one with a mixture: what the scanned model
  repeats. Scanned: (x, mask, active experts) -> (x, (balance loss, experts (b, L)))."""

  size: int
  num_heads: int
  num_experts: int
  ffn_dim: int
  capacity_factor: float
  eval_capacity_factor: float
  dropout: float = 0.0
  min_experts: int = 0
  train: bool = False

  @nn.compact
  def __call__(self, x, mask, active):
    carry = x.dtype
    for j in range(self.size):
      x, balance, experts = Block(self.num_heads, self.num_experts, self.ffn_dim,
                                  self.capacity_factor, self.eval_capacity_factor,
                                  moe=j == self.size - 1, dropout=self.dropout,
                                  min_experts=self.min_experts,
                                  name=f"block{j}")(x, mask, self.train, active)
    return x.astype(carry), (balance, experts)  # the loop's carry keeps its type


# -- the two layouts ------------------------------------------------------------------------------
LAYERS = "layers"  # the scanned groups' stacked parameters
ROUTING, ACTIVE = "routing", "active_experts"  # the active experts of a model in slots
_AS_UNROLLED = contextvars.ContextVar("alma_jax_switch_as_unrolled", default=False)


def as_unrolled() -> contextlib.AbstractContextManager[None]:
  """A block whose traces compute a scanned model's groups one after another, block by block,
  from its stacked parameters: the unrolled form's operations, what a FLOP count traces."""
  return inference.raised(_AS_UNROLLED)


def _groups_of(stacked, groups: int) -> list:
  """The `groups` slices of stacked parameters along their leading axis, split (whose
  derivative concatenates) rather than indexed (whose derivatives would be added up)."""
  leaves, treedef = jax.tree.flatten(stacked)
  parts = [jnp.split(a, groups) for a in leaves]
  return [treedef.unflatten([jnp.squeeze(p[k], 0) for p in parts]) for k in range(groups)]


def _block_index(name: str) -> int | None:
  return int(name[5:]) if name.startswith("block") and name[5:].isdigit() else None


def stack_layers(params: dict[str, Any], moe_every: int) -> dict[str, Any]:
  """The scanned layout of unrolled `params` (blocks `block<i>`): the blocks of the
  `num_layers // moe_every` whole groups stacked under `params["layers"]["block<j>"]`
  (j < moe_every), the blocks after them unchanged."""
  num_layers = 1 + max(i for i in map(_block_index, params) if i is not None)
  groups = num_layers // moe_every
  stacked = {f"block{j}": slots.stack([params[f"block{k * moe_every + j}"]
                                       for k in range(groups)])
             for j in range(moe_every)}
  rest = {k: v for k, v in params.items()
          if _block_index(k) is None or _block_index(k) >= groups * moe_every}
  return {**rest, LAYERS: stacked}


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
  """The unrolled layout of scanned `params` (the inverse of `stack_layers`)."""
  stacked = params[LAYERS]
  size = len(stacked)
  groups = jax.tree.leaves(stacked)[0].shape[0]
  out = {k: v for k, v in params.items() if k != LAYERS}
  for j in range(size):
    for k in range(groups):
      out[f"block{k * size + j}"] = slots.index(stacked[f"block{j}"], k)
  return out


def init_variables(model: "SwitchTransformer", key: jax.Array, *args, **kwargs) -> dict:
  """`model.init`, with the scanned form's parameters stacked from the unrolled form's initial
  values, so both forms start from the same weights."""
  if not model.scan_layers:
    return model.init(key, *args, **kwargs)
  variables = model.clone(scan_layers=False).init(key, *args, **kwargs)
  return {**variables, "params": stack_layers(variables["params"], model.moe_every)}


# -- growth of the experts ------------------------------------------------------------------------
def blocks(params) -> list[str]:
  """The names of the blocks with experts (a mixture) in unrolled params, in order."""
  return sorted((k for k in params if _block_index(k) is not None and "moe" in params[k]),
                key=_block_index)


def _stored_mixtures(params) -> dict[str, jax.Array] | list[dict[str, jax.Array]]:
  """The mixture parameters as `params` holds them: stacked on a leading group axis (the
  scanned layout), or a list of the blocks' (unrolled)."""
  if LAYERS in params:
    return params[LAYERS][f"block{len(params[LAYERS]) - 1}"]["moe"]
  return [params[name]["moe"] for name in blocks(params)]


def _with_stored_mixtures(params: dict[str, Any], mixtures) -> dict[str, Any]:
  """`params` with its mixtures replaced by `mixtures`, held as `_stored_mixtures` gives them."""
  params = dict(params)
  if LAYERS in params:
    last = f"block{len(params[LAYERS]) - 1}"
    params[LAYERS] = {**params[LAYERS], last: {**params[LAYERS][last], "moe": mixtures}}
    return params
  for name, moe in zip(blocks(params), mixtures):
    params[name] = {**params[name], "moe": moe}
  return params


def _mixture_shape(params) -> tuple[int, int]:
  """(mixture blocks, experts per block) of a model's params (either layout)."""
  mixtures = _stored_mixtures(params)
  if isinstance(mixtures, list):
    return len(mixtures), int(mixtures[0]["router_bias"].shape[0])
  return tuple(int(n) for n in mixtures["router_bias"].shape)


def experts_per_block(params) -> int:
  """The experts per block of a model's params (either layout)."""
  return _mixture_shape(params)[1]


def _resized(x: jax.Array, n: int, axis: int) -> jax.Array:
  """`x` with `n` entries on `axis`: cut, or padded with zeros."""
  if n <= x.shape[axis]:
    return jax.lax.slice_in_dim(x, 0, n, axis=axis)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, pad)


def _resize_mixture(moe: dict[str, jax.Array], n: int, lead: int) -> dict[str, jax.Array]:
  """A mixture's parameters with `n` expert slots (`lead`: the axes before the experts')."""
  return {k: _resized(v, n, lead if k.startswith("expert_") else v.ndim - 1)
          for k, v in moe.items()}


def resize_experts(params: dict[str, Any], n: int) -> dict[str, Any]:
  """The params (either layout) with `n` expert slots per block: padding slots (zero weights
  and router columns) added, or the slots beyond the first `n` cut off."""
  mixtures = _stored_mixtures(params)
  if isinstance(mixtures, list):
    return _with_stored_mixtures(params, [_resize_mixture(m, n, 0) for m in mixtures])
  return _with_stored_mixtures(params, _resize_mixture(mixtures, n, 1))


def _copy_one(moe: dict[str, jax.Array], idx: jax.Array, start: jax.Array, key: jax.Array,
              noise: float, num_slots: int) -> dict[str, jax.Array]:
  """One block's mixture in `num_slots` slots with the experts `idx` copied to the slots from
  `start` on (see `copy_experts`)."""
  moe = _resize_mixture(moe, num_slots, 0)
  dest = start + jnp.arange(idx.shape[0])
  for leaf in [k for k in moe if k.startswith("expert_")]:
    moe[leaf] = moe[leaf].at[dest].set(moe[leaf][idx])
  kernel = moe["router_kernel"]
  cols = kernel[:, idx]
  if noise:
    cols = cols + noise * jax.random.normal(key, cols.shape, cols.dtype)
  moe["router_kernel"] = kernel.at[:, dest].set(cols)
  bias = moe["router_bias"].at[idx].add(-math.log(2.0))
  moe["router_bias"] = bias.at[dest].set(bias[idx])
  return moe


def copy_experts(params: dict[str, Any], experts: Sequence[int] | Sequence[Sequence[int]],
                 key: jax.Array, noise: float = 0.0, active: int | None = None,
                 num_slots: int | None = None) -> dict[str, Any]:
  """Adds a copy of `experts` (their weights and router columns) to every block.

  Args:
    params: a model's params, in either layout (not modified).
    experts: the experts to copy: one list for every block, or a list per
      block (the same length for all); distinct active indices.
    key: PRNG key of the perturbation.
    noise: standard deviation of a Gaussian perturbation of the copies'
      router columns (0: none).
    active: the active experts of a model in slots (None: every slot).
    num_slots: the slots after the copy (None: exactly the experts).

  Returns:
    The params of a model with `active + k` experts per block, in the
    layout of `params` (the same values in either), in `num_slots` slots: the
    copies go to the slots after the active experts. The router bias of every copied
    expert and of its copy is lowered by log 2, so the router probabilities
    of all other experts are unchanged and the pair's sum is the original's;
    with `noise` 0 the pair's logits tie, so the router treats them as one
    expert (`route`): every token keeps its expert weights and its gate.

    What that preserves: the layer's function exactly when no token is
    dropped before or after the copy (e.g. `eval_capacity_factor=0` at
    evaluation). It does not preserve the function under a binding capacity:
    every expert's capacity ceil(factor * T / E) shrinks as E grows (the
    default factors, 1 in training and 2 at evaluation, included), and the
    tied pair sends all its tokens to its first member, so tokens beyond the
    smaller capacity are dropped (the layer adds zero for them). Nor does it
    survive training: the first update that moves the pair's logits apart
    (Adam's first step, however small, for every token where the change
    exceeds the float32 rounding of its logits) ends the tie, and each
    member's gate becomes its own probability, half the pair's, so the
    output of the pair's tokens halves.
  """
  num_blocks, num = _mixture_shape(params)
  active = num if active is None else int(active)
  per_block = [list(experts)] * num_blocks if all(
      isinstance(e, (int, np.integer)) for e in experts) else [list(e) for e in experts]
  if len(per_block) != num_blocks or len({len(e) for e in per_block}) != 1:
    raise ValueError(f"copy_experts: expected one list of experts, or one per block "
                     f"({num_blocks}) of the same length; got {experts!r}")
  for e in per_block:
    if len(set(e)) != len(e) or not all(0 <= int(i) < active for i in e):
      raise ValueError(f"copy_experts: experts {e} must be distinct indices in [0, {active})")
  grown = active + len(per_block[0])
  num_slots = grown if num_slots is None else int(num_slots)
  if not active <= num or num_slots < max(grown, num):
    raise ValueError(f"copy_experts: {active} active experts in {num} slots, copying "
                     f"{len(per_block[0])}, do not fit {num_slots} slots")
  grown = _copied(_stored_mixtures(params), np.asarray(per_block, np.int32), np.int32(active),
                  key, float(noise), num_slots)
  return _with_stored_mixtures(params, grown)


@functools.partial(jax.jit, static_argnames=("noise", "num_slots"))
def _copied(mixtures, per_block: jax.Array, start: jax.Array, key: jax.Array, noise: float,
            num_slots: int):
  """`copy_experts` of the mixture parameters alone, on checked indices: stacked on a leading
  block axis (the scanned layout) or a list of the blocks' (unrolled); one compiled program
  per layout, size, count and slots (the active experts `start` are an argument)."""
  stacked = slots.stack(mixtures) if isinstance(mixtures, list) else mixtures
  keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(per_block.shape[0]))
  grown = jax.vmap(lambda m, i, k: _copy_one(m, i, start, k, noise, num_slots))(
      stacked, per_block, keys)
  if isinstance(mixtures, list):
    return [slots.index(grown, b) for b in range(len(mixtures))]
  return grown


def expert_losses(experts: jax.Array, nll: jax.Array, mask: jax.Array,
                  num_experts: int) -> jax.Array:
  """(blocks, E): the summed token NLL routed to each expert of each block.

  `experts` (blocks, b, L) the routed expert of every token (`aux["experts"]`),
  `nll` (b, L), `mask` (b,) the real sequences.
  """
  w = nll * mask[:, None].astype(nll.dtype)
  return jnp.einsum("nble,bl->ne", jax.nn.one_hot(experts, num_experts, dtype=nll.dtype), w)


class SwitchTransformer(nn.Module):
  """Decoder-only Switch Transformer: tokens (b, L) -> (logits (b, L, V), aux).

  `aux` holds `balance` (the load-balancing loss summed over layers) and
  `experts` (mixture layers, b, L), the expert each token was routed to in
  each block with a mixture. `mask` (b,)
  marks the real sequences of a padded batch (they alone take capacity and
  count in the balance loss).
  """

  # The expert layers, for gMoE and the shardings (see the module docstring).
  LEAF_AXES = ((r"\['layers'\].*\['expert_", (None, "expert")),  # groups, then experts
               (r"\['expert_", ("expert",)))  # the stacked experts of every block
  copy_experts = staticmethod(copy_experts)
  expert_losses = staticmethod(expert_losses)
  init_variables = staticmethod(init_variables)
  resize_experts = staticmethod(resize_experts)
  ROUTING, ACTIVE = ROUTING, ACTIVE

  vocab_size: int
  max_len: int
  num_layers: int = 2
  dim: int = 64
  num_heads: int = 2
  ffn_dim: int = 128
  num_experts: int = 4
  capacity_factor: float = 1.0
  eval_capacity_factor: float = 2.0
  moe_every: int = 1
  dropout: float = 0.0
  scan_layers: bool = True
  min_experts: int = 0  # experts in slots: the fewest active ones (0: num_experts)

  @classmethod
  def from_config(cls, model_config, num_classes: int, max_len: int = 1024,
                  num_experts: int | None = None, min_experts: int = 0) -> "SwitchTransformer":
    """The model of `config.model` (a preset, then its non-zero size fields); `num_experts`
    and `min_experts`: slots (see the module docstring)."""
    preset = F.get(model_config, "model.preset")
    if preset not in PRESETS:
      raise ValueError(f"config.model.preset={preset!r} is unknown; valid values: "
                       f"{sorted(PRESETS)}")
    sizes = {k: declared_backbones.switch_size(preset, k, model_config.get(k, 0) or 0)
             for k in SIZE_FIELDS}
    if sizes["moe_every"] > sizes["num_layers"]:
      raise ValueError(f"config.model.moe_every={sizes['moe_every']} leaves no block with "
                       f"experts among config.model.num_layers={sizes['num_layers']}; allowed "
                       f"values: 0 (the preset's) to {sizes['num_layers']}")
    if sizes["dim"] % sizes["num_heads"]:
      raise ValueError(f"config.model.dim={sizes['dim']} must be a multiple of "
                       f"config.model.num_heads={sizes['num_heads']}")
    return cls(vocab_size=int(num_classes), max_len=int(max_len),
               num_experts=int(num_experts or F.get(model_config, "model.num_experts")),
               capacity_factor=float(F.get(model_config, "model.capacity_factor")),
               eval_capacity_factor=float(F.get(model_config, "model.eval_capacity_factor")),
               dropout=float(F.get(model_config, "model.dropout")),
               scan_layers=bool(F.get(model_config, "model.scan_layers")),
               min_experts=int(min_experts), **sizes)

  @nn.compact
  def __call__(self, tokens, train: bool = False, mask=None):
    b, l = tokens.shape
    mask = jnp.ones((b,), bool) if mask is None else mask.astype(bool)
    tmask = jnp.broadcast_to(mask[:, None], (b, l))
    embed = nn.Embed(self.vocab_size, self.dim, embedding_init=nn.initializers.normal(INIT_STD),
                     name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(INIT_STD), (self.max_len, self.dim))
    x = nn.Dropout(self.dropout, deterministic=not train)(embed(tokens) + pos[:l])
    balance, experts, first = jnp.float32(0.0), [], 0
    active = (self.get_variable(ROUTING, ACTIVE) if self.has_variable(ROUTING, ACTIVE)
              else None)
    kw = dict(num_heads=self.num_heads, num_experts=self.num_experts, ffn_dim=self.ffn_dim,
              capacity_factor=self.capacity_factor,
              eval_capacity_factor=self.eval_capacity_factor, dropout=self.dropout,
              min_experts=self.min_experts)
    groups = self.num_layers // self.moe_every
    stacked = self.variables.get("params", {}).get(LAYERS)
    if self.scan_layers and groups and _AS_UNROLLED.get() and stacked is not None:
      # The unrolled form's blocks, in its order, on the scanned parameters (`as_unrolled`).
      for group in _groups_of(stacked, groups):
        for j in range(self.moe_every):
          block = Block(**kw, moe=j == self.moe_every - 1, parent=None)
          rngs = {"dropout": self.make_rng("dropout")} if train and self.dropout else {}
          x, bl, ex = block.apply({"params": group[f"block{j}"]}, x, tmask, train, active,
                                  rngs=rngs)
          balance, experts = balance + bl, experts + ([] if ex is None else [ex])
      first = groups * self.moe_every
    elif self.scan_layers and groups:
      scanned = nn.scan(Group, variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True},
                        in_axes=(nn.broadcast, nn.broadcast), length=groups)
      x, (bl, ex) = scanned(size=self.moe_every, train=train, name=LAYERS, **kw)(x, tmask,
                                                                                 active)
      balance, experts, first = jnp.sum(bl), list(ex), groups * self.moe_every
    for i in range(first, self.num_layers):
      x, bl, ex = Block(**kw, moe=(i + 1) % self.moe_every == 0, name=f"block{i}")(
          x, tmask, train, active)
      balance, experts = balance + bl, experts + ([] if ex is None else [ex])
    x = nn.LayerNorm(name="ln_final")(x)
    logits = embed.attend(x)
    return logits, {"balance": balance, "experts": jnp.stack(experts)}


SPEC = registry.BackboneSpec("switch", SwitchTransformer.from_config, tasks=("text",))
