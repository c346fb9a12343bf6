"""Box coding for a dense per-patch detection head (FCOS family, one feature level).

A ViT with patch size s on an S x S image sees a G x G grid of patches
(G = S / s); patch (i, j) has its centre at c = ((i + 1/2) s, (j + 1/2) s).
The head predicts, at every patch, C class scores (a sigmoid heatmap) and four
distances from c to the edges of the box it belongs to:

    regression = ((c_y - ymin) / s, (c_x - xmin) / s, (ymax - c_y) / s, (xmax - c_x) / s)

Targets (`encode`): patch p is positive for box m when c lies inside the box
and within `center_radius * s` of the box's centre in both coordinates (FCOS
centre sampling); the patch holding the box centre is always positive for it,
so a box smaller than a patch still has one. A patch claimed by two boxes
takes the smaller. A positive patch's heatmap target is the one-hot class of
its box; every other patch is background (all zeros).

Decoding (`decode`): boxes from each patch's distances, scored by its class
probabilities, then per-class non-maximum suppression
(`tf.image.combined_non_max_suppression`).

Boxes are `(ymin, xmin, ymax, xmax)` in pixels, TensorFlow's order.
"""

from typing import NamedTuple

import tensorflow as tf


class Targets(NamedTuple):
  heatmap: tf.Tensor  # [G, G, C] float32, one-hot class at positive patches
  regression: tf.Tensor  # [G, G, 4] float32, edge distances / stride (0 at negatives)
  positive: tf.Tensor  # [G, G] float32, 1 at positive patches


class Detections(NamedTuple):
  boxes: tf.Tensor  # [B, K, 4] float32 pixels
  scores: tf.Tensor  # [B, K] float32
  classes: tf.Tensor  # [B, K] int32
  num_detections: tf.Tensor  # [B] int32: entries past it are padding


def patch_centers(grid: int, stride: int) -> tf.Tensor:
  """[G * G, 2] (c_y, c_x) of the patches, row-major like the ViT's tokens."""
  c = (tf.range(grid, dtype=tf.float32) + 0.5) * stride
  cy, cx = tf.meshgrid(c, c, indexing="ij")
  return tf.reshape(tf.stack([cy, cx], -1), [-1, 2])


def encode(boxes, classes, *, image_size: int, patch_size: int, num_classes: int,
           center_radius: float = 1.5) -> Targets:
  """The head's targets for one image.

  Args:
    boxes: [M, 4] float, pixels (padding rows are ignored).
    classes: [M] int, 0..C-1; -1 marks padding.
  """
  grid = image_size // patch_size
  stride = float(patch_size)
  # One padding row more, so that an image without boxes still has M >= 1.
  boxes = tf.concat([tf.reshape(tf.cast(boxes, tf.float32), [-1, 4]), tf.zeros([1, 4])], 0)
  classes = tf.concat([tf.reshape(tf.cast(classes, tf.int32), [-1]), [-1]], 0)
  centers = patch_centers(grid, patch_size)  # [P, 2]
  cy, cx = centers[:, 0:1], centers[:, 1:2]  # [P, 1]
  ymin, xmin, ymax, xmax = [boxes[None, :, k] for k in range(4)]  # [1, M]
  dist = tf.stack([cy - ymin, cx - xmin, ymax - cy, xmax - cx], -1) / stride  # [P, M, 4]
  inside = tf.reduce_min(dist, -1) > 0  # [P, M]
  by, bx = (ymin + ymax) / 2, (xmin + xmax) / 2
  radius = center_radius * stride
  near = (tf.abs(cy - by) <= radius) & (tf.abs(cx - bx) <= radius)
  # The patch holding the box centre, whatever the box's size.
  holds_center = (tf.floor(cy / stride) == tf.floor(by / stride)) & (
      tf.floor(cx / stride) == tf.floor(bx / stride))
  real = classes[None, :] >= 0
  candidate = ((inside & near) | holds_center) & real  # [P, M]
  area = (ymax - ymin) * (xmax - xmin)  # [1, M]
  area = tf.where(candidate, tf.broadcast_to(area, tf.shape(candidate)), float("inf"))
  best = tf.argmin(area, axis=1, output_type=tf.int32)  # [P]
  positive = tf.reduce_any(candidate, axis=1)  # [P]
  heatmap = tf.one_hot(tf.where(positive, tf.gather(classes, best), -1), num_classes)  # -1: zeros
  regression = tf.gather(dist, best[:, None], batch_dims=1)[:, 0]  # [P, 4]
  regression = tf.where(positive[:, None], regression, 0.0)
  return Targets(tf.reshape(heatmap, [grid, grid, num_classes]),
                 tf.reshape(regression, [grid, grid, 4]),
                 tf.reshape(tf.cast(positive, tf.float32), [grid, grid]))


def regression_to_boxes(regression, *, patch_size: int) -> tf.Tensor:
  """[B, G, G, 4] distances / stride -> [B, G * G, 4] boxes in pixels."""
  b, g = tf.shape(regression)[0], regression.shape[1]
  centers = patch_centers(g, patch_size)  # [P, 2]
  d = tf.reshape(tf.cast(regression, tf.float32), [b, -1, 4]) * float(patch_size)
  return tf.concat([centers - d[..., :2], centers + d[..., 2:]], -1)


def decode(scores, regression, *, image_size: int, patch_size: int, max_detections: int = 100,
           iou_threshold: float = 0.5, score_threshold: float = 0.05) -> Detections:
  """Boxes, classes and scores from the head's outputs, after per-class NMS.

  Args:
    scores: [B, G, G, C] class probabilities (sigmoid of the heatmap logits).
    regression: [B, G, G, 4] edge distances / stride.
  """
  b, c = tf.shape(scores)[0], scores.shape[-1]
  boxes = regression_to_boxes(regression, patch_size=patch_size) / float(image_size)
  nms = tf.image.combined_non_max_suppression(
      boxes[:, :, None, :], tf.reshape(tf.cast(scores, tf.float32), [b, -1, c]),
      max_output_size_per_class=max_detections, max_total_size=max_detections,
      iou_threshold=iou_threshold, score_threshold=score_threshold, clip_boxes=True)
  return Detections(nms.nmsed_boxes * float(image_size), nms.nmsed_scores,
                    tf.cast(nms.nmsed_classes, tf.int32), nms.valid_detections)
