"""scikit-learn's handwritten digits, split once: --task=classify's built-in data.

`sklearn.datasets.load_digits` ships 1,797 real 8x8 greyscale scans (ink
0..16, classes 0-9) with the library: nothing to download. They are split
ONCE into 1,438 training and 359 held-out scans by a permutation with a fixed
seed, whatever --seed says, so that every run is scored on the same held-out
scans. No TensorFlow here (scripts/digits_baseline.py uses the same split).
"""

import dataclasses

import numpy as np

SPLIT_SEED = 0
EVAL_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class Images:
  """Labelled images in memory: images float32 [N, S, S, C] in [0, 1], labels int32 [N]."""
  images: np.ndarray
  labels: np.ndarray

  def __len__(self):
    return len(self.labels)


def load_digits_split(seed: int = SPLIT_SEED, eval_fraction: float = EVAL_FRACTION):
  """(train, held_out) Images of the digits, [N, 8, 8, 1] in [0, 1]."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # Ink 0..16 -> [0, 1].
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  n_eval = int(round(len(labels) * eval_fraction))
  held_out, train = np.sort(order[:n_eval]), np.sort(order[n_eval:])
  return Images(images[train], labels[train]), Images(images[held_out], labels[held_out])
