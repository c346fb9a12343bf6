"""Detection and segmentation canvases built from scikit-learn's handwritten digits.

`sklearn.datasets.load_digits` ships 1,797 real 8x8 scans (ink 0..16, 10
classes) with the library: nothing to download. A canvas is a larger black
image on which several digits, each upscaled `scale` times (nearest
neighbour), are placed at random positions whose cells never overlap. It
carries:

- `images` [N, S, S, 1] uint8 (ink 0..16 scaled to 0..255);
- `boxes` [N, M, 4] float32, each digit's tight box around its ink, in pixels,
  `(ymin, xmin, ymax, xmax)` with the max edge exclusive (TensorFlow's order);
- `classes` [N, M] int32, the digit (0..9), -1 where a canvas has fewer than M
  digits (its boxes there are zeros);
- `masks` [N, S, S] int32, each pixel's class: 0 background, 1 + digit where
  the digit's ink is at least `INK_THRESHOLD`;
- `source_ids` [N, M] int32, which source digit (index into `load_digits()`)
  each placed digit is, -1 for padding (so a test can check the split).

Canvases come as a `tfpar.data.images.ImageSet`, like the images users bring.

The digits are split once, by a seeded permutation, into a training and a
held-out part; held-out canvases are built only from held-out digits, so no
scan seen in training is ever scored. Everything is a pure function of the
seed.
"""

import dataclasses
import functools
from typing import Tuple

import numpy as np

from tfpar.data.images import ImageSet

INK_THRESHOLD = 4  # Of 16: fainter pixels are scanner blur, not stroke (~1/4 of full ink).
DIGIT_SIZE = 8
NUM_DIGIT_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class DigitSplit:
  """The scans of one split: images [n, 8, 8] in 0..16, labels [n], ids into load_digits()."""
  images: np.ndarray
  labels: np.ndarray
  ids: np.ndarray


def split_digits(seed: int = 0, eval_fraction: float = 0.2) -> Tuple[DigitSplit, DigitSplit]:
  """Splits load_digits() into (train, held_out) by a permutation drawn from `seed`."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  images = digits.images.astype(np.uint8)  # [1797, 8, 8], 0..16
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  n_eval = int(round(len(labels) * eval_fraction))
  eval_ids, train_ids = np.sort(order[:n_eval]), np.sort(order[n_eval:])
  return (DigitSplit(images[train_ids], labels[train_ids], train_ids),
          DigitSplit(images[eval_ids], labels[eval_ids], eval_ids))


def _place(rng: np.random.Generator, count: int, cell: int, size: int, tries: int = 200):
  """Top-left corners of up to `count` cells of side `cell` that do not overlap."""
  corners = []
  for _ in range(tries):
    if len(corners) == count:
      break
    y, x = rng.integers(0, size - cell + 1, size=2)
    if all(abs(y - cy) >= cell or abs(x - cx) >= cell for cy, cx in corners):
      corners.append((int(y), int(x)))
  return corners


def make_canvases(digits: DigitSplit, num_canvases: int, *, canvas_size: int = 48,
                  scale: int = 2, min_digits: int = 1, max_digits: int = 4,
                  seed: int = 0) -> ImageSet:
  """Builds `num_canvases` canvases from the scans of `digits` only.

  Args:
    digits: the split to draw digits from (with replacement).
    num_canvases: N.
    canvas_size: S, the side of the square canvas in pixels.
    scale: each 8x8 scan becomes (8 * scale) pixels square.
    min_digits, max_digits: digits per canvas, drawn uniformly (fewer if they
      do not fit without overlap).
    seed: the canvases are a pure function of it (and of `digits`).
  """
  cell = DIGIT_SIZE * scale
  if cell > canvas_size:
    raise ValueError(f"a digit of {cell} pixels does not fit a {canvas_size}-pixel canvas")
  if not 1 <= min_digits <= max_digits:
    raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
  rng = np.random.default_rng(seed)
  m = max_digits
  images = np.zeros((num_canvases, canvas_size, canvas_size, 1), np.uint8)
  boxes = np.zeros((num_canvases, m, 4), np.float32)
  classes = np.full((num_canvases, m), -1, np.int32)
  masks = np.zeros((num_canvases, canvas_size, canvas_size), np.int32)
  source_ids = np.full((num_canvases, m), -1, np.int32)
  for n in range(num_canvases):
    corners = _place(rng, int(rng.integers(min_digits, max_digits + 1)), cell, canvas_size)
    for j, (y, x) in enumerate(corners):
      k = int(rng.integers(len(digits.labels)))
      scan = np.kron(digits.images[k], np.ones((scale, scale), np.uint8))  # [cell, cell]
      ink = scan >= INK_THRESHOLD
      images[n, y:y + cell, x:x + cell, 0] = np.round(scan * (255 / 16))
      masks[n, y:y + cell, x:x + cell][ink] = digits.labels[k] + 1
      rows, cols = np.nonzero(ink)
      boxes[n, j] = (y + rows.min(), x + cols.min(), y + rows.max() + 1, x + cols.max() + 1)
      classes[n, j] = digits.labels[k]
      source_ids[n, j] = digits.ids[k]
  return ImageSet(images, boxes=boxes, classes=classes, masks=masks, source_ids=source_ids)


@functools.lru_cache(maxsize=2)
def digit_canvases(num_train: int, num_eval: int, *, seed: int = 0, eval_fraction: float = 0.2,
                   **kwargs) -> Tuple[ImageSet, ImageSet]:
  """(train, held_out) canvases; held-out ones only from held-out digits, other seeds.

  Built once per process for the same arguments (building 6,000 canvases takes
  seconds; a process that trains several times, such as the tests, reuses
  them), so their arrays are read-only.
  """
  train_digits, eval_digits = split_digits(seed, eval_fraction)
  train = make_canvases(train_digits, num_train, seed=seed * 2 + 1, **kwargs)
  held_out = make_canvases(eval_digits, num_eval, seed=seed * 2 + 2, **kwargs)
  for canvases in (train, held_out):
    for field in dataclasses.fields(canvases):
      value = getattr(canvases, field.name)
      if isinstance(value, np.ndarray):
        value.setflags(write=False)
  return train, held_out
