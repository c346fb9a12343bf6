"""--task=segment: one class per pixel from a ViT whose patches predict their pixels.

Each patch token predicts the class logits of its p x p pixels
(tfpar.layers.dense_heads.SegmentationHead), so the output has the image's
resolution. Data, order and augmentation: tfpar.tasks.dense_vision. Classes
include the background: 0 is background, and the digit canvases label a
digit's ink 1 + digit, so they need --num_classes=11.

Loss: softmax cross-entropy averaged over the pixels of the global batch.
Held-out metrics: the loss, `mean_iou` (the IoU of each class, background
included, averaged over the classes present) and `pixel_accuracy`, by Keras'
metrics, each held-out image counted once.
"""

from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar.layers.dense_heads import SegmentationHead
from tfpar.tasks import prediction
from tfpar.tasks.dense_vision import DenseVisionTask
from tfpar.tasks.task import cross_entropy
from tfpar.vision import metrics


class Segmentation(DenseVisionTask):
  """Semantic segmentation: inputs [B, S, S, C]; targets {"mask" [B, S, S], "index" [B]}."""

  kind = "segment"
  writes_predictions = True  # The masks.

  @property
  def global_count(self) -> int:
    s = self.cfg.model.image_size
    return self.cfg.train.global_batch_size * s * s  # The loss is a mean over pixels.

  def make_head(self):
    m = self.cfg.model
    return SegmentationHead(num_classes=m.num_classes, grid=self.grid, patch_size=m.patch_size,
                            name="segmentation_head")

  def targets(self, example) -> Dict:
    return {"mask": example["mask"], "index": example["index"]}

  def loss(self, outputs, targets):
    return cross_entropy(outputs, targets["mask"], self.global_count)

  def eval_outputs(self, outputs, targets):
    return {"loss": self.loss(outputs, targets),
            "predictions": tf.argmax(outputs, axis=-1, output_type=tf.int32),
            "mask": targets["mask"], "index": targets["index"]}

  def eval_metrics(self, batches: List[Dict[str, np.ndarray]]) -> Dict[str, float]:
    predictions, mask = self.distinct(batches, "predictions", "mask")
    scores = metrics.SegmentationMetrics(self.cfg.model.num_classes)
    scores.update(mask, predictions)
    return {"loss": float(np.mean([b["loss"] for b in batches])), **scores.result()}

  def predict(self, outputs, images, *, score_threshold: float) -> None:
    """Writes each mask, a palette PNG of class ids at the image's own size (0 background),
    to stem.mask.png (score_threshold: unused)."""
    del score_threshold
    from PIL import Image  # pylint: disable=import-outside-toplevel
    for image, logits in zip(images, np.asarray(outputs)):
      mask = prediction.resize_labels(np.argmax(logits, axis=-1), image.height, image.width)
      prediction.write_mask_png(mask, image.stem + ".mask.png")
      present = ", ".join(str(c) for c in np.unique(mask))
      image.lines.append(f"{image.path}: mask -> {image.stem}.mask.png (classes {present})")
      if image.drawing is not None:
        colours = prediction.PALETTE[mask % len(prediction.PALETTE)].astype(np.float32)
        base = np.asarray(image.drawing, np.float32)
        blend = np.where((mask > 0)[..., None], 0.5 * base + 0.5 * colours, base)
        image.drawing = Image.fromarray(blend.astype(np.uint8))


TASK = Segmentation
