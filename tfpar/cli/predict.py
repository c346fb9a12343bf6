"""Run a trained vision model on images: the class, the boxes, or the mask.

    python -m tfpar.predict --model_dir=runs/vit_detect --image=photo.png [--overlay]
    python -m tfpar.predict --model_dir=runs/vit_segment --image=DIR --output_dir=out

Wiring only: read the run's flags from DIR/config.json (written by
`python -m tfpar.train`), rebuild its task's model, restore the weights of the
latest canonical checkpoint (any parallel plan may have written it), then
for each image (a file, or every image in a directory), resized to the
model's --image_size:

- classify: prints the class and its probability;
- detect: prints each box (ymin, xmin, ymax, xmax) in the image's own pixels,
  its class and score (those scoring at least --score_threshold);
- segment: writes the mask, a palette PNG of class ids at the image's own
  size (0 background), to --output_dir/NAME.mask.png.

A class prints as its name where the training data named it (a class folder,
a COCO category: tfpar.train records them in config.json), else as its id.

`--overlay` also writes --output_dir/NAME.overlay.png: the boxes, or the mask
in colour, or the class, drawn on the image. Bad input ends with one line on
stderr and exit status 2. These flags belong to this tool alone.
"""

import functools
import os
import sys
from typing import List, Sequence

import numpy as np
from absl import flags

from tfpar import console, storage
from tfpar.cli import tool
from tfpar.config import rundir
from tfpar import tasks
from tfpar.config.schema import ConfigError
from tfpar.tasks.prediction import Prediction

def define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("model_dir", None, "A run directory written by tfpar.train.", flag_values=fv)
  flags.DEFINE_string("image", None, "An image file, or a directory of images.", flag_values=fv)
  flags.DEFINE_string("output_dir", None, "Where masks and overlays go "
                      "(default: MODEL_DIR/predictions).", flag_values=fv)
  flags.DEFINE_bool("overlay", False, "Also write each image with its prediction drawn on it.",
                    flag_values=fv)
  flags.DEFINE_float("score_threshold", 0.3, "detect: print boxes scoring at least this.",
                     flag_values=fv)
  return fv


class PredictError(ValueError):
  """Input predict cannot use; the message names the flag and the fix."""


def list_images(path: str) -> List[str]:
  """--image as a list of files (a directory: its images, sorted), through tfpar.storage."""
  from tfpar.data.images import IMAGE_SUFFIXES  # pylint: disable=import-outside-toplevel
  if storage.isdir(path):
    files = sorted(os.path.join(path, f) for f in storage.listdir(path)
                   if f.lower().endswith(IMAGE_SUFFIXES) and not f.startswith("."))
    if not files:
      raise PredictError(f"--image={path} is a directory without images: pass an image "
                         "file or a directory of PNG/JPEG files")
    return files
  if not storage.exists(path):
    raise PredictError(f"--image={path} does not exist: pass an image file or a directory")
  return [path]


def check(fv: flags.FlagValues) -> None:
  """Validates the flags and the run directory before TensorFlow starts."""
  d = fv.model_dir
  if tasks.spec(rundir.find_run(d, PredictError, warn).model.task).tool != "tfpar.predict":
    raise PredictError(f"--model_dir={d} holds a language model (--task=lm), but tfpar.predict "
                       "needs a vision run (--task=classify, detect or segment): sample from "
                       "this one with python -m tfpar.generate")
  if not fv.image:
    raise PredictError("--image is not set: pass an image file or a directory of images")
  if not 0 <= fv.score_threshold <= 1:
    raise PredictError(f"--score_threshold={fv.score_threshold} must be in [0, 1]")


def class_names(model_dir: str):
  """The run's class names in id order (config.json), or () where its data had none."""
  return rundir.saved_class_names(rundir.read_saved(model_dir))


def _original(path: str):
  """The image as RGB, at its own size, for drawing on."""
  import io  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  with tf.io.gfile.GFile(path, "rb") as f:
    return Image.open(io.BytesIO(f.read())).convert("RGB")


def _save(image, path: str) -> None:
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with tf.io.gfile.GFile(path, "wb") as f:
    image.save(f, format="PNG")


def predict(task, model, paths: Sequence[str], *, output_dir: str, overlay: bool,
            score_threshold: float, names: Sequence[str] = (), batch_size: int = 64) -> List[str]:
  """Runs the model on every image; returns the lines it prints (what they say: the task's
  `predict`).

  Args:
    names: the class names in id order (class_names); a class without one prints its id.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data import images as images_lib  # pylint: disable=import-outside-toplevel
  m = task.cfg.model
  pixels, sizes = images_lib.decode_images(paths, m.image_size, m.num_channels)
  lines = []
  if task.writes_predictions or overlay:
    try:
      tf.io.gfile.makedirs(output_dir)
    except (tf.errors.OpError, OSError) as e:
      raise PredictError(f"--output_dir={output_dir} cannot be created ({e.__class__.__name__}): "
                         "pass a writable --output_dir") from None
  for start in range(0, len(paths), batch_size):
    batch = pixels[start:start + batch_size].astype(np.float32) / 255.0
    found = []
    for path, (h, w) in zip(paths[start:start + batch_size], sizes[start:]):
      stem = os.path.join(output_dir, os.path.splitext(os.path.basename(path))[0])
      found.append(Prediction(path, int(h), int(w), stem, names,
                              _original(path) if overlay else None))
    task.predict(model(batch, training=False), found, score_threshold=score_threshold)
    for image in found:
      lines.extend(image.lines)
      if image.drawing is not None:
        _save(image.drawing, image.stem + ".overlay.png")
        lines.append(f"  overlay -> {image.stem}.overlay.png")
  return lines


fail = functools.partial(tool.fail, "predict")
warn = functools.partial(tool.warn, "predict")


def main(argv: Sequence[str]) -> None:
  fv = define_flags()
  if tool.parse_args(fv, argv, fail, doc=__doc__):
    return
  try:  # Through tfpar.storage: a local path is checked before TensorFlow is imported.
    check(fv)
    paths = list_images(fv.image)
  except (PredictError, ConfigError) as e:
    fail(str(e))
  console.import_tensorflow_quietly()
  from tfpar.data.corpus import DataError  # pylint: disable=import-outside-toplevel
  from tfpar.training.checkpoint import CheckpointMismatchError  # pylint: disable=import-outside-toplevel
  try:
    task, model = tool.load_run(fv.model_dir)  # check() refused a language model.
    output_dir = fv.output_dir or os.path.join(fv.model_dir, "predictions")
    lines = predict(task, model, paths, output_dir=output_dir, overlay=fv.overlay,
                    score_threshold=fv.score_threshold, names=class_names(fv.model_dir))
  except (PredictError, tool.RunError, ConfigError, DataError, CheckpointMismatchError) as e:
    fail(str(e))
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  main(sys.argv)
