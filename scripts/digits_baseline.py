"""Trivial baselines for --task=classify on the digits, on tfpar's own held-out split.

  python scripts/digits_baseline.py

prints the held-out accuracy of (1) always answering the most frequent
training class and (2) scikit-learn's logistic regression on the 64 raw
pixels, on exactly the 1,438 / 359 split tfpar trains and evaluates on
(tfpar.data.digits.load_digits_split). Runs in a few seconds, no TensorFlow.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  from sklearn.linear_model import LogisticRegression  # pylint: disable=import-outside-toplevel
  from tfpar.data.digits import load_digits_split  # pylint: disable=import-outside-toplevel
  train, held_out = load_digits_split()
  x_train, x_eval = train.images.reshape(len(train), -1), held_out.images.reshape(len(held_out), -1)
  majority = np.bincount(train.labels).argmax()
  logistic = LogisticRegression(max_iter=5000).fit(x_train, train.labels)
  print(json.dumps({
      "train_images": len(train), "held_out_images": len(held_out),
      "majority_class_accuracy": float(np.mean(held_out.labels == majority)),
      "logistic_regression_accuracy": float(logistic.score(x_eval, held_out.labels)),
  }))


if __name__ == "__main__":
  main()
