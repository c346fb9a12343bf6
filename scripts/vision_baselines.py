"""Trivial baselines on the held-out digit canvases, scored by the tasks' own metrics.

    python scripts/vision_baselines.py [--image_size=48]

- detect: on every canvas, one box of the mean true size at the canvas centre
  for each of the 10 classes, scored by the class's frequency in training
  (what a model that ignores the image can do), COCO `map50` and `map`;
- segment: every pixel background, `mean_iou` and `pixel_accuracy`.

The canvases are the ones --task=detect and --task=segment hold out
(tfpar.tasks.dense_vision), so the numbers sit beside the trained models' in docs/vision.md.
"""

import argparse
import json

import numpy as np

from tfpar.data import digit_canvas
from tfpar.tasks import dense_vision
from tfpar.vision import metrics


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--image_size", type=int, default=48)
  size = parser.parse_args().image_size
  train, held_out = digit_canvas.digit_canvases(
      dense_vision.TRAIN_CANVASES, dense_vision.EVAL_CANVASES, seed=dense_vision.SPLIT_SEED,
      eval_fraction=dense_vision.EVAL_FRACTION, canvas_size=size, scale=2 if size >= 32 else 1,
      max_digits=dense_vision.MAX_DIGITS)
  real = train.classes >= 0
  sizes = (train.boxes[..., 2:] - train.boxes[..., :2])[real].mean(0)  # (height, width)
  frequency = np.bincount(train.classes[real], minlength=10) / real.sum()
  centre = np.concatenate([size / 2 - sizes / 2, size / 2 + sizes / 2])
  n = len(held_out)
  detect = metrics.detection_map(
      list(held_out.boxes), list(held_out.classes), [np.tile(centre, (10, 1))] * n,
      [frequency] * n, [np.arange(10)] * n, num_classes=10)
  segment = metrics.SegmentationMetrics(11)
  segment.update(held_out.masks, np.zeros_like(held_out.masks))
  print(json.dumps({"image_size": size, "held_out_canvases": n,
                    "detect_centre_box": detect, "segment_all_background": segment.result()}))


if __name__ == "__main__":
  main()
