"""Trivial baselines for --task=classify on the digits, on tfpar's own held-out split.

  python scripts/digits_baseline.py

prints the held-out accuracy of (1) always answering the most frequent
training class and (2) scikit-learn's logistic regression on the 64 raw
pixels, on exactly the 1,438 / 359 split tfpar trains and evaluates on
(tfpar.data.digit_canvas.split_digits with tfpar.tasks.classify's fixed seed
0 and fraction 0.2), pixels scaled to [0, 1] as the ViT sees them. No TensorFlow.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  from sklearn.linear_model import LogisticRegression  # pylint: disable=import-outside-toplevel
  from tfpar.data.digit_canvas import split_digits  # pylint: disable=import-outside-toplevel
  train, held_out = split_digits(seed=0, eval_fraction=0.2)  # tfpar.tasks.classify's split
  pixels = lambda d: np.round(d.images * (255 / 16)).reshape(len(d.labels), -1) / 255.0
  x_train, x_eval = pixels(train), pixels(held_out)
  majority = np.bincount(train.labels).argmax()
  logistic = LogisticRegression(max_iter=5000).fit(x_train, train.labels)
  print(json.dumps({
      "train_images": len(train.labels), "held_out_images": len(held_out.labels),
      "majority_class_accuracy": float(np.mean(held_out.labels == majority)),
      "logistic_regression_accuracy": float(logistic.score(x_eval, held_out.labels)),
  }))


if __name__ == "__main__":
  main()
