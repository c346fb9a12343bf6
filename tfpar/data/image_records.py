"""TFRecord shards of labelled images: the `tf.train.Example` features tfpar reads.

One Example per image, with the feature names of the TensorFlow Object
Detection API and DeepLab, so existing converters' output reads as is:

| feature | type | task |
|---|---|---|
| `image/encoded` | bytes: PNG or JPEG | all |
| `image/class/label` | int64: class id 0..C-1 | classify |
| `image/object/bbox/ymin`, `.../xmin`, `.../ymax`, `.../xmax` | float lists, in [0, 1] of the image's height and width | detect |
| `image/object/class/label` | int64 list: class id 0..C-1 of each box | detect |
| `image/segmentation/class/encoded` | bytes: PNG of class ids (0 background), the image's size | segment |

`classify_example`, `detect_example` and `segment_example` build them;
`tfrecords` reads shards (a list of files) as `Examples`, one record at a time,
with the labels' `Format` (CLASSES, BOXES, MASKS) that the task's spec names;
`examples_of` reads --data with these or the spec's own readers (tfpar.data.images),
and `read_layout` collects them into the `ImageSet` training holds.
"""

import dataclasses
import itertools
from typing import Callable, Sequence

import numpy as np

from tfpar.console import count
from tfpar.data.corpus import TFRECORD_SUFFIXES, DataError
from tfpar.data.images import Examples, check_num_classes, decode_mask
from tfpar.data.images import iter_decoded, resize_mask

BOX_KEYS = tuple(f"image/object/bbox/{k}" for k in ("ymin", "xmin", "ymax", "xmax"))


def _bytes(value):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _ints(values):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def _floats(values):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.train.Feature(float_list=tf.train.FloatList(value=[float(v) for v in values]))


def _example(features):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.train.Example(features=tf.train.Features(feature=features))


def classify_example(encoded: bytes, label: int):
  """An image (PNG/JPEG bytes) and its class id."""
  return _example({"image/encoded": _bytes(encoded), "image/class/label": _ints([label])})


def detect_example(encoded: bytes, boxes: np.ndarray, classes: Sequence[int]):
  """An image and its boxes [m, 4] (ymin, xmin, ymax, xmax) in [0, 1], with class ids [m]."""
  boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
  features = {"image/encoded": _bytes(encoded), "image/object/class/label": _ints(classes)}
  features.update({key: _floats(boxes[:, k]) for k, key in enumerate(BOX_KEYS)})
  return _example(features)


def segment_example(encoded: bytes, mask_png: bytes):
  """An image and the PNG of its per-pixel class ids."""
  return _example({"image/encoded": _bytes(encoded),
                   "image/segmentation/class/encoded": _bytes(mask_png)})


def _class_features(tf):
  return {"image/class/label": tf.io.FixedLenFeature([], tf.int64)}


def _box_features(tf):
  spec = {k: tf.io.VarLenFeature(tf.float32) for k in BOX_KEYS}
  spec["image/object/class/label"] = tf.io.VarLenFeature(tf.int64)
  return spec


def _mask_features(tf):
  return {"image/segmentation/class/encoded": tf.io.FixedLenFeature([], tf.string)}


def _class_labels(record, name, size, *, image_size, num_classes) -> dict:
  del size, image_size
  label = int(record["image/class/label"])
  if label < 0:
    raise DataError(f"{name} has a negative class id: fix the labels")
  check_num_classes(label, num_classes, name, "class id")
  return {"label": label}


def _box_labels(record, name, size, *, image_size, num_classes) -> dict:
  del size
  b = np.stack([record[k] for k in BOX_KEYS], -1).astype(np.float32)  # [m, 4] in [0, 1]
  c = record["image/object/class/label"].astype(np.int32)
  if len(b) != len(c):
    raise DataError(f"{name} has {count(len(b), 'box', 'boxes')} but "
                    f"{count(len(c), 'class label')}: give each box one")
  if len(b) and (b.min() < 0 or b.max() > 1 or (b[:, 2:] <= b[:, :2]).any()):
    raise DataError(f"{name} has a box outside [0, 1] or with max <= min: boxes are "
                    "(ymin, xmin, ymax, xmax) as fractions of the image's size")
  if len(c):
    check_num_classes(int(c.max()), num_classes, name, "class id")
  return {"boxes": b * image_size, "classes": c}


def _mask_labels(record, name, size, *, image_size, num_classes) -> dict:
  h, w = size
  mask = decode_mask(record["image/segmentation/class/encoded"], f"{name} mask")
  if mask.shape != (h, w):
    raise DataError(f"{name}: mask is {mask.shape[1]}x{mask.shape[0]} but its image is "
                    f"{w}x{h}: masks must match their images")
  check_num_classes(int(mask.max()), num_classes, f"{name} mask", "class id")
  return {"mask": resize_mask(mask, image_size)}


@dataclasses.dataclass(frozen=True)
class Format:
  """One kind of label in an Example; a task's spec (tfpar.tasks.specs) names its own."""
  task: str  # The --task that reads it, for messages.
  features: Callable  # tf -> the label's feature spec (beside image/encoded).
  labels: Callable  # (record, name, [h, w], *, image_size, num_classes) -> an example's labels


CLASSES = Format("classify", _class_features, _class_labels)
BOXES = Format("detect", _box_features, _box_labels)
MASKS = Format("segment", _mask_features, _mask_labels)


def tfrecords(files: Sequence[str], labels: Format, *, image_size: int, channels: int,
              num_classes: int) -> Examples:
  """Every Example of `files` with `labels` (CLASSES, BOXES or MASKS), parsed and decoded as
  they are iterated."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  spec = {"image/encoded": tf.io.FixedLenFeature([], tf.string), **labels.features(tf)}

  def records():
    for path in files:
      try:
        for i, record in enumerate(tf.data.TFRecordDataset(path).as_numpy_iterator()):
          try:
            parsed = tf.io.parse_single_example(record, spec)
          except tf.errors.InvalidArgumentError:
            raise DataError(f"{path}: record {i} lacks the {labels.task} features "
                            f"({', '.join(spec)}): see tfpar/data/image_records.py") from None
          parsed = {k: tf.sparse.to_dense(v).numpy() if isinstance(v, tf.SparseTensor)
                    else v.numpy() for k, v in parsed.items()}
          name = f"{path} record {i}"
          yield parsed.pop("image/encoded"), name, (name, parsed)
      except tf.errors.DataLossError:
        raise DataError(f"{path} is not a valid TFRecord file: check the file") from None

  def iterate():
    decoded = iter_decoded(records(), image_size, channels, are_files=False)
    first = next(decoded, None)
    if first is None:
      raise DataError(f"the TFRecord shards {', '.join(files)} hold no records: write some first")
    for image, size, (name, record) in itertools.chain([first], decoded):
      yield {"image": image, **labels.labels(record, name, size, image_size=image_size,
                                             num_classes=num_classes)}
  return Examples(iterate)


def examples_of(data: str, spec, **kwargs):
  """--data in the layout of a task's spec (tfpar.tasks.specs.VisionSpec), as `Examples`: a
  directory, TFRecord shards, or the one file its layout has (a COCO JSON); a prepared image
  set is opened as an ImageStream (tfpar.data.image_prepared), which training streams."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data import image_prepared  # pylint: disable=import-outside-toplevel
  if tf.io.gfile.isdir(data) and image_prepared.is_image_set(data):
    return image_prepared.open_images(data, spec.name, spec.labels, **kwargs)  # Streamed, not read.
  if tf.io.gfile.isdir(data):
    return spec.read_directory(data, **kwargs)
  files = sorted(tf.io.gfile.glob(data))
  if not files:
    raise DataError(f"--data={data} matches no file or directory: pass an image folder, "
                    "a COCO JSON or TFRecord shards")
  if all(f.endswith(TFRECORD_SUFFIXES) for f in files):
    return tfrecords(files, spec.records(), **kwargs)
  found = spec.read_file(files[0], **kwargs) if len(files) == 1 else None
  if found is not None:
    return found
  raise DataError(f"--data={data} is not {spec.layout} or TFRecord shards (*.tfrecord): "
                  f"see tfpar/data/images.py for the layouts --task={spec.name} reads")


def read_layout(data: str, spec, **kwargs):
  """examples_of(data, spec) in memory: an ImageSet, or a prepared set's ImageStream."""
  found = examples_of(data, spec, **kwargs)
  return found.collect() if isinstance(found, Examples) else found
