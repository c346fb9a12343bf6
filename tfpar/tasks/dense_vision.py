"""What --task=detect and --task=segment share: the data, and a ViT with a per-patch head.

Data (nothing to download) by default: canvases of scikit-learn's digits
(tfpar.data.digit_canvas): `--image_size` pixels square, 1 to 4 digits each,
upscaled 2x when the canvas is at least 32 pixels. The digits are split once,
by a permutation with a fixed seed (0) whatever --seed says, into the same
1,438 training and 359 held-out scans as --task=classify; 6,000 training
canvases are built from training scans and 500 held-out canvases from
held-out scans only. With --data, the images a user brings (see
tfpar.data.images for the layouts), --eval_fraction of them held out by a
fixed-seed permutation.

Order and augmentation: tfpar.data.image_pipeline (a pure function of
(seed, step)); in training, a random crop of up to --max_shift pixels and,
with --random_flip, a left-right flip, boxes and masks moved with the pixels.

Model: the image family's model with a dense head over the patch tokens in
place of its classifier (its registered `dense` model: the ViT's DenseViT),
the head from tfpar.layers.dense_heads and the partitioning table the family
registered for the task (`tables`, by name <family>_<task>).
"""

import dataclasses
from typing import Dict, List

import numpy as np

from tfpar import families, tasks
from tfpar.data import augment, digit_canvas, image_pipeline, images
from tfpar.tasks.task import Task

SPLIT_SEED = 0  # As --task=classify's digits split: the same held-out scans.
EVAL_FRACTION = 0.2
TRAIN_CANVASES, EVAL_CANVASES = 6000, 500
MAX_DIGITS = 4


@dataclasses.dataclass(frozen=True)
class VisionData:
  """The training and held-out ImageSets, and where they came from."""
  train: images.ImageSet
  eval: images.ImageSet
  source: str


class DenseVisionTask(Task):
  """Base of the detection and segmentation tasks; subclasses set `kind` and the head's parts."""

  unit = "images"
  kind = ""  # "detect" or "segment": which labels the data carries.

  @classmethod
  def family_of(cls, model_config) -> str:
    """The image family's table for this task's head (the head's shapes differ)."""
    del model_config
    return f"{families.default('classify')}_{cls.kind}"

  @property
  def units_per_step(self) -> int:
    return self.cfg.train.global_batch_size

  @property
  def grid(self) -> int:
    return self.cfg.model.image_size // self.cfg.model.patch_size

  def make_head(self):
    raise NotImplementedError

  def build_model(self, *, tensor_shards: int = 1, seed: int = 0):
    family = families.get(families.default("classify"))
    return self.computing(family.dense_class()(
        self.cfg.model, head=self.make_head(), rules=families.rules(self.family),
        tensor_shards=tensor_shards, seed=seed))

  # --- data ---------------------------------------------------------------------
  def load_data(self, *, worker_index: int = 0, num_workers: int = 1):
    m, d = self.cfg.model, self.cfg.data
    if d.data is None:  # Its spec (tfpar.tasks.specs) checked the flags against them.
      scale = 2 if m.image_size >= 32 else 1
      train, held_out = digit_canvas.digit_canvases(
          TRAIN_CANVASES, EVAL_CANVASES, seed=SPLIT_SEED, eval_fraction=EVAL_FRACTION,
          canvas_size=m.image_size, scale=scale, max_digits=MAX_DIGITS)
      data = VisionData(train, held_out, f"canvases of scikit-learn digits (x{scale})")
    else:
      every = tasks.spec(self.kind).read_images(d.data, image_size=m.image_size,
                                                channels=m.num_channels, num_classes=m.num_classes)
      train, held_out = images.split(every, d.eval_fraction, SPLIT_SEED)
      data = VisionData(train, held_out, f"--data={d.data}")
    return data, "data"  # In memory: every worker reads its slice of each global batch.

  def describe_data(self, data) -> str:
    shape = "x".join(map(str, data.train.image_shape))
    return (f"{data.source}, {len(data.train):,} train / {len(data.eval):,} held-out images "
            f"of {shape}")

  def class_names(self, data):
    return data.train.class_names  # A COCO file's category names (none for the canvases).

  def dataset(self, split, shard, *, start_step: int = 0, shuffle: bool = True,
              inputs: bool = True):
    d = self.cfg.data

    def transform(example, seed):
      if shuffle:  # Training: augment. Held out: the images as they are.
        example = augment.augment(example, seed, max_shift=d.max_shift, flip=d.random_flip)
      return example["image"], self.targets(example)

    return image_pipeline.image_dataset(split, shard, transform, seed=self.cfg.train.seed,
                                        start_step=start_step, shuffle=shuffle, images=inputs)

  def targets(self, example) -> Dict:
    """One example's targets (a dict of tensors) from its labels."""
    raise NotImplementedError

  @staticmethod
  def distinct(batches: List[Dict[str, np.ndarray]], *keys):
    """The held-out examples' `keys`, each example once (a batch may wrap around the set)."""
    index = np.concatenate([b["index"] for b in batches])
    _, first = np.unique(index, return_index=True)
    return [np.concatenate([b[k] for b in batches])[first] for k in keys]
