"""Digit canvases for detection and segmentation: no overlap, held-out only from held-out digits."""

import numpy as np
import pytest

from tfpar.data import digit_canvas


@pytest.fixture(scope="module")
def canvases():
  return digit_canvas.digit_canvases(60, 30, seed=3, canvas_size=48, scale=2, max_digits=4)


def test_held_out_canvases_use_only_held_out_digits(canvases):
  train, held_out = canvases
  train_digits, eval_digits = digit_canvas.split_digits(3, 0.2)
  assert not set(train_digits.ids) & set(eval_digits.ids)
  used_train = set(train.source_ids[train.source_ids >= 0])
  used_eval = set(held_out.source_ids[held_out.source_ids >= 0])
  assert used_train <= set(train_digits.ids)
  assert used_eval <= set(eval_digits.ids)
  assert not used_train & used_eval


def test_digits_do_not_overlap_and_labels_match_the_ink(canvases):
  from sklearn.datasets import load_digits
  source = load_digits()
  for c in canvases:
    assert c.images.shape == (len(c.images), 48, 48, 1) and c.masks.shape == (len(c.images), 48, 48)
    assert c.images.dtype == np.uint8 and c.images.max() == 255
    for n in range(len(c.images)):
      real = c.classes[n] >= 0
      assert 1 <= real.sum() <= 4
      boxes = c.boxes[n][real]
      for i in range(len(boxes)):  # no two boxes intersect
        for j in range(i + 1, len(boxes)):
          (a0, b0, a1, b1), (c0, d0, c1, d1) = boxes[i], boxes[j]
          assert min(a1, c1) <= max(a0, c0) or min(b1, d1) <= max(b0, d0)
      for box, cls, digit in zip(boxes, c.classes[n][real], c.source_ids[n][real]):
        assert source.target[digit] == cls
        y0, x0, y1, x1 = box.astype(int)
        inside = c.masks[n, y0:y1, x0:x1]
        # The box is tight around the ink of its class, and its ink is that digit's.
        assert (inside == cls + 1).any(axis=1).all() and (inside == cls + 1).any(axis=0).all()
        assert set(np.unique(inside)) <= {0, cls + 1}
      # Every inked pixel belongs to one box; outside the boxes is background.
      covered = np.zeros((48, 48), bool)
      for y0, x0, y1, x1 in boxes.astype(int):
        covered[y0:y1, x0:x1] = True
      assert (c.masks[n][~covered] == 0).all()
      assert (c.images[n, ..., 0][c.masks[n] > 0] >= digit_canvas.INK_THRESHOLD * 255 / 16 - 1).all()


def test_canvases_are_a_function_of_the_seed():
  a = digit_canvas.digit_canvases(5, 5, seed=1)
  b = digit_canvas.digit_canvases(5, 5, seed=1)
  c = digit_canvas.digit_canvases(5, 5, seed=2)
  np.testing.assert_array_equal(a[0].images, b[0].images)
  np.testing.assert_array_equal(a[1].boxes, b[1].boxes)
  assert not np.array_equal(a[0].images, c[0].images)
