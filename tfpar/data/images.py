"""Labelled images in memory, and the readers for what users bring.

Every reader returns `Examples`: images resized to `image_size` square, with
the labels of one task (classify: `label`; detect: `boxes` + `classes`;
segment: `mask`), read and decoded `CHUNK` at a time as they are iterated.
Files are read through tf.io.gfile and decoded in tf.data (so gs:// works).
Training collects them into an `ImageSet` held in memory, which makes the data
order a pure function of (seed, step) like the text pipeline's, and lets every
label be checked once before training starts; `python -m tfpar.data prepare`
writes them to disk as they come (tfpar.data.image_prepared), so preparing
holds a chunk of images, not the set.

| --data | task | layout |
|---|---|---|
| a directory of class directories | classify | `DIR/<class>/*.png|jpg|...`; classes are the sorted directory names |
| a COCO instances `*.json` | detect | `images`, `annotations` (`bbox` = [x, y, width, height] in pixels), `categories`; `file_name` relative to the JSON's directory |
| a directory with `images/` and `masks/` | segment | `images/NAME.png|jpg` with `masks/NAME.png`; a mask pixel is its class id (0 background; palette PNGs read by index) |
| TFRecord shards | any | see `tfpar.data.image_records` |
| a prepared image set (`python -m tfpar.data prepare --task=...`) | its task | streamed, not read into memory: `tfpar.data.image_prepared` |

Bad data (an empty or unreadable folder, a class id outside --num_classes, a
COCO box outside its image, a COCO entry without a field tfpar reads or with
one of another type, a COCO file without categories or annotations) raises
`DataError` naming the file (and the entry and field) and the fix.
"""

import dataclasses
import functools
import io
import itertools
import json
import math
import os
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from tfpar.console import count
from tfpar.data.corpus import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
CHUNK = 64  # Images decoded at once while streaming: memory is a chunk, whatever the set.


@dataclasses.dataclass(frozen=True)
class ImageSet:
  """N labelled images of one task.

  Attributes:
    images: [N, S, S, channels] uint8.
    labels: classify: [N] int32 class ids.
    boxes: detect: [N, M, 4] float32 pixels (ymin, xmin, ymax, xmax), zeros where padded.
    classes: detect: [N, M] int32 class ids, -1 where padded.
    masks: segment: [N, S, S] int32, each pixel's class id (0 background).
    class_names: names of the classes, in id order, when the source has them.
    source_ids: [N] or [N, M] where the examples came from (digit canvases: scan ids).
  """
  images: np.ndarray
  labels: Optional[np.ndarray] = None
  boxes: Optional[np.ndarray] = None
  classes: Optional[np.ndarray] = None
  masks: Optional[np.ndarray] = None
  class_names: Tuple[str, ...] = ()
  source_ids: Optional[np.ndarray] = None

  def __len__(self):
    return len(self.images)

  @property
  def image_shape(self) -> Tuple[int, ...]:
    return tuple(self.images.shape[1:])

  def take(self, index: np.ndarray) -> "ImageSet":
    """The examples at `index` (a subset, in that order)."""
    pick = lambda a: None if a is None else a[index]
    return dataclasses.replace(self, images=self.images[index], labels=pick(self.labels),
                               boxes=pick(self.boxes), classes=pick(self.classes),
                               masks=pick(self.masks), source_ids=pick(self.source_ids))


@dataclasses.dataclass(frozen=True)
class Examples:
  """A layout's labelled images, read and decoded as they are iterated (CHUNK at a time).

  Each example is a dict: `image` uint8 [S, S, C] and its task's labels (`label` an int;
  or `boxes` float32 [m, 4] pixels and `classes` int32 [m], m of this image's own; or
  `mask` int32 [S, S]). A reader checks its listing and whole-file facts when called, and
  each example's own (decodable, sizes, class ids) when the iteration reaches it.
  """
  iterate: Callable[[], Iterator[dict]]
  class_names: Tuple[str, ...] = ()

  def __iter__(self) -> Iterator[dict]:
    return self.iterate()

  @staticmethod
  def of(data: ImageSet) -> "Examples":
    """An ImageSet's examples (detection's rows as padded in the set)."""
    fields = {"label": data.labels, "boxes": data.boxes, "classes": data.classes,
              "mask": data.masks}
    fields = {k: v for k, v in fields.items() if v is not None}
    return Examples(lambda: ({"image": data.images[i], **{k: v[i] for k, v in fields.items()}}
                             for i in range(len(data))), data.class_names)

  def collect(self) -> ImageSet:
    """Every example in memory, as the ImageSet training reads (boxes padded to the most)."""
    examples = list(self)
    labels = {}
    if "label" in examples[0]:
      labels["labels"] = np.array([e["label"] for e in examples], np.int32)
    if "boxes" in examples[0]:
      labels["boxes"], labels["classes"] = pad_boxes([e["boxes"] for e in examples],
                                                     [e["classes"] for e in examples])
    if "mask" in examples[0]:
      labels["masks"] = np.stack([e["mask"] for e in examples])
    return ImageSet(np.stack([e["image"] for e in examples]), class_names=self.class_names,
                    **labels)


def split(data: ImageSet, eval_fraction: float, seed: int) -> Tuple[ImageSet, ImageSet]:
  """(train, held_out) by a permutation drawn from `seed`."""
  order = np.random.default_rng(seed).permutation(len(data))
  n_eval = max(1, int(round(len(data) * eval_fraction)))
  if n_eval >= len(data):
    raise DataError(f"holding out {n_eval} of {count(len(data), 'example')} leaves none for "
                    "training: bring more data or lower --eval_fraction")
  return data.take(np.sort(order[n_eval:])), data.take(np.sort(order[:n_eval]))


@functools.lru_cache(maxsize=None)
def _decoder(image_size: int, channels: int, are_files: bool):
  """A tf.function: sources [n] -> (images uint8 [n, S, S, C], original [h, w] each [n, 2]).

  Traced once per (size, channels, kind) and called for every chunk: a new tf.data
  pipeline per chunk would trace its function again each time, and the traces stay.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  def load(source):
    image = _decode(source, channels, are_files)
    size = tf.shape(image)[:2]
    image = tf.image.resize(image, [image_size, image_size], antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), size

  out = (tf.TensorSpec([image_size, image_size, channels], tf.uint8), tf.TensorSpec([2], tf.int32))
  return tf.function(lambda sources: tf.map_fn(load, sources, fn_output_signature=out,
                                               parallel_iterations=16),
                     input_signature=[tf.TensorSpec([None], tf.string)])


def _decode(source, channels: int, are_files: bool):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  data = tf.io.read_file(source) if are_files else source
  return tf.io.decode_image(data, channels=channels, expand_animations=False)


def decode_images(sources: Sequence, image_size: int, channels: int, *, names: Sequence[str] = (),
                  are_files: bool = True) -> Tuple[np.ndarray, np.ndarray]:
  """Decodes and resizes images, CHUNK at a time; returns (images uint8, original [h, w] each).

  Args:
    sources: file paths (`are_files`) or the encoded bytes themselves.
    names: what to call each source in an error (default: the paths).
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  names, decoder, parts = list(names) or list(sources), _decoder(image_size, channels, are_files), []
  for at in range(0, len(sources), CHUNK):
    chunk = list(sources[at:at + CHUNK])
    try:
      parts.append([t.numpy() for t in decoder(tf.constant(chunk))])
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError):
      for source, name in zip(chunk, names[at:at + CHUNK]):  # Find the bad one to name it.
        try:
          _decode(tf.constant(source), channels, are_files)
        except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError) as e:
          raise _unreadable(source, name, channels, are_files, e) from None
      raise
  return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def iter_decoded(items: Iterable[tuple], image_size: int, channels: int, *,
                 are_files: bool = True) -> Iterator[tuple]:
  """decode_images over `items` (source, name, payload), CHUNK at a time: yields
  (image, original [h, w], payload) in order, holding one chunk."""
  items = iter(items)
  while True:
    chunk = list(itertools.islice(items, CHUNK))
    if not chunk:
      return
    pixels, sizes = decode_images([c[0] for c in chunk], image_size, channels,
                                  names=[c[1] for c in chunk], are_files=are_files)
    yield from zip(pixels, sizes, (c[2] for c in chunk))


def _unreadable(source, name: str, channels: int, are_files: bool, error) -> DataError:
  """Blames the image, or --num_channels where the image decodes to its own channels.

  A JPEG has no alpha channel: under --num_channels=4 a good JPEG fails, and
  the fix is the flag, not the file.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    data = tf.io.read_file(source) if are_files else source
    tf.io.decode_image(data, expand_animations=False)
  except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError):
    return DataError(f"{name} is not a readable image: remove or replace it "
                     "(PNG, JPEG, BMP or GIF)")
  why = error.message.split("}}")[-1].split("[Op:")[0].strip()  # TF's own reason, unwrapped.
  return DataError(f"{name} cannot be decoded to --num_channels={channels} ({why}): train "
                   "with --num_channels=3 (RGB) or 1 (greyscale), or convert it to PNG")


def _is_image(name: str) -> bool:
  return name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith(".")


def check_num_classes(found: int, num_classes: int, where: str, what: str) -> None:
  """A class id >= num_classes cannot be trained on: name where it is and the fix."""
  if found >= num_classes:
    raise DataError(f"{where} has {what} {found}, outside --num_classes={num_classes} "
                    f"(ids 0..{num_classes - 1}): pass --num_classes={found + 1} or fix the labels")


def image_folder(path: str, *, image_size: int, channels: int, num_classes: int) -> Examples:
  """Classification: one sub-directory per class, in sorted order, each with its images."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  fix = f"put each class's images in {path}/<class_name>/ (PNG or JPEG)"
  if not tf.io.gfile.isdir(path):
    raise DataError(f"--data={path} is not a directory: {fix}")
  try:
    names = sorted(n.rstrip("/") for n in tf.io.gfile.listdir(path))
  except tf.errors.OpError as e:
    raise DataError(f"--data={path} cannot be listed ({e.message}): check its permissions") from None
  classes = [n for n in names if not n.startswith(".") and tf.io.gfile.isdir(os.path.join(path, n))]
  paths, labels = [], []
  for label, name in enumerate(classes):
    directory = os.path.join(path, name)
    try:
      files = sorted(f for f in tf.io.gfile.listdir(directory) if _is_image(f))
    except tf.errors.OpError as e:
      raise DataError(f"{directory} cannot be listed ({e.message}): check its permissions") from None
    paths += [os.path.join(directory, f) for f in files]
    labels += [label] * len(files)
  if not paths:
    raise DataError(f"--data={path} holds no images in class sub-directories: {fix}")
  check_num_classes(len(classes) - 1, num_classes, f"--data={path} ({len(classes)} class "
                    "directories)", "class id")
  def iterate():
    for image, _, label in iter_decoded(zip(paths, paths, labels), image_size, channels):
      yield {"image": image, "label": label}
  return Examples(iterate, tuple(classes))


def _entry(kind: str, i: int, entry) -> str:
  """'annotation 3 (id 17)': an entry's place in its list, and its id where it has one."""
  ident = entry.get("id") if isinstance(entry, dict) else None
  return f"{kind} {i}" + (f" (id {ident})" if ident is not None else "")


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_size(value) -> bool:
  """A pixel count: a positive whole number (some converters write 640.0)."""
  return _is_number(value) and value > 0 and float(value).is_integer()


def _is_bbox(value) -> bool:
  return isinstance(value, (list, tuple)) and len(value) == 4 and all(map(_is_number, value))


def _is_id(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


# COCO fields tfpar reads: (the test a value must pass, what it must be, for the message).
_COCO_FIELDS = {
    "id": (_is_id, "an integer id"),
    "file_name": (lambda v: isinstance(v, str) and bool(v), "the image's path, relative to "
                  "the JSON's directory"),
    "width": (_is_size, "the image's width in pixels, a positive integer"),
    "height": (_is_size, "the image's height in pixels, a positive integer"),
    "image_id": (_is_id, "the id of its image in 'images'"),
    "category_id": (_is_id, "the id of its category in 'categories'"),
    "bbox": (_is_bbox, "[x, y, width, height] in pixels (4 numbers)"),
}


# What each kind of entry must have (a crowd annotation only its image_id: it is skipped).
_COCO_REQUIRED = {"image": ("id", "file_name", "width", "height"), "category": ("id",),
                  "annotation": ("image_id", "category_id", "bbox")}


def _coco_fields(json_path: str, kind: str, i: int, entry,
                 keys: Optional[Sequence[str]] = None) -> None:
  """Each field of `keys` (default: all a `kind` needs) is there and of its type, else DataError.

  Checked before any is used, so a bad file fails on its first bad field with
  the file, the entry and the field named, not with a KeyError or ValueError.
  """
  if not isinstance(entry, dict):
    raise DataError(f"{json_path}: {kind} {i} is {entry!r:.40}, not an object: make it one "
                    f"with the fields {', '.join(_COCO_REQUIRED[kind])}")
  for key in keys or _COCO_REQUIRED[kind]:
    test, meaning = _COCO_FIELDS[key]
    if key not in entry:
      raise DataError(f"{json_path}: {_entry(kind, i, entry)} has no '{key}': add {meaning}")
    if not test(entry[key]):
      raise DataError(f"{json_path}: {_entry(kind, i, entry)} has {key} {entry[key]!r:.40}, "
                      f"not {meaning}: fix it")


def _load_coco(json_path: str) -> dict:
  """The JSON, with its three lists present, non-empty, and every field tfpar reads checked."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    with tf.io.gfile.GFile(json_path) as f:
      coco = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f"{json_path} is not COCO JSON ({e}): pass a COCO instances file") from None
  if not isinstance(coco, dict) or not {"images", "annotations", "categories"} <= set(coco):
    raise DataError(f"{json_path} lacks 'images', 'annotations' or 'categories': "
                    "pass a COCO instances file")
  needs = {"images": "the images to train on", "categories": "one per class of the boxes",
           "annotations": "boxes (a detector learns nothing without them)"}
  for key, what in needs.items():
    if not isinstance(coco[key], list):
      raise DataError(f"{json_path}: '{key}' is {type(coco[key]).__name__}, not a list: "
                      "pass a COCO instances file")
    if not coco[key]:
      raise DataError(f"{json_path} lists no {key}: add {what}, or pass another file")
  for kind, key in (("image", "images"), ("category", "categories"), ("annotation", "annotations")):
    for i, entry in enumerate(coco[key]):
      crowd = isinstance(entry, dict) and entry.get("iscrowd", 0)
      _coco_fields(json_path, kind, i, entry, ("image_id",) if crowd else None)
  return coco


def coco_json(json_path: str, *, image_size: int, channels: int, num_classes: int,
              image_dir: Optional[str] = None) -> Examples:
  """Detection: a COCO instances JSON and its images (`file_name` relative to `image_dir`).

  Categories are numbered 0..K-1 in order of their COCO id; crowd annotations
  are skipped; boxes are scaled with their image to `image_size` square.
  """
  coco = _load_coco(json_path)
  image_dir = image_dir or os.path.dirname(json_path)
  category_ids = sorted(c["id"] for c in coco["categories"])
  index = {cid: i for i, cid in enumerate(category_ids)}
  check_num_classes(len(category_ids) - 1, num_classes,
                    f"{json_path} ({len(category_ids)} categories)", "category index")
  images = sorted(coco["images"], key=lambda im: im["id"])
  per_image = {im["id"]: [] for im in images}
  by_id = {im["id"]: im for im in images}
  for i, ann in enumerate(coco["annotations"]):
    image = by_id.get(ann["image_id"])
    if image is None:
      raise DataError(f"{json_path}: {_entry('annotation', i, ann)} names image_id "
                      f"{ann['image_id']}, which is not in 'images': fix the file")
    if ann.get("iscrowd", 0):
      continue
    if ann["category_id"] not in index:
      raise DataError(f"{json_path}: {_entry('annotation', i, ann)} has category_id "
                      f"{ann['category_id']}, which is not in 'categories': fix the file")
    x, y, w, h = (float(v) for v in ann["bbox"])
    width, height = image["width"], image["height"]
    if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > width + 0.5 or y + h > height + 0.5:
      raise DataError(f"{json_path}: {_entry('annotation', i, ann)} of {image['file_name']} has "
                      f"bbox [{x:g}, {y:g}, {w:g}, {h:g}] outside its {width:g}x{height:g} image: "
                      "fix the box (COCO bbox is [x, y, width, height] in pixels)")
    sy, sx = image_size / height, image_size / width
    per_image[image["id"]].append(((y * sy, x * sx, (y + h) * sy, (x + w) * sx),
                                   index[ann["category_id"]]))
  if not any(per_image.values()):
    raise DataError(f"{json_path} has no annotations but crowd regions (iscrowd=1), which "
                    "detection skips: add boxes of single objects")
  paths = [os.path.join(image_dir, im["file_name"]) for im in images]
  names = {c["id"]: c.get("name", str(c["id"])) for c in coco["categories"]}

  def iterate():
    for pixels, (h, w), (path, im) in iter_decoded(zip(paths, paths, zip(paths, images)),
                                                   image_size, channels):
      if (h, w) != (im["height"], im["width"]):
        raise DataError(f"{path} is {w}x{h} but {json_path} says {im['width']:g}x"
                        f"{im['height']:g}: fix the image's width and height in the JSON")
      found = per_image[im["id"]]
      yield {"image": pixels, "boxes": np.array([b for b, _ in found], np.float32).reshape(-1, 4),
             "classes": np.array([c for _, c in found], np.int32)}
  return Examples(iterate, tuple(str(names[c]) for c in category_ids))


def decode_mask(data: bytes, where: str) -> np.ndarray:
  """A PNG mask -> [h, w] class ids (a palette PNG gives its indices, not its colours)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  try:
    image = Image.open(io.BytesIO(data))
    image.load()
  except Exception:  # pylint: disable=broad-except  # PIL raises several kinds for bad files.
    raise DataError(f"{where} is not a readable PNG mask: replace it") from None
  if image.mode not in ("P", "L", "I", "I;16", "1"):
    raise DataError(f"{where} is a {image.mode} image, not a mask of class ids: save it as a "
                    "single-channel or palette PNG whose pixel values are class ids")
  return np.asarray(image, np.int32)


def resize_mask(mask: np.ndarray, image_size: int) -> np.ndarray:
  """Nearest-neighbour resize of a label map (labels are never blended)."""
  h, w = mask.shape
  rows = (np.arange(image_size) * h // image_size)
  cols = (np.arange(image_size) * w // image_size)
  return mask[rows][:, cols]


def mask_pairs(path: str, *, image_size: int, channels: int, num_classes: int) -> Examples:
  """Segmentation: `path/images/NAME.*` with `path/masks/NAME.png` (pixel = class id)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  image_dir, mask_dir = os.path.join(path, "images"), os.path.join(path, "masks")
  fix = f"put images in {image_dir}/ and a PNG of class ids per image in {mask_dir}/ (same name)"
  if not (tf.io.gfile.isdir(image_dir) and tf.io.gfile.isdir(mask_dir)):
    raise DataError(f"--data={path} has no images/ and masks/ directories: {fix}")
  names = sorted(f for f in tf.io.gfile.listdir(image_dir) if _is_image(f))
  if not names:
    raise DataError(f"{image_dir} holds no images: {fix}")
  mask_paths = [os.path.join(mask_dir, os.path.splitext(name)[0] + ".png") for name in names]
  for name, mask_path in zip(names, mask_paths):
    if not tf.io.gfile.exists(mask_path):
      raise DataError(f"{os.path.join(image_dir, name)} has no mask {mask_path}: {fix}")
  image_paths = [os.path.join(image_dir, n) for n in names]

  def iterate():
    pairs = zip(image_paths, image_paths, zip(names, mask_paths))
    for image, (h, w), (name, mask_path) in iter_decoded(pairs, image_size, channels):
      with tf.io.gfile.GFile(mask_path, "rb") as f:
        mask = decode_mask(f.read(), mask_path)
      check_num_classes(int(mask.max()), num_classes, mask_path, "class id")
      if mask.shape != (h, w):
        raise DataError(f"{os.path.join(mask_dir, name)}: mask is {mask.shape[1]}x"
                        f"{mask.shape[0]} but its image is {w}x{h}: masks must match their images")
      yield {"image": image, "mask": resize_mask(mask, image_size)}
  return Examples(iterate)


def pad_boxes(boxes: List[np.ndarray], classes: List[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
  """Lists of per-image [m, 4] boxes and [m] classes -> [N, M, 4] and [N, M] (-1 padded)."""
  m = max(1, max((len(c) for c in classes), default=0))
  out_boxes = np.zeros((len(boxes), m, 4), np.float32)
  out_classes = np.full((len(boxes), m), -1, np.int32)
  for n, (b, c) in enumerate(zip(boxes, classes)):
    out_boxes[n, :len(c)], out_classes[n, :len(c)] = np.reshape(b, (-1, 4)), c
  return out_boxes, out_classes
