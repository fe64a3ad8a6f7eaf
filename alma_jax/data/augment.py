"""Input pipeline pieces that run inside the jitted step.

Images stay uint8 on the device; a batch is gathered by index, optionally
augmented (random crop with zero padding and horizontal flip, as PyTorch's
`RandomCrop(32, padding=4)` + `RandomHorizontalFlip`), then normalised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AUGMENTATIONS = ("none", "crop_flip")


def random_crop_flip(rng: jax.Array, x: jnp.ndarray, pad: int = 4) -> jnp.ndarray:
  """Per-example random crop (zero padding of `pad` pixels) and horizontal flip."""
  n, h, w, _ = x.shape
  k_crop, k_flip = jax.random.split(rng)
  offsets = jax.random.randint(k_crop, (n, 2), 0, 2 * pad + 1)
  flips = jax.random.bernoulli(k_flip, 0.5, (n,))
  padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

  def one(img, off, flip):
    img = jax.lax.dynamic_slice(img, (off[0], off[1], 0), (h, w, img.shape[-1]))
    return jnp.where(flip, img[:, ::-1, :], img)

  return jax.vmap(one)(padded, offsets, flips)


def prepare_batch(x_uint8, mean, std, *, augment: str, rng: jax.Array | None):
  """uint8 images (..., H, W, C) -> normalised float32, augmented in training."""
  if augment not in AUGMENTATIONS:
    raise ValueError(f"config.train.augment={augment!r}; valid values: {list(AUGMENTATIONS)}")
  x = x_uint8.astype(jnp.float32) / 255.0
  if augment == "crop_flip" and rng is not None:
    lead = x.shape[:-3]
    flat = x.reshape((-1,) + x.shape[-3:])
    flat = random_crop_flip(rng, flat)
    x = flat.reshape(lead + flat.shape[1:])
  return (x - mean) / std
