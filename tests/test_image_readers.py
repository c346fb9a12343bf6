"""Readers for the images users bring (folders, COCO JSON, mask pairs, TFRecords) and augmentation."""

import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tfpar import tasks
from tfpar.data import augment, image_records
from tfpar.data.corpus import DataError


def _png(array, mode=None):
  buf = io.BytesIO()
  image = Image.fromarray(np.asarray(array, np.uint8), mode=mode)
  if mode == "P":
    image.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 756)
  image.save(buf, format="PNG")
  return buf.getvalue()


def _write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def _solid(value, h=12, w=10):
  return np.full((h, w, 3), value, np.uint8)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A class folder, a COCO set and a mask-pair set, and TFRecords of each."""
  root = tmp_path_factory.mktemp("images")
  # Classification: class "cat" is dark, "dog" bright.
  for label, (name, value) in enumerate((("cat", 40), ("dog", 200))):
    for i in range(3):
      _write(str(root / "folder" / name / f"{i}.png"), _png(_solid(value + i)))
  # Detection: two 20 (h) x 16 (w) images; COCO category ids 3 and 7 -> classes 0 and 1.
  coco = {"images": [{"id": 1, "file_name": "a.png", "width": 16, "height": 20},
                     {"id": 2, "file_name": "b.png", "width": 16, "height": 20}],
          "annotations": [{"id": 1, "image_id": 1, "bbox": [2, 4, 8, 10], "category_id": 7},
                          {"id": 2, "image_id": 1, "bbox": [0, 0, 4, 4], "category_id": 3},
                          {"id": 3, "image_id": 2, "bbox": [8, 10, 8, 10], "category_id": 3,
                           "iscrowd": 1}],
          "categories": [{"id": 3, "name": "three"}, {"id": 7, "name": "seven"}]}
  for name in ("a.png", "b.png"):
    _write(str(root / "coco" / name), _png(_solid(90, 20, 16)))
  _write(str(root / "coco" / "instances.json"), json.dumps(coco).encode())
  # Segmentation: a palette mask with classes 0, 1, 2 in quadrants-ish.
  mask = np.zeros((8, 8), np.uint8)
  mask[:4, 4:] = 1
  mask[4:, :4] = 2
  _write(str(root / "seg" / "images" / "x.png"), _png(_solid(10, 8, 8)))
  _write(str(root / "seg" / "masks" / "x.png"), _png(mask, mode="P"))
  # TFRecords of each.
  with tf.io.TFRecordWriter(str(root / "classify.tfrecord")) as w:
    for label, value in ((0, 40), (1, 200)):
      w.write(image_records.classify_example(_png(_solid(value)), label).SerializeToString())
  with tf.io.TFRecordWriter(str(root / "detect.tfrecord")) as w:
    boxes = np.array([[4 / 20, 2 / 16, 14 / 20, 10 / 16]])
    w.write(image_records.detect_example(_png(_solid(90, 20, 16)), boxes, [1]).SerializeToString())
    w.write(image_records.detect_example(_png(_solid(90, 20, 16)), np.zeros((0, 4)),
                                         []).SerializeToString())
  with tf.io.TFRecordWriter(str(root / "segment.tfrecord")) as w:
    w.write(image_records.segment_example(_png(_solid(10, 8, 8)),
                                          _png(mask, mode="P")).SerializeToString())
  return root


def test_image_folder(data_dir):
  s = tasks.spec("classify").read_images(str(data_dir / "folder"), image_size=8, channels=3,
                                         num_classes=2)
  assert s.images.shape == (6, 8, 8, 3) and s.images.dtype == np.uint8
  assert s.labels.tolist() == [0, 0, 0, 1, 1, 1] and s.class_names == ("cat", "dog")
  assert s.images[0].min() == s.images[0].max() == 40 and s.images[5].max() == 202
  gray = tasks.spec("classify").read_images(str(data_dir / "folder"), image_size=4, channels=1,
                                            num_classes=2)
  assert gray.images.shape == (6, 4, 4, 1)


def test_coco_json(data_dir):
  s = tasks.spec("detect").read_images(str(data_dir / "coco" / "instances.json"), image_size=8,
                                       channels=3, num_classes=2)
  assert s.images.shape == (2, 8, 8, 3) and s.class_names == ("three", "seven")
  # [x, y, w, h] = [2, 4, 8, 10] on 16 x 20 -> (ymin, xmin, ymax, xmax) * (8/20, 8/16).
  np.testing.assert_allclose(s.boxes[0, 0], [4 * 0.4, 2 * 0.5, 14 * 0.4, 10 * 0.5])
  assert s.classes[0].tolist() == [1, 0]
  assert s.classes[1].tolist() == [-1, -1]  # the crowd box is skipped


def test_mask_pairs_read_palette_indices(data_dir):
  s = tasks.spec("segment").read_images(str(data_dir / "seg"), image_size=4, channels=3,
                                        num_classes=3)
  assert s.images.shape == (1, 4, 4, 3)
  np.testing.assert_array_equal(s.masks[0], [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 0, 0],
                                             [2, 2, 0, 0]])


def test_tfrecords_read_like_the_files(data_dir):
  kw = dict(image_size=8, channels=3)
  c = tasks.spec("classify").read_images(str(data_dir / "classify.tfrecord"), num_classes=2, **kw)
  assert c.labels.tolist() == [0, 1] and c.images[1].max() == 200
  d = tasks.spec("detect").read_images(str(data_dir / "detect.tfrecord"), num_classes=2, **kw)
  coco = tasks.spec("detect").read_images(str(data_dir / "coco" / "instances.json"), num_classes=2,
                                          **kw)
  np.testing.assert_allclose(d.boxes[0, 0], coco.boxes[0, 0], rtol=1e-6)
  assert d.classes.tolist() == [[1], [-1]]
  s = tasks.spec("segment").read_images(str(data_dir / "segment.tfrecord"), num_classes=3, **kw)
  folder = tasks.spec("segment").read_images(str(data_dir / "seg"), num_classes=3, **kw)
  np.testing.assert_array_equal(s.masks, folder.masks)
  np.testing.assert_array_equal(s.images, folder.images)


def _error(data, task, num_classes=2):
  with pytest.raises(DataError) as e:
    tasks.spec(task).read_images(str(data), image_size=8, channels=3, num_classes=num_classes)
  return str(e.value)


def test_bad_inputs_name_the_problem(data_dir, tmp_path):
  (tmp_path / "empty" / "cat").mkdir(parents=True)
  assert "holds no images" in _error(tmp_path / "empty", "classify")
  assert "--num_classes=2" in _error(data_dir / "folder", "classify", num_classes=1)
  assert "outside --num_classes=2" in _error(data_dir / "seg", "segment")
  assert "outside --num_classes=1" in _error(data_dir / "classify.tfrecord", "classify", 1)
  assert "outside --num_classes=1" in _error(data_dir / "detect.tfrecord", "detect", 1)
  _write(str(tmp_path / "broken" / "cat" / "bad.png"), b"not a png")
  message = _error(tmp_path / "broken", "classify")
  assert "bad.png is not a readable image" in message
  coco = json.loads((data_dir / "coco" / "instances.json").read_text())
  coco["annotations"][0]["bbox"] = [10, 4, 8, 10]  # x + w = 18 > width 16
  bad_json = data_dir / "coco" / "outside.json"
  bad_json.write_text(json.dumps(coco))
  assert "outside its 16x20 image" in _error(bad_json, "detect")


def test_a_jpeg_under_four_channels_blames_the_flag_not_the_image(tmp_path):
  """A JPEG has no alpha channel: under channels=4 a good JPEG fails to decode."""
  for name in ("cat", "dog"):
    (tmp_path / "images" / name).mkdir(parents=True)
    Image.fromarray(_solid(90)).save(tmp_path / "images" / name / "0.jpg")
  with pytest.raises(DataError) as e:
    tasks.spec("classify").read_images(str(tmp_path / "images"), image_size=8, channels=4,
                                       num_classes=2)
  assert "cat/0.jpg cannot be decoded to --num_channels=4" in str(e.value)
  assert "not a readable image" not in str(e.value)


DROP = object()  # As a new value: remove the field.
# (list, entry, field, new value, what the one line must say): each a field tfpar reads.
BAD_COCO = [
    ("annotations", 0, "bbox", DROP, "annotation 0 (id 1) has no 'bbox'"),
    ("annotations", 1, "category_id", DROP, "annotation 1 (id 2) has no 'category_id'"),
    ("annotations", 0, "bbox", "1,2,3,4", "annotation 0 (id 1) has bbox '1,2,3,4', not [x, y, "
     "width, height]"),
    ("annotations", 1, "bbox", [0, 0, 4], "annotation 1 (id 2) has bbox [0, 0, 4], not"),
    ("annotations", 0, "image_id", DROP, "annotation 0 (id 1) has no 'image_id'"),
    ("images", 1, "width", DROP, "image 1 (id 2) has no 'width'"),
    ("images", 0, "height", "20", "image 0 (id 1) has height '20', not"),
    ("images", 0, "file_name", DROP, "image 0 (id 1) has no 'file_name'"),
    ("categories", 1, "id", DROP, "category 1 has no 'id'"),
    ("categories", None, None, [], "lists no categories"),
    ("annotations", None, None, [], "lists no annotations"),
    ("annotations", None, None, [{"id": 1, "image_id": 1, "iscrowd": 1}],
     "has no annotations but crowd regions"),
]


@pytest.mark.parametrize("key,index,field,value,words", BAD_COCO,
                         ids=[w.split(" has ")[-1] if " has " in w else w for *_, w in BAD_COCO])
def test_a_bad_coco_field_names_the_file_the_entry_and_the_field(data_dir, tmp_path, key, index,
                                                                 field, value, words):
  """Not a KeyError or ValueError, and no training on nothing: one line with the fix."""
  coco = json.loads((data_dir / "coco" / "instances.json").read_text())
  if index is None:
    coco[key] = value
  elif value is DROP:
    del coco[key][index][field]
  else:
    coco[key][index][field] = value
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(coco))
  message = _error(path, "detect")
  assert message.startswith(str(path)) and words in message and "\n" not in message, message


def _example_with_box():
  """A 32 x 32 image holding a bright rectangle, its box and its mask."""
  image = np.zeros((32, 32, 1), np.float32)
  image[8:20, 12:28] = 1.0
  mask = (image[..., 0] > 0).astype(np.int32) * 3
  return {"image": tf.constant(image), "boxes": tf.constant([[8., 12., 20., 28.], [0., 0., 0., 0.]]),
          "classes": tf.constant([3, -1]), "mask": tf.constant(mask)}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_crop_moves_boxes_and_masks_with_the_pixels(seed):
  out = augment.random_crop(_example_with_box(), tf.constant([seed, 7]), max_shift=6)
  ink = out["image"].numpy()[..., 0] > 0.5
  rows, cols = np.nonzero(ink)
  # The box still encloses exactly the rectangle's pixels, and the mask covers them.
  assert out["classes"][0] == 3
  np.testing.assert_array_equal(out["boxes"][0], [rows.min(), cols.min(), rows.max() + 1,
                                                  cols.max() + 1])
  assert out["classes"][1] == -1  # padding stays padding
  np.testing.assert_array_equal(out["mask"].numpy() == 3, ink)
  assert out["image"].shape == (32, 32, 1)


def test_crop_drops_a_box_mostly_cut_away():
  example = _example_with_box()
  example["boxes"] = tf.constant([[0., 0., 4., 4.], [10., 10., 20., 20.]])
  example["classes"] = tf.constant([1, 2])
  kept = []
  for seed in range(20):
    out = augment.random_crop(example, tf.constant([seed, 0]), max_shift=3)
    kept.append(int(out["classes"][0]))
    assert out["classes"][1] == 2  # the inner box is never cut
  assert -1 in kept and 1 in kept  # shifted up-left by 3, only 1 x 1 of 4 x 4 is left


def test_flip_mirrors_boxes_and_masks_and_is_a_function_of_the_seed():
  example = _example_with_box()
  flips = [augment.random_flip(example, tf.constant([s, 0])) for s in range(8)]
  flipped = [f for f in flips if not np.array_equal(f["image"], example["image"])]
  assert 0 < len(flipped) < 8
  f = flipped[0]
  np.testing.assert_array_equal(f["boxes"][0], [8, 4, 20, 20])
  np.testing.assert_array_equal(f["mask"], example["mask"].numpy()[:, ::-1])
  np.testing.assert_array_equal(f["boxes"][1], [0, 0, 0, 0])
  again = augment.augment(example, tf.constant([5, 5]), max_shift=2, flip=True)
  np.testing.assert_array_equal(again["image"],
                                augment.augment(example, tf.constant([5, 5]), max_shift=2,
                                                flip=True)["image"])


def test_augment_runs_in_tf_data():
  ds = tf.data.Dataset.from_tensors(_example_with_box()).repeat(3).enumerate().map(
      lambda i, e: augment.augment(e, tf.stack([i, tf.constant(0, tf.int64)]), max_shift=2,
                                   flip=True))
  for e in ds:
    assert e["image"].shape == (32, 32, 1) and e["mask"].shape == (32, 32)


def test_each_layout_prepared_reads_back_the_examples_in_memory(data_dir, tmp_path):
  """tfpar.data prepare's path for every layout: the examples written one at a time (boxes
  with their own counts, 0 to 2 here, padded at read time; a set of 1 example in 2 shards)
  read back from the prepared set as the in-memory ImageSet holds them."""
  from tfpar.data import image_prepared  # pylint: disable=import-outside-toplevel
  for task, data, num_classes in (("classify", "folder", 2), ("classify", "classify.tfrecord", 2),
                                  ("detect", "coco/instances.json", 2),
                                  ("detect", "detect.tfrecord", 2), ("segment", "seg", 3),
                                  ("segment", "segment.tfrecord", 3)):
    spec, kw = tasks.spec(task), dict(image_size=8, channels=3, num_classes=num_classes)
    found = image_records.examples_of(str(data_dir / data), spec, **kw)
    out = str(tmp_path / data.replace("/", "_"))
    image_prepared.write_images(out, found, task, spec.labels, class_names=found.class_names)
    stream, memory = image_records.read_layout(out, spec, **kw), found.collect()
    assert isinstance(stream, image_prepared.ImageStream) and len(stream) == len(memory)
    assert stream.class_names == memory.class_names
    for i in range(len(memory)):
      got = next(iter(stream.read(tf.constant(i, tf.int64))))
      np.testing.assert_array_equal(got["image"], memory.images[i], err_msg=data)
      for name, array in (("label", memory.labels), ("boxes", memory.boxes),
                          ("classes", memory.classes), ("mask", memory.masks)):
        if array is not None:
          np.testing.assert_array_equal(got[name], array[i], err_msg=f"{data} {name} {i}")
          assert got[name].dtype == array.dtype, (data, name)
