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

import os
import sys
from typing import List, Sequence

import numpy as np
from absl import flags

from tfpar import config as config_lib
from tfpar import console
from tfpar import storage

# A colour per class id for masks and boxes (class 0, background, stays clear).
PALETTE = np.array([[0, 0, 0], [230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200],
                    [245, 130, 48], [145, 30, 180], [70, 240, 240], [240, 50, 230],
                    [210, 245, 60], [250, 190, 212], [0, 128, 128], [220, 190, 255],
                    [170, 110, 40], [255, 250, 200], [128, 0, 0]], np.uint8)


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
  """--image as a list of files (a directory: its images, sorted)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data.images import IMAGE_SUFFIXES  # pylint: disable=import-outside-toplevel
  if tf.io.gfile.isdir(path):
    files = sorted(os.path.join(path, f) for f in tf.io.gfile.listdir(path)
                   if f.lower().endswith(IMAGE_SUFFIXES) and not f.startswith("."))
    if not files:
      raise PredictError(f"--image={path} is a directory without images: pass an image "
                         "file or a directory of PNG/JPEG files")
    return files
  if not tf.io.gfile.exists(path):
    raise PredictError(f"--image={path} does not exist: pass an image file or a directory")
  return [path]


def check(fv: flags.FlagValues) -> None:
  """Validates the flags and the run directory before TensorFlow starts."""
  d = fv.model_dir
  if not d:
    raise PredictError("--model_dir is not set: pass the --model_dir of a tfpar.train run")
  if not storage.exists(os.path.join(d, config_lib.RUN_CONFIG)):
    raise PredictError(f"--model_dir={d} has no config.json: pass the --model_dir of a "
                       "tfpar.train run")
  if read_config(d).model.task == "lm":
    raise PredictError(f"--model_dir={d} holds a language model (--task=lm), but tfpar.predict "
                       "needs a vision run (--task=classify, detect or segment): sample from "
                       "this one with python -m tfpar.generate")
  if not fv.image:
    raise PredictError("--image is not set: pass an image file or a directory of images")
  if not 0 <= fv.score_threshold <= 1:
    raise PredictError(f"--score_threshold={fv.score_threshold} must be in [0, 1]")


def read_config(model_dir: str):
  """The run's Config from model_dir/config.json (dropout off: nothing random at inference)."""
  cfg = config_lib.from_saved(config_lib.read_saved(model_dir))
  return cfg.replace(model={"dropout": 0.0})


def class_names(model_dir: str):
  """The run's class names in id order (config.json), or () where its data had none."""
  return config_lib.saved_class_names(config_lib.read_saved(model_dir))


def _class_label(c: int, names) -> str:
  """A class as printed: its name where the data named it, else its id."""
  return names[c] if c < len(names) else str(c)


def load_model(model_dir: str):
  """(task, model) of the run, its weights restored from the latest checkpoint."""
  import keras  # pylint: disable=import-outside-toplevel
  from tfpar import tasks  # pylint: disable=import-outside-toplevel
  from tfpar.training import checkpoint  # pylint: disable=import-outside-toplevel
  cfg = read_config(model_dir)  # check() refused a language model.
  keras.mixed_precision.set_global_policy("float32")
  task = tasks.make(cfg)
  model = task.build_model()
  model.build_all()
  if checkpoint.load_weights(model, model_dir) is None:
    raise PredictError(f"--model_dir={model_dir} has no readable checkpoint yet: train into it "
                       "first")
  return task, model


def resize_labels(labels: np.ndarray, height: int, width: int) -> np.ndarray:
  """Nearest-neighbour resize of a label map [h, w] to [height, width]."""
  h, w = labels.shape
  return labels[np.arange(height) * h // height][:, np.arange(width) * w // width]


def _mask_png(mask: np.ndarray, path: str) -> None:
  """Writes class ids as a palette PNG (its pixel values are the ids; viewers show colours)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  image = Image.fromarray(mask.astype(np.uint8), mode="P")
  colours = np.resize(PALETTE, (256, 3))
  image.putpalette(colours.reshape(-1).tolist())
  with tf.io.gfile.GFile(path, "wb") as f:
    image.save(f, format="PNG")


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
  """Runs the model on every image; returns the lines it prints.

  Args:
    names: the class names in id order (class_names); a class without one prints its id.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from PIL import Image, ImageDraw  # pylint: disable=import-outside-toplevel
  from tfpar.data import images as images_lib  # pylint: disable=import-outside-toplevel
  m = task.cfg.model
  pixels, sizes = images_lib.decode_images(paths, m.image_size, m.num_channels)
  kind = m.task
  lines = []
  if kind == "segment" or overlay:
    try:
      tf.io.gfile.makedirs(output_dir)
    except (tf.errors.OpError, OSError) as e:
      raise PredictError(f"--output_dir={output_dir} cannot be created ({e.__class__.__name__}): "
                         "pass a writable --output_dir") from None
  for start in range(0, len(paths), batch_size):
    batch = pixels[start:start + batch_size].astype(np.float32) / 255.0
    outputs = model(batch, training=False)
    if kind == "detect":
      found = task.detect(outputs, score_threshold=score_threshold)
    for i, path in enumerate(paths[start:start + batch_size]):
      h, w = (int(v) for v in sizes[start + i])
      stem = os.path.join(output_dir, os.path.splitext(os.path.basename(path))[0])
      drawing = _original(path) if overlay else None
      if kind == "detect":
        n = int(found.num_detections[i])
        keep = range(n)  # NMS kept only boxes scoring at least score_threshold.
        lines.append(f"{path}: {console.count(n, 'box', 'boxes')}")
        scale = np.array([h, w, h, w], np.float32) / m.image_size
        for k in keep:
          box = found.boxes[i, k].numpy() * scale
          c, s = int(found.classes[i, k]), float(found.scores[i, k])
          label = _class_label(c, names)
          lines.append(f"  class {label} score {s:.3f} box (ymin, xmin, ymax, xmax) = "
                       f"({box[0]:.1f}, {box[1]:.1f}, {box[2]:.1f}, {box[3]:.1f})")
          if drawing is not None:
            pen = ImageDraw.Draw(drawing)
            colour = tuple(int(v) for v in PALETTE[1 + c % (len(PALETTE) - 1)])
            pen.rectangle([box[1], box[0], box[3] - 1, box[2] - 1], outline=colour)
            pen.text((box[1] + 1, box[0]), f"{label} {s:.2f}", fill=colour)
      elif kind == "segment":
        labels = np.argmax(np.asarray(outputs[i]), axis=-1)
        mask = resize_labels(labels, h, w)
        _mask_png(mask, stem + ".mask.png")
        present = ", ".join(str(c) for c in np.unique(mask))
        lines.append(f"{path}: mask -> {stem}.mask.png (classes {present})")
        if drawing is not None:
          colours = PALETTE[mask % len(PALETTE)].astype(np.float32)
          base = np.asarray(drawing, np.float32)
          blend = np.where((mask > 0)[..., None], 0.5 * base + 0.5 * colours, base)
          drawing = Image.fromarray(blend.astype(np.uint8))
      else:  # classify
        probs = tf.nn.softmax(tf.cast(outputs[i], tf.float32)).numpy()
        c = int(np.argmax(probs))
        label = _class_label(c, names)
        lines.append(f"{path}: class {label} ({probs[c]:.3f})")
        if drawing is not None:
          ImageDraw.Draw(drawing).text((1, 1), label, fill=(255, 0, 0))
      if drawing is not None:
        _save(drawing, stem + ".overlay.png")
        lines.append(f"  overlay -> {stem}.overlay.png")
  return lines


def fail(message: str) -> None:
  print(f"tfpar.predict: error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def main(argv: Sequence[str]) -> None:
  fv = define_flags()
  if any(a in ("-h", "--help", "-help", "--helpshort") for a in argv[1:]):
    print(__doc__ + "\n" + fv.get_help())
    return
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    fail(str(e))
  if len(rest) > 1:
    fail(f"unexpected arguments {rest[1:]}: flags are written --name=value")
  console.import_tensorflow_quietly()  # check() reads --model_dir through tf.io.gfile.
  try:
    check(fv)
  except (PredictError, config_lib.ConfigError) as e:
    fail(str(e))
  from tfpar.data.corpus import DataError  # pylint: disable=import-outside-toplevel
  from tfpar.training.checkpoint import CheckpointMismatchError  # pylint: disable=import-outside-toplevel
  try:
    paths = list_images(fv.image)
    task, model = load_model(fv.model_dir)
    output_dir = fv.output_dir or os.path.join(fv.model_dir, "predictions")
    lines = predict(task, model, paths, output_dir=output_dir, overlay=fv.overlay,
                    score_threshold=fv.score_threshold, names=class_names(fv.model_dir))
  except (PredictError, config_lib.ConfigError, DataError, CheckpointMismatchError) as e:
    fail(str(e))
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  main(sys.argv)
