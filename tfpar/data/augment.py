"""Standard image augmentation in tf.data, with labels transformed the same way.

Both transforms take one example (a dict: `image` [S, S, C] float; optionally
`boxes` [M, 4] pixels (ymin, xmin, ymax, xmax) with `classes` [M], and/or
`mask` [S, S] int) and a stateless seed [2], so an example's augmentation is a
pure function of (seed, position) and a resumed run sees the same images.

- `random_crop`: pad the image by `max_shift` pixels on every side (zeros:
  black, background) and crop a window of the original size at a random
  offset: the image moves by up to `max_shift` pixels each way. Boxes move with
  it and are clipped to the image; a box with less than `min_visible` of its
  area left is dropped (class -1): its object is mostly cut away. Masks move
  the same way, the uncovered border labelled background (0).
- `random_flip`: left-right with probability 1/2; boxes mirror, masks flip.
  Only where the labels allow it: a mirrored digit is not the same digit, so
  the digit tasks crop but do not flip.
"""

from typing import Dict

import tensorflow as tf


def random_crop(example: Dict[str, tf.Tensor], seed, *, max_shift: int,
                min_visible: float = 0.5) -> Dict[str, tf.Tensor]:
  """Pad by max_shift, crop back at a random offset (see the module docstring)."""
  image = example["image"]
  size, k = image.shape[0], max_shift
  offset = tf.random.stateless_uniform([2], tf.cast(seed, tf.int64), 0, 2 * k + 1, dtype=tf.int32)
  oy, ox = offset[0], offset[1]  # The window's corner in the padded image.
  pad = [[k, k], [k, k]]
  out = dict(example)
  out["image"] = tf.ensure_shape(tf.pad(image, pad + [[0, 0]])[oy:oy + size, ox:ox + size],
                                 image.shape)
  if "mask" in example:
    out["mask"] = tf.ensure_shape(tf.pad(example["mask"], pad)[oy:oy + size, ox:ox + size],
                                  example["mask"].shape)
  if "boxes" in example:
    # A pixel at y moves to y + k - oy.
    shift = tf.cast(tf.stack([k - oy, k - ox, k - oy, k - ox]), tf.float32)
    moved = tf.cast(example["boxes"], tf.float32) + shift
    clipped = tf.clip_by_value(moved, 0.0, float(size))
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    keep = ((area(clipped) >= min_visible * area(moved)) & (area(clipped) > 0)
            & (example["classes"] >= 0))
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


def augment(example: Dict[str, tf.Tensor], seed, *, max_shift: int,
            flip: bool) -> Dict[str, tf.Tensor]:
  """Random crop (when max_shift > 0) then flip (when asked), from one seed [2]."""
  seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 2)
  if max_shift > 0:
    example = random_crop(example, seeds[0], max_shift=max_shift)
  if flip:
    example = random_flip(example, seeds[1])
  return example
