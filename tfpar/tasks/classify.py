"""--task=classify: a Vision Transformer over image patches, one class per image.

Data (nothing to download): by default scikit-learn's handwritten digits,
1,438 training and 359 held-out 8x8 scans, always the same split
(tfpar.data.digits).

Order: example position p reads image `index_at(p)` of tfpar.data.pipeline,
the same pure function of (seed, p) the text windows use, so replicas, a
resumed run and one device see the same examples at the same step.

Augmentation (training only): each image moves by up to --max_shift pixels in
each direction (zero-padded, then randomly cropped back; background is 0 ink),
drawn from (seed, p), so it is the same on any number of replicas. Flips are
off unless --random_flip: a mirrored digit is not the same digit (a flipped 2
is no 2, and an upside-down 6 is a 9), so flipping would teach wrong labels.

Metrics: the held-out loss and `accuracy`, over distinct held-out images
(each eval batch carries the images' indices, so a batch that wraps around the
held-out set does not count an image twice).
"""

import dataclasses
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar.data import pipeline
from tfpar.data.corpus import DataError
from tfpar.data.digits import Images, load_digits_split
from tfpar.models import ViT
from tfpar.tasks.task import Task, cross_entropy


@dataclasses.dataclass(frozen=True)
class ImageData:
  """The training and held-out images, and where they came from."""
  train: Images
  eval: Images
  source: str


def check_images(data: Images, *, image_size: int, num_channels: int, num_classes: int,
                 where: str) -> None:
  """Raises DataError (one line: what is wrong and the flag that fixes it)."""
  shape = data.images.shape[1:]
  if shape != (image_size, image_size, num_channels):
    raise DataError(f"{where} has images of shape {shape}, the model takes "
                    f"({image_size}, {image_size}, {num_channels}): set --image_size and "
                    "--num_channels to match the data")
  bad = data.labels[(data.labels < 0) | (data.labels >= num_classes)]
  if bad.size:
    raise DataError(f"{where} has class id {int(bad[0])}, outside --num_classes={num_classes} "
                    f"(ids 0..{num_classes - 1}): raise --num_classes or fix the labels")


class Classification(Task):
  """Image classification with a ViT: inputs [B, S, S, C], targets {"label", "index"} [B].

  The loss is the softmax cross-entropy averaged over the images of the
  global batch; the held-out metrics are that loss and the accuracy;
  throughput counts images.
  """

  unit = "images"

  @property
  def units_per_step(self) -> int:
    return self.cfg.train.global_batch_size

  @property
  def global_count(self) -> int:
    return self.cfg.train.global_batch_size  # One label per image.

  def build_model(self, *, tensor_shards: int = 1, seed: int = 0) -> ViT:
    return ViT(self.cfg.model, tensor_shards=tensor_shards, seed=seed)

  @staticmethod
  def embed_head_params(model_config):
    m = model_config
    d, tokens = m.d_model, m.num_patches + (1 if m.pooling == "cls" else 0)
    patches = m.patch_size * m.patch_size * m.num_channels * d + d  # Conv kernel + bias.
    embedding = patches + tokens * d + (d if m.pooling == "cls" else 0)  # + positions, class token
    head = 2 * d + d * m.num_classes + m.num_classes  # LayerNorm + classifier
    return embedding, head

  # --- data ---------------------------------------------------------------------
  def load_data(self, *, worker_index: int = 0, num_workers: int = 1):
    m = self.cfg.model
    if self.cfg.data.data is not None:
      raise DataError(f"--data={self.cfg.data.data}: --task=classify reads only the built-in "
                      "digits so far; drop --data")
    train, held_out = load_digits_split()
    data = ImageData(train, held_out, "scikit-learn load_digits")
    for split, where in ((train, "the training set"), (held_out, "the held-out set")):
      check_images(split, image_size=m.image_size, num_channels=m.num_channels,
                   num_classes=m.num_classes, where=f"{data.source}: {where}")
    return data, "data"  # In memory: every worker reads its slice of each global batch.

  def describe_data(self, data) -> str:
    shape = "x".join(map(str, data.train.images.shape[1:]))
    return (f"{data.source}, {len(data.train):,} train / {len(data.eval):,} held-out images "
            f"of {shape}")

  def dataset(self, split, shard, *, start_step: int = 0, shuffle: bool = True):
    seed, n, d = self.cfg.train.seed, len(split), self.cfg.data
    images, labels = tf.constant(split.images), tf.constant(split.labels)
    augment = shuffle and (d.max_shift > 0 or d.random_flip)

    def example(position):
      i = pipeline.index_at(position, n, seed=seed, shuffle=shuffle)
      image = images[i]
      if augment:
        image = self._augment(image, tf.stack([tf.constant(seed, tf.int64), position]))
      return image, {"label": labels[i], "index": i}

    ds = pipeline.sample_positions(shard, start_step=start_step).unbatch()
    ds = ds.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(shard.per_replica_batch, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = True
    # We shard by construction (tfpar.data.pipeline): tell tf.distribute not to.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

  def _augment(self, image, seed):
    """A random shift of up to --max_shift pixels (and a left-right flip with --random_flip)."""
    d, s = self.cfg.data, self.cfg.model.image_size
    if d.max_shift > 0:
      k = d.max_shift
      padded = tf.pad(image, [[k, k], [k, k], [0, 0]])
      image = tf.image.stateless_random_crop(padded, tf.shape(image), seed=seed)
      image = tf.ensure_shape(image, (s, s, self.cfg.model.num_channels))
    if d.random_flip:
      image = tf.image.stateless_random_flip_left_right(image, seed=seed[::-1])
    return image

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


TASK = Classification
