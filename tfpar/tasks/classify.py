"""--task=classify: a Vision Transformer over image patches, one class per image.

Data (nothing to download): by default scikit-learn's handwritten digits,
1,438 training and 359 held-out 8x8 scans, always the same split (seed 0,
whatever --seed says: tfpar.data.digit_canvas.split_digits), ink 0..16 scaled
to 0..255; or a user's images (--data: a folder with one sub-directory per
class, or TFRecord shards; tfpar.data.images, which checks every class id
against --num_classes), their tail --eval_fraction held out.

Order: example position p reads image `index_at(p)` of tfpar.data.pipeline,
the same pure function of (seed, p) the text windows use, so replicas, a
resumed run and one device see the same examples at the same step.

Augmentation (training only; tfpar.data.augment): each image moves by up to
--max_shift pixels in each direction (zero-padded, then cropped back;
background is 0 ink), drawn from (seed, p), so it is the same on any number of
replicas. Flips are off unless --random_flip: a mirrored digit is not the
same digit (a flipped 2 is no 2, a 7 becomes a mirror glyph no scan shows),
so flipping the digits would teach labels the images no longer carry.

Metrics: the held-out loss and `accuracy`, over distinct held-out images
(each eval batch carries the images' indices, so a batch that wraps around the
held-out set does not count an image twice).
"""

import dataclasses
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar import families, tasks
from tfpar.data import augment, digit_canvas, image_pipeline, images
from tfpar.tasks.task import Task, cross_entropy

DIGITS_SPLIT_SEED = 0  # The digits' held-out split never moves.
DIGITS_EVAL_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class ImageData:
  """The training and held-out images (tfpar.data.images.ImageSet), and where they came from."""
  train: images.ImageSet
  eval: images.ImageSet
  source: str


def load_digits() -> ImageData:
  """scikit-learn's digits as ImageSets of [N, 8, 8, 1] uint8, split once."""
  def image_set(d):
    pixels = np.round(d.images * (255 / 16)).astype(np.uint8)[..., None]  # Ink 0..16 -> 0..255.
    return images.ImageSet(pixels, labels=d.labels, source_ids=d.ids)
  train, held_out = digit_canvas.split_digits(DIGITS_SPLIT_SEED, DIGITS_EVAL_FRACTION)
  return ImageData(image_set(train), image_set(held_out), "scikit-learn load_digits")


class Classification(Task):
  """Image classification with a ViT: inputs [B, S, S, C], targets {"label", "index"} [B].

  The loss is the softmax cross-entropy averaged over the images of the
  global batch; the held-out metrics are that loss and the accuracy;
  throughput counts images.
  """

  unit = "images"

  @classmethod
  def family_of(cls, model_config) -> str:
    del model_config
    return families.default("classify")  # The registered image family (tfpar/models/vit).

  @property
  def units_per_step(self) -> int:
    return self.cfg.train.global_batch_size

  @property
  def global_count(self) -> int:
    return self.cfg.train.global_batch_size  # One label per image.

  def build_model(self, *, tensor_shards: int = 1, seed: int = 0):
    return self.computing(families.get(self.family).build(
        self.cfg.model, tensor_shards=tensor_shards, seed=seed))

  # --- data ---------------------------------------------------------------------
  def load_data(self, *, worker_index: int = 0, num_workers: int = 1):
    m, d = self.cfg.model, self.cfg.data
    if d.data is None:
      data = load_digits()  # Its spec (tfpar.tasks.specs) checked the flags against them.
    else:
      found = tasks.spec("classify").read_images(d.data, image_size=m.image_size,
                                                 channels=m.num_channels, num_classes=m.num_classes)
      train, held_out = images.split(found, d.eval_fraction, seed=DIGITS_SPLIT_SEED)
      data = ImageData(train, held_out, f"--data={d.data}")
    return data, "data"  # In memory: every worker reads its slice of each global batch.

  def describe_data(self, data) -> str:
    shape = "x".join(map(str, data.train.image_shape))
    return (f"{data.source}, {len(data.train):,} train / {len(data.eval):,} held-out images "
            f"of {shape}")

  def class_names(self, data):
    return data.train.class_names  # The class folders' names (none for the digits).

  def dataset(self, split, shard, *, start_step: int = 0, shuffle: bool = True,
              inputs: bool = True):
    d = self.cfg.data
    augmented = shuffle and (d.max_shift > 0 or d.random_flip)

    def transform(example, seeds):
      image = example["image"]  # [S, S, C] in [0, 1]
      if augmented:
        image = augment.augment({"image": image}, seeds, max_shift=d.max_shift,
                                flip=d.random_flip)["image"]
      return image, {"label": example["label"], "index": example["index"]}

    return image_pipeline.image_dataset(split, shard, transform, seed=self.cfg.train.seed,
                                        start_step=start_step, shuffle=shuffle, images=inputs)

  # --- loss and metrics ------------------------------------------------------------
  def loss(self, outputs, targets):
    return cross_entropy(outputs, targets["label"], self.global_count)

  def eval_outputs(self, outputs, targets):
    correct = tf.cast(tf.equal(tf.argmax(outputs, axis=-1, output_type=tf.int32),
                               targets["label"]), tf.float32)
    return {"loss": self.loss(outputs, targets), "correct": correct, "index": targets["index"]}

  def eval_metrics(self, batches: List[Dict[str, np.ndarray]]) -> Dict[str, float]:
    index = np.concatenate([b["index"] for b in batches])
    correct = np.concatenate([b["correct"] for b in batches])
    _, first = np.unique(index, return_index=True)  # Each held-out image once.
    return {"loss": float(np.mean([b["loss"] for b in batches])),
            "accuracy": float(np.mean(correct[first]))}

  def predict(self, outputs, images, *, score_threshold: float) -> None:
    """The likeliest class of each image and its probability (score_threshold: unused)."""
    del score_threshold
    from PIL import ImageDraw  # pylint: disable=import-outside-toplevel
    probs = tf.nn.softmax(tf.cast(outputs, tf.float32)).numpy()
    for image, p in zip(images, probs):
      c = int(np.argmax(p))
      label = image.label(c)
      image.lines.append(f"{image.path}: class {label} ({p[c]:.3f})")
      if image.drawing is not None:
        ImageDraw.Draw(image.drawing).text((1, 1), label, fill=(255, 0, 0))


TASK = Classification
