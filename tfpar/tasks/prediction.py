"""What tfpar.predict hands a task for each image, and the drawing both share.

tfpar.predict reads the images, runs the model on a batch and asks the task
(`Task.predict`) what each image's outputs mean: the class, the boxes, or
the mask (written beside it). The task appends the lines to print and, with
--overlay, draws on `Prediction.drawing`; predict saves that drawing. Files
are written through tf.io.gfile.
"""

import dataclasses
from typing import List, Optional, Sequence

import numpy as np

# A colour per class id for masks and boxes (class 0, background, stays clear).
PALETTE = np.array([[0, 0, 0], [230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200],
                    [245, 130, 48], [145, 30, 180], [70, 240, 240], [240, 50, 230],
                    [210, 245, 60], [250, 190, 212], [0, 128, 128], [220, 190, 255],
                    [170, 110, 40], [255, 250, 200], [128, 0, 0]], np.uint8)


@dataclasses.dataclass
class Prediction:
  """One image of a batch: where it came from and what its prediction says."""
  path: str
  height: int  # The image's own size (the model saw it at --image_size).
  width: int
  stem: str  # output_dir/NAME: masks and overlays go to stem + ".mask.png", ...
  names: Sequence[str] = ()  # The class names in id order; a class without one prints its id.
  drawing: Optional[object] = None  # A PIL image to draw on, with --overlay.
  lines: List[str] = dataclasses.field(default_factory=list)

  def label(self, c: int) -> str:
    """A class as printed: its name where the data named it, else its id."""
    return self.names[c] if c < len(self.names) else str(c)


def resize_labels(labels: np.ndarray, height: int, width: int) -> np.ndarray:
  """Nearest-neighbour resize of a label map [h, w] to [height, width]."""
  h, w = labels.shape
  return labels[np.arange(height) * h // height][:, np.arange(width) * w // width]


def write_mask_png(mask: np.ndarray, path: str) -> None:
  """Writes class ids as a palette PNG (its pixel values are the ids; viewers show colours)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  image = Image.fromarray(mask.astype(np.uint8), mode="P")
  colours = np.resize(PALETTE, (256, 3))
  image.putpalette(colours.reshape(-1).tolist())
  with tf.io.gfile.GFile(path, "wb") as f:
    image.save(f, format="PNG")
