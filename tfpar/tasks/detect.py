"""--task=detect: boxes and classes from a ViT with a dense per-patch head (FCOS family).

Every patch predicts C class logits (a sigmoid heatmap) and four distances to
the edges of its object's box; tfpar.vision.boxes defines the targets and
decodes the outputs with per-class non-maximum suppression. Data, order and
augmentation: tfpar.tasks.dense_vision.

Loss, per image, averaged over the images of the global batch:

    sigmoid focal loss (alpha 0.25, gamma 2) summed over patches and classes
    + L1 of the four distances (in patches) summed over positive patches

Held-out metrics: the loss, and COCO `map50` (mAP at IoU 0.5) and `map`
(mAP over IoU 0.5:0.95) by pycocotools, each held-out image counted once.
"""

from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar.console import count
from tfpar.layers.dense_heads import DetectionHead
from tfpar.tasks.dense_vision import DenseVisionTask
from tfpar.tasks.prediction import PALETTE
from tfpar.vision import boxes as box_lib
from tfpar.vision import metrics

ALPHA, GAMMA = 0.25, 2.0  # Focal loss (Lin et al., 2017), as in RetinaNet and FCOS.
BOX_WEIGHT = 1.0


def focal_loss_sum(logits, labels):
  """Sigmoid focal loss summed over every element (float32)."""
  logits, labels = tf.cast(logits, tf.float32), tf.cast(labels, tf.float32)
  ce = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
  p = tf.sigmoid(logits)
  p_t = labels * p + (1 - labels) * (1 - p)
  alpha_t = labels * ALPHA + (1 - labels) * (1 - ALPHA)
  return tf.reduce_sum(alpha_t * (1 - p_t) ** GAMMA * ce)


class Detection(DenseVisionTask):
  """Object detection: inputs [B, S, S, C]; targets the per-patch encoding and the true boxes."""

  kind = "detect"

  @property
  def global_count(self) -> int:
    return self.cfg.train.global_batch_size  # The loss is a mean over images.

  def make_head(self):
    m = self.cfg.model
    return DetectionHead(num_classes=m.num_classes, grid=self.grid, d_model=m.d_model,
                         name="detection_head")

  def targets(self, example) -> Dict:
    m = self.cfg.model
    t = box_lib.encode(example["boxes"], example["classes"], image_size=m.image_size,
                       patch_size=m.patch_size, num_classes=m.num_classes)
    return {"heatmap": t.heatmap, "regression": t.regression, "positive": t.positive,
            "boxes": example["boxes"], "classes": example["classes"], "index": example["index"]}

  def loss(self, outputs, targets):
    c = self.cfg.model.num_classes
    logits, regression = outputs[..., :c], outputs[..., c:]
    box_l1 = tf.reduce_sum(tf.abs(regression - targets["regression"])
                           * targets["positive"][..., None])
    total = focal_loss_sum(logits, targets["heatmap"]) + BOX_WEIGHT * box_l1
    return total / tf.cast(self.global_count, tf.float32)

  def eval_outputs(self, outputs, targets):
    return {"loss": self.loss(outputs, targets), "outputs": outputs, "boxes": targets["boxes"],
            "classes": targets["classes"], "index": targets["index"]}

  def detect(self, outputs, score_threshold: float = 0.05) -> box_lib.Detections:
    """Decoded detections of a batch of head outputs [B, G, G, C + 4]."""
    m = self.cfg.model
    outputs = tf.convert_to_tensor(outputs, tf.float32)
    return box_lib.decode(tf.sigmoid(outputs[..., :m.num_classes]), outputs[..., m.num_classes:],
                          image_size=m.image_size, patch_size=m.patch_size,
                          score_threshold=score_threshold)

  def eval_metrics(self, batches: List[Dict[str, np.ndarray]]) -> Dict[str, float]:
    outputs, true_boxes, true_classes = self.distinct(batches, "outputs", "boxes", "classes")
    d = self.detect(outputs)
    scores = metrics.detection_map(true_boxes, true_classes, d.boxes.numpy(), d.scores.numpy(),
                                   d.classes.numpy(), self.cfg.model.num_classes)
    return {"loss": float(np.mean([b["loss"] for b in batches])), **scores}

  def predict(self, outputs, images, *, score_threshold: float) -> None:
    """Each box (ymin, xmin, ymax, xmax) in the image's own pixels, its class and score:
    those scoring at least score_threshold (NMS keeps no others)."""
    from PIL import ImageDraw  # pylint: disable=import-outside-toplevel
    found = self.detect(outputs, score_threshold=score_threshold)
    size = self.cfg.model.image_size
    for i, image in enumerate(images):
      n = int(found.num_detections[i])
      image.lines.append(f"{image.path}: {count(n, 'box', 'boxes')}")
      scale = np.array([image.height, image.width] * 2, np.float32) / size
      for k in range(n):
        box = found.boxes[i, k].numpy() * scale
        c, s = int(found.classes[i, k]), float(found.scores[i, k])
        label = image.label(c)
        image.lines.append(f"  class {label} score {s:.3f} box (ymin, xmin, ymax, xmax) = "
                           f"({box[0]:.1f}, {box[1]:.1f}, {box[2]:.1f}, {box[3]:.1f})")
        if image.drawing is not None:
          pen = ImageDraw.Draw(image.drawing)
          colour = tuple(int(v) for v in PALETTE[1 + c % (len(PALETTE) - 1)])
          pen.rectangle([box[1], box[0], box[3] - 1, box[2] - 1], outline=colour)
          pen.text((box[1] + 1, box[0]), f"{label} {s:.2f}", fill=colour)


TASK = Detection
