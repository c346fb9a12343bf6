"""Prepared image sets: labelled images in fixed-width binary shards that training streams.

A prepared image set is one directory, published whole or not at all (as a
prepared text set, tfpar.data.prepare: written beside --out, the manifest last,
then renamed into place):

  examples-00000-of-00002.bin ...  one record per example, every record the same
                                   size: the image's pixels (uint8 [S, S, C], decoded
                                   and resized to --image_size as the in-memory
                                   readers do), then its labels (`label` int32; or
                                   `boxes` float32 [M, 4] pixels and `classes` int32
                                   [M]; or `mask` int32 [S, S]), little-endian.
  manifest.json                    format, task, the fields (name, dtype, shape),
                                   record bytes, example count, class names, and
                                   each shard with its example count, size and sha256.

Why decoded pixels and not the encoded PNG/JPEG: a fixed record size puts
example i one multiplication away, so a sample is one ranged read
(tf.data.FixedLengthRecordDataset, as for token windows) and the batches equal
the in-memory set's exactly; the cost is disk (S*S*C bytes an image).

`open_images` returns an `ImageStream`, which has the `len` and `take` of an
in-memory ImageSet (so tfpar.data.images.split holds out the same examples)
but reads nothing until tfpar.data.image_pipeline iterates it. A set that is
incomplete, truncated, corrupt (sha256, up to prepared.VERIFY_BYTES) or of
another task, image size, channel count or class count is refused with one
line naming the fix.
"""

import dataclasses
import hashlib
import json
import os
from typing import Optional, Tuple

import numpy as np

from tfpar import storage
from tfpar.data import prepare, prepared
from tfpar.data.corpus import DataError
from tfpar.data.images import ImageSet

FORMAT = "tfpar.prepared-images/1"


def shard_name(i: int, n: int) -> str:
  return f"examples-{i:05d}-of-{n:05d}.bin"


def _arrays(data: ImageSet) -> dict:
  """{field: array [N, ...]} in record order, little-endian."""
  fields = {"image": data.images.astype(np.uint8), "label": data.labels, "boxes": data.boxes,
            "classes": data.classes, "mask": data.masks}
  dtypes = {"image": "<u1", "label": "<i4", "boxes": "<f4", "classes": "<i4", "mask": "<i4"}
  return {k: np.ascontiguousarray(v, dtypes[k]) for k, v in fields.items() if v is not None}


def write_images(out: str, data: ImageSet, task: str, labels, *, num_shards: int = 2,
                 overwrite: bool = False) -> dict:
  """Writes `data` as a prepared image set of `task` at `out`, with the label fields `labels`
  (its spec's, tfpar.tasks.specs) beside each image; returns its manifest."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  arrays = _arrays(data)
  if tuple(k for k in arrays if k != "image") != tuple(labels):
    raise DataError(f"a {task} set has {', '.join(labels)} labels, not "
                    f"{', '.join(k for k in arrays if k != 'image')}")
  n = len(data)
  record = np.concatenate([a.reshape(n, -1).view(np.uint8) for a in arrays.values()], axis=1)
  tmp = prepare._begin(out, overwrite)  # pylint: disable=protected-access
  tf.io.gfile.rmtree(os.path.join(tmp, "parts"))
  num_shards, shards = max(min(num_shards, n), 1), []
  for i, rows in enumerate(np.array_split(record, num_shards)):
    name, raw = shard_name(i, num_shards), rows.tobytes()
    with tf.io.gfile.GFile(os.path.join(tmp, name), "wb") as f:
      f.write(raw)
    shards.append({"file": name, "examples": len(rows), "bytes": len(raw),
                   "sha256": hashlib.sha256(raw).hexdigest()})
  manifest = {"format": FORMAT, "task": task, "examples": n, "record_bytes": record.shape[1],
              "fields": [{"name": k, "dtype": a.dtype.str, "shape": list(a.shape[1:])}
                         for k, a in arrays.items()],
              "class_names": list(data.class_names), "shards": shards,
              "max_class_id": int(max((a.max(initial=-1) for k, a in arrays.items()
                                       if k != "image" and k != "boxes"), default=-1))}
  with tf.io.gfile.GFile(os.path.join(tmp, prepared.MANIFEST), "w") as f:
    f.write(json.dumps(manifest, indent=1))  # Last: a set without it is incomplete.
  prepare._publish(tmp, out)  # pylint: disable=protected-access
  return manifest


def is_image_set(directory: str) -> bool:
  """Whether `directory` is a prepared image set (its manifest says so)."""
  path = os.path.join(directory, prepared.MANIFEST)
  if not storage.exists(path):
    return False
  try:
    return json.loads(storage.read_text(path)).get("format") == FORMAT
  except (ValueError, AttributeError):
    return False


@dataclasses.dataclass(frozen=True)
class ImageStream:
  """The examples `index` (default: all) of a prepared image set, read on demand."""
  paths: Tuple[str, ...]
  counts: Tuple[int, ...]
  record_bytes: int
  fields: Tuple[Tuple[str, str, Tuple[int, ...]], ...]  # (name, dtype, shape)
  class_names: Tuple[str, ...] = ()
  index: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return sum(self.counts) if self.index is None else len(self.index)

  def take(self, index: np.ndarray) -> "ImageStream":
    """The examples at `index` of this one (a subset, in that order): no read."""
    mine = np.arange(len(self)) if self.index is None else self.index
    return dataclasses.replace(self, index=mine[np.asarray(index)])

  @property
  def image_shape(self) -> Tuple[int, ...]:
    return self.fields[0][2]

  def read(self, i):
    """A dataset of one element: example i's fields (a dict of tensors), by one ranged read."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    ends = np.cumsum(self.counts)
    record = i if self.index is None else tf.gather(tf.constant(self.index, tf.int64), i)
    shard = tf.searchsorted(tf.constant(ends, tf.int64), record[tf.newaxis], side="right")[0]
    first = tf.gather(tf.constant(ends - np.asarray(self.counts), tf.int64), shard)
    count = tf.gather(tf.constant(self.counts, tf.int64), shard)
    header = (record - first) * self.record_bytes
    footer = (count - (record - first) - 1) * self.record_bytes
    raw = tf.data.FixedLengthRecordDataset(tf.gather(tf.constant(self.paths), shard),
                                           self.record_bytes, header_bytes=header,
                                           footer_bytes=footer, buffer_size=0)
    return raw.map(self._decode)

  def _decode(self, raw):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    out, at = {}, 0
    for name, dtype, shape in self.fields:
      size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
      part = tf.strings.substr(raw, at, size)
      out[name] = tf.reshape(tf.io.decode_raw(part, tf.as_dtype(np.dtype(dtype).name),
                                              little_endian=True), shape)
      at += size
    return out


def _bad(directory: str, what: str) -> DataError:
  return DataError(f"the prepared image set {directory}: {what}: prepare it again with "
                   "--overwrite")


def open_images(directory: str, task: str, labels, *, image_size: int, channels: int,
                num_classes: int, verify_bytes: int = prepared.VERIFY_BYTES) -> ImageStream:
  """The checked set at `directory` for --task=`task` (whose label fields are `labels`) at
  these sizes (module docstring)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    manifest = json.loads(storage.read_text(os.path.join(directory, prepared.MANIFEST)))
    fields = tuple((f["name"], f["dtype"], tuple(f["shape"])) for f in manifest["fields"])
    shards, record_bytes = manifest["shards"], int(manifest["record_bytes"])
    names = [name for name, _, _ in fields]
  except (ValueError, KeyError, TypeError) as e:
    raise _bad(directory, f"{prepared.MANIFEST} is not a valid image manifest ({e})") from None
  if manifest.get("task") != task or names[1:] != list(labels):
    raise DataError(f"--data={directory} is a prepared {manifest.get('task')} set, not a {task} "
                    f"set: pass --task={manifest.get('task')} or prepare the {task} data")
  shape = (image_size, image_size, channels)
  if fields[0][2] != shape:
    raise DataError(f"--data={directory} holds images of {'x'.join(map(str, fields[0][2]))}, "
                    f"not --image_size={image_size} x --num_channels={channels}: pass those "
                    "flags or prepare the images again at these")
  total = sum(s["bytes"] for s in shards)
  for s in shards:
    path = os.path.join(directory, s["file"])
    if not storage.exists(path):
      raise _bad(directory, f"its shard {s['file']} is missing")
    size = tf.io.gfile.stat(path).length
    if size != s["bytes"] or size != s["examples"] * record_bytes:
      raise _bad(directory, f"its shard {s['file']} is truncated or altered ({size:,} bytes; "
                 f"its manifest says {s['bytes']:,})")
    if total <= verify_bytes and prepared.sha256_of(path) != s["sha256"]:
      raise _bad(directory, f"its shard {s['file']} is corrupt (its sha256 is not the manifest's)")
  stream = ImageStream(paths=tuple(os.path.join(directory, s["file"]) for s in shards),
                       counts=tuple(int(s["examples"]) for s in shards),
                       record_bytes=record_bytes, fields=fields,
                       class_names=tuple(manifest.get("class_names", ())))
  largest = manifest.get("max_class_id", -1)
  if largest >= num_classes:
    raise DataError(f"--data={directory} has class id {largest}; --num_classes={num_classes} "
                    f"holds ids 0..{num_classes - 1}: pass --num_classes={largest + 1} or more")
  return stream
