"""Box coding and decoding of the dense detection head; COCO mAP and segmentation metrics."""

import numpy as np
import pytest
import tensorflow as tf

from tfpar.vision import boxes as box_lib
from tfpar.vision import metrics

SIZE, PATCH, C = 32, 4, 3


def _encode(boxes, classes):
  return box_lib.encode(np.array(boxes, np.float32).reshape(-1, 4), np.array(classes, np.int32),
                        image_size=SIZE, patch_size=PATCH, num_classes=C)


def test_encode_marks_patches_near_each_box_centre():
  boxes = [[4, 4, 16, 12], [20, 18, 30, 30]]
  t = _encode(boxes, [2, 0])
  assert t.heatmap.shape == (8, 8, C) and t.regression.shape == (8, 8, 4)
  pos = t.positive.numpy().astype(bool)
  cls = t.heatmap.numpy()
  # Patch (2, 1) has centre (10, 6), inside box 0 and 1.5 patches from its centre (10, 8).
  assert pos[2, 1] and cls[2, 1].tolist() == [0, 0, 1]
  np.testing.assert_allclose(t.regression[2, 1], [(10 - 4) / 4, (6 - 4) / 4, (16 - 10) / 4,
                                                  (12 - 6) / 4])
  assert pos[6, 6] and cls[6, 6].tolist() == [1, 0, 0]
  # Far from any box: background, all zeros.
  assert not pos[0, 7] and not cls[0, 7].any() and not t.regression[0, 7].numpy().any()
  assert cls.sum() == pos.sum()  # one class per positive patch


def test_a_box_smaller_than_a_patch_still_gets_its_patch():
  t = _encode([[9, 9, 11, 11]], [1])  # centre (10, 10) lies in patch (2, 2)
  assert t.positive.numpy().sum() == 1 and t.heatmap[2, 2, 1] == 1


def test_an_image_without_boxes_is_all_background():
  t = _encode(np.zeros((0, 4)), [])
  assert t.positive.numpy().sum() == 0 and t.heatmap.numpy().sum() == 0
  t = _encode([[0, 0, 0, 0]], [-1])  # padding row only
  assert t.positive.numpy().sum() == 0


def test_perfect_targets_decode_to_the_boxes():
  boxes = [[4, 4, 16, 12], [20, 18, 30, 30], [2, 20, 12, 28]]
  classes = [2, 0, 1]
  t = _encode(boxes, classes)
  d = box_lib.decode(t.heatmap[None], t.regression[None], image_size=SIZE, patch_size=PATCH)
  n = int(d.num_detections[0])
  assert n == 3  # NMS keeps one box per object
  got = sorted(zip(d.classes[0, :n].numpy().tolist(), d.boxes[0, :n].numpy().tolist()))
  want = sorted(zip(classes, boxes))
  for (gc, gb), (wc, wb) in zip(got, want):
    assert gc == wc
    np.testing.assert_allclose(gb, wb, atol=1e-4)
  scores = metrics.detection_map([np.array(boxes)], [np.array(classes)], [d.boxes[0].numpy()],
                                 [d.scores[0].numpy()], [d.classes[0].numpy()], num_classes=C)
  assert scores == {"map50": pytest.approx(1.0), "map": pytest.approx(1.0)}


def test_encode_runs_inside_tf_data():
  ds = tf.data.Dataset.from_tensors((tf.constant([[4., 4., 16., 12.]]), tf.constant([1])))
  ds = ds.map(lambda b, c: box_lib.encode(b, c, image_size=SIZE, patch_size=PATCH, num_classes=C))
  t = next(iter(ds))
  assert t.heatmap[2, 1, 1] == 1


def _iou(a, b):
  inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
  area = lambda r: (r[2] - r[0]) * (r[3] - r[1])
  return inter / (area(a) + area(b) - inter)


@pytest.mark.parametrize("shift", [2, 3, 5, 9])
def test_a_shifted_box_scores_by_its_iou(shift):
  truth = [10, 10, 30, 30]
  pred = [10, 10 + shift, 30, 30 + shift]
  iou = _iou(truth, pred)
  m = metrics.detection_map([np.array([truth])], [np.array([0])], [np.array([pred])],
                            [np.array([0.9])], [np.array([0])], num_classes=1)
  thresholds = np.linspace(0.5, 0.95, 10)
  assert m["map50"] == pytest.approx(1.0 if iou >= 0.5 else 0.0)
  assert m["map"] == pytest.approx(np.mean(thresholds <= iou + 1e-9))


def test_map_penalises_wrong_class_and_misses():
  truth = [np.array([[0, 0, 10, 10], [20, 20, 30, 30]])]
  classes = [np.array([0, 1])]
  wrong = metrics.detection_map(truth, classes, truth, [np.array([0.9, 0.8])],
                                [np.array([1, 0])], num_classes=2)
  assert wrong == {"map50": 0.0, "map": 0.0}
  half = metrics.detection_map(truth, classes, [truth[0][:1]], [np.array([0.9])],
                               [np.array([0])], num_classes=2)
  assert half["map50"] == pytest.approx(0.5)  # class 0 found, class 1 missed
  none = metrics.detection_map(truth, classes, [np.zeros((0, 4))], [np.zeros(0)],
                               [np.zeros(0)], num_classes=2)
  assert none == {"map50": 0.0, "map": 0.0}


def test_segmentation_metrics_on_hand_made_maps():
  labels = np.array([[0, 0, 1, 1], [0, 0, 2, 2]])
  perfect = metrics.SegmentationMetrics(3)
  perfect.update(labels, labels)
  assert perfect.result() == {"mean_iou": pytest.approx(1.0), "pixel_accuracy": pytest.approx(1.0)}
  m = metrics.SegmentationMetrics(3)
  m.update(labels, np.zeros_like(labels))  # all background
  # IoU: background 4/8, class 1 0/2, class 2 0/2 -> mean 1/6; 4 of 8 pixels right.
  assert m.result() == {"mean_iou": pytest.approx(1 / 6), "pixel_accuracy": pytest.approx(0.5)}
  m.update(labels, labels)  # accumulates over batches
  assert m.result()["pixel_accuracy"] == pytest.approx(12 / 16)
