"""Standard image augmentation in tf.data, with labels transformed the same way.

Both transforms take one example (a dict: `image` [S, S, C] float; optionally
`boxes` [M, 4] pixels (ymin, xmin, ymax, xmax) with `classes` [M], and/or
`mask` [S, S] int) and a stateless seed [2], so an example's augmentation is a
pure function of (seed, position) and a resumed run sees the same images.

- `random_crop`: a square window of side `scale * S`, `scale ~ U[min_scale, 1]`,
  at a random offset, resized back to S x S (bilinear for the image, nearest
  for the mask). Boxes move and scale with it and are clipped to the image; a
  box with less than `min_visible` of its area left in the window is dropped
  (class -1), as its object is mostly cut away.
- `random_flip`: left-right with probability 1/2; boxes mirror, masks flip.
  Only where the labels allow it: a mirrored digit is not the same digit, so
  the digit tasks crop but do not flip.
"""

from typing import Dict

import tensorflow as tf


def random_crop(example: Dict[str, tf.Tensor], seed, *, min_scale: float = 0.8,
                min_visible: float = 0.5) -> Dict[str, tf.Tensor]:
  """A random square crop resized back to the image's size (see the module docstring)."""
  image = example["image"]
  size = image.shape[0]
  seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 2)
  scale = tf.random.stateless_uniform([], seeds[0], min_scale, 1.0)
  side = tf.maximum(1, tf.cast(tf.round(scale * size), tf.int32))
  offset = tf.random.stateless_uniform([2], seeds[1], 0, size - side + 1, dtype=tf.int32)
  oy, ox = offset[0], offset[1]
  out = dict(example)
  window = image[oy:oy + side, ox:ox + side]
  out["image"] = tf.cast(tf.image.resize(window, [size, size]), image.dtype)
  if "mask" in example:
    mask = example["mask"][oy:oy + side, ox:ox + side, None]
    out["mask"] = tf.image.resize(mask, [size, size], method="nearest")[..., 0]
  if "boxes" in example:
    zoom = size / tf.cast(side, tf.float32)
    shift = tf.cast(tf.stack([oy, ox, oy, ox]), tf.float32)
    moved = (tf.cast(example["boxes"], tf.float32) - shift) * zoom
    clipped = tf.clip_by_value(moved, 0.0, float(size))
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    visible = area(clipped) >= min_visible * area(moved)
    keep = visible & (example["classes"] >= 0) & (area(clipped) > 0)
    out["boxes"] = tf.where(keep[:, None], clipped, 0.0)
    out["classes"] = tf.where(keep, example["classes"], -1)
  return out


def random_flip(example: Dict[str, tf.Tensor], seed) -> Dict[str, tf.Tensor]:
  """Left-right flip with probability 1/2 (see the module docstring)."""
  flip = tf.random.stateless_uniform([], tf.cast(seed, tf.int64)) < 0.5
  size = float(example["image"].shape[1])
  out = dict(example)
  out["image"] = tf.cond(flip, lambda: example["image"][:, ::-1], lambda: example["image"])
  if "mask" in example:
    out["mask"] = tf.cond(flip, lambda: example["mask"][:, ::-1], lambda: example["mask"])
  if "boxes" in example:
    b = tf.cast(example["boxes"], tf.float32)
    mirrored = tf.stack([b[:, 0], size - b[:, 3], b[:, 2], size - b[:, 1]], -1)
    mirrored = tf.where((example["classes"] >= 0)[:, None], mirrored, 0.0)
    out["boxes"] = tf.cond(flip, lambda: mirrored, lambda: b)
  return out


def augment(example: Dict[str, tf.Tensor], seed, *, crop: bool, flip: bool,
            min_scale: float = 0.8) -> Dict[str, tf.Tensor]:
  """Crop then flip, each when asked, from one seed [2]."""
  seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 2)
  if crop:
    example = random_crop(example, seeds[0], min_scale=min_scale)
  if flip:
    example = random_flip(example, seeds[1])
  return example
