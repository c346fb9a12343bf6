"""Held-out metrics for detection and segmentation, from well-kept libraries.

- `detection_map`: COCO mAP@0.5 (`map50`) and mAP@[.5:.95] (`map`) by
  pycocotools' own `COCOeval` (all areas, up to 100 detections per image).
- `SegmentationMetrics`: `mean_iou` (keras.metrics.MeanIoU: the IoU of each
  class that occurs in the labels or the predictions, averaged; background is
  a class like any other) and `pixel_accuracy` (keras.metrics.Accuracy).

Boxes are `(ymin, xmin, ymax, xmax)` in pixels, as everywhere in tfpar.
"""

import contextlib
import io
from typing import Dict, Sequence

import numpy as np


def _xywh(boxes: np.ndarray) -> np.ndarray:
  """[n, 4] (ymin, xmin, ymax, xmax) -> COCO's [n, 4] (x, y, width, height)."""
  boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
  return np.stack([boxes[:, 1], boxes[:, 0], boxes[:, 3] - boxes[:, 1],
                   boxes[:, 2] - boxes[:, 0]], -1)


def detection_map(gt_boxes: Sequence[np.ndarray], gt_classes: Sequence[np.ndarray],
                  det_boxes: Sequence[np.ndarray], det_scores: Sequence[np.ndarray],
                  det_classes: Sequence[np.ndarray], num_classes: int) -> Dict[str, float]:
  """COCO box mAP over a set of images, one list entry per image.

  Args:
    gt_boxes, gt_classes: each image's true boxes [M, 4] and classes [M]
      (entries with class < 0 are padding and ignored).
    det_boxes, det_scores, det_classes: each image's detections [K, 4], [K], [K]
      (entries with score <= 0 are padding and ignored).
    num_classes: C; classes are 0..C-1.

  Returns:
    {"map50": mAP at IoU 0.5, "map": mAP averaged over IoU 0.5:0.05:0.95}; 0
    for both when there are no true boxes.
  """
  from pycocotools.coco import COCO  # pylint: disable=import-outside-toplevel
  from pycocotools.cocoeval import COCOeval  # pylint: disable=import-outside-toplevel
  images, annotations, results = [], [], []
  for i, (boxes, classes) in enumerate(zip(gt_boxes, gt_classes)):
    images.append({"id": i})
    classes = np.asarray(classes).reshape(-1)
    for box, c in zip(_xywh(boxes), classes):
      if c >= 0:
        annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": int(c) + 1,
                            "bbox": box.tolist(), "area": float(box[2] * box[3]), "iscrowd": 0})
  for i, (boxes, scores, classes) in enumerate(zip(det_boxes, det_scores, det_classes)):
    scores, classes = np.asarray(scores).reshape(-1), np.asarray(classes).reshape(-1)
    for box, s, c in zip(_xywh(boxes), scores, classes):
      if s > 0:
        results.append({"image_id": i, "category_id": int(c) + 1, "bbox": box.tolist(),
                        "score": float(s)})
  if not annotations or not results:  # COCOeval cannot load an empty result list.
    return {"map50": 0.0, "map": 0.0}
  gt = COCO()
  gt.dataset = {"images": images, "annotations": annotations,
                "categories": [{"id": c + 1, "name": str(c)} for c in range(num_classes)]}
  with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress.
    gt.createIndex()
    evaluation = COCOeval(gt, gt.loadRes(results), "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
  # stats[0]: AP @ IoU .50:.95, all areas, 100 dets; stats[1]: AP @ IoU .50.
  return {"map50": max(0.0, float(evaluation.stats[1])),
          "map": max(0.0, float(evaluation.stats[0]))}


class SegmentationMetrics:
  """Accumulates mean IoU and pixel accuracy over batches of label maps.

  Args:
    num_classes: labels are 0..num_classes-1 (0 is background for the digit canvases).
  """

  def __init__(self, num_classes: int):
    import keras  # pylint: disable=import-outside-toplevel
    self.num_classes = num_classes
    self._iou = keras.metrics.MeanIoU(num_classes=num_classes)
    self._accuracy = keras.metrics.Accuracy()

  def update(self, labels, predictions) -> None:
    """labels, predictions: int arrays of the same shape (e.g. [B, H, W])."""
    labels = np.asarray(labels, np.int32).reshape(-1)
    predictions = np.asarray(predictions, np.int32).reshape(-1)
    self._iou.update_state(labels, predictions)
    self._accuracy.update_state(labels, predictions)

  def result(self) -> Dict[str, float]:
    return {"mean_iou": float(self._iou.result()),
            "pixel_accuracy": float(self._accuracy.result())}
