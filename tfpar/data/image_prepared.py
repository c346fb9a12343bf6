"""Prepared image sets: labelled images, encoded, in binary shards that training streams.

A prepared image set is one directory, published whole or not at all (as a
prepared text set, tfpar.data.prepare: written beside --out, the manifest last,
then renamed into place):

  examples-00000-of-00002.bin ...  the records, example i in shard i mod N (round
                                   robin, so a shard is written as examples come, with
                                   no count known ahead). A record is its fields in
                                   manifest order, each a little-endian uint32 byte
                                   length then the bytes: `image` a PNG of the pixels
                                   (uint8 [S, S, C], decoded and resized to --image_size
                                   as the in-memory readers do); then `label` int32, or
                                   `boxes` float32 [m, 4] pixels and `classes` int32 [m]
                                   (m the image's own), or `mask` a 16-bit PNG of class ids.
  index.bin                        uint64 (offset in its shard, length) of each record.
  manifest.json                    format, task, the fields (name, dtype, decoded shape,
                                   encoding, the padding of boxes and classes), example
                                   count, class names, largest class id, and each shard
                                   and the index with its size and sha256.

`write_images` writes the examples of a reader (tfpar.data.images.Examples) as
they come, a chunk (tfpar.data.images.CHUNK) at a time: it holds one chunk of
examples and their records, whatever the set's size. Each PNG field of a chunk
is encoded by one call, its images in parallel on TensorFlow's threads; a PNG
depends on its own pixels only, so the bytes do not depend on the chunking. Why a PNG of the decoded pixels and not the source's
PNG/JPEG bytes: PNG is lossless, so a decoded record is the in-memory set's
image bit for bit, and training decodes the size it trains on (no resize at
read time); the pixels are decoded once, at prepare. Why an index and not
fixed-size records: encoded images differ in size; with (offset, length) per
example a sample is still one ranged read (tf.data.FixedLengthRecordDataset,
header and footer the rest of its shard). Boxes are padded at read time to the
set's most boxes (the manifest's shape), as the in-memory set pads them.

`open_images` returns an `ImageStream`, which has the `len` and `take` of an
in-memory ImageSet (so tfpar.data.images.split holds out the same examples)
but reads nothing until tfpar.data.image_pipeline iterates it; it holds the
index (16 bytes an example). A set that is incomplete, truncated, corrupt
(sha256, up to prepared.VERIFY_BYTES), of the older decoded format, or of
another task, image size, channel count or class count is refused with one
line naming the fix.
"""

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import struct
from typing import Iterable, Iterator, Optional, Tuple

import numpy as np

from tfpar import storage
from tfpar.data import images, prepare, prepared
from tfpar.data.corpus import DataError

FORMAT = "tfpar.prepared-images/2"
DECODED = "tfpar.prepared-images/1"  # The older format: fixed-size records of decoded pixels.
INDEX = "index.bin"
MAX_MASK_ID = 65535  # A mask is stored as a 16-bit PNG.
PARALLEL_PNGS = 16  # PNGs of a chunk encoded at once (tf.map_fn parallel_iterations).


def shard_name(i: int, n: int) -> str:
  return f"examples-{i:05d}-of-{n:05d}.bin"


@dataclasses.dataclass(frozen=True)
class Field:
  """One field of a record: its name, decoded dtype and shape, how it is stored."""
  name: str
  dtype: str
  shape: Tuple[int, ...]
  encoding: str = "raw"  # "png": a PNG (8-bit for uint8 fields, else 16-bit); "raw": the bytes.
  pad: Optional[float] = None  # Rows [m, ...] padded to shape[0] with this at read time.


def _fields(size: Tuple[int, ...], labels, rows: int) -> Tuple[Field, ...]:
  """The fields of a set of images of `size` with the label fields `labels`, boxes padded
  to `rows`."""
  kinds = {"image": Field("image", "|u1", tuple(size), "png"),
           "label": Field("label", "<i4", ()),
           "boxes": Field("boxes", "<f4", (rows, 4), pad=0.0),
           "classes": Field("classes", "<i4", (rows,), pad=-1),
           "mask": Field("mask", "<i4", tuple(size[:2]), "png")}
  return tuple(kinds[name] for name in ("image", *labels))


def _png_value(field: Field, value) -> np.ndarray:
  """A PNG field's pixels as encode_png takes them: [h, w, channels], uint8 or uint16."""
  value = np.asarray(value)
  if field.dtype != "|u1":
    if value.min(initial=0) < 0 or value.max(initial=0) > MAX_MASK_ID:
      raise DataError(f"a mask holds class id {int(value.max())}, past the {MAX_MASK_ID} a "
                      "prepared set stores: train on it in memory (--data as it is)")
    value = value.astype(np.uint16)
  return value.reshape(*value.shape[:2], -1)


@functools.lru_cache(maxsize=None)
def _png_encoder(shape: Tuple[int, ...], dtype: str):
  """A tf.function: pixels [n, *shape] of `dtype` -> their n PNGs, encoded by tf.map_fn's
  parallel iterations (TensorFlow's inter-op threads, outside the GIL). Traced once per
  field and called for every chunk, as tfpar.data.images decodes."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.function(lambda pixels: tf.map_fn(tf.io.encode_png, pixels,
                                              fn_output_signature=tf.string,
                                              parallel_iterations=PARALLEL_PNGS),
                     input_signature=[tf.TensorSpec([None, *shape], tf.as_dtype(dtype))])


def _records(fields: Tuple[Field, ...], chunk: list) -> list:
  """The records of a chunk of examples (module docstring), each PNG field of the chunk
  encoded in one call. A PNG does not depend on its neighbours: the bytes are those of
  encoding each image alone."""
  columns = []
  for f in fields:
    if f.encoding == "png":
      pixels = np.stack([_png_value(f, example[f.name]) for example in chunk])
      columns.append(_png_encoder(pixels.shape[1:], pixels.dtype.name)(pixels).numpy())
    else:
      columns.append([np.ascontiguousarray(e[f.name], f.dtype).tobytes() for e in chunk])
  return [b"".join(struct.pack("<I", len(p)) + p for p in parts) for parts in zip(*columns)]


class _Shards:
  """The shard files of a set being written, each opened when its first record comes."""

  def __init__(self, directory: str, num_shards: int):
    self.directory, self.n = directory, num_shards
    self.files, self.digests = {}, {}
    self.sizes, self.counts = [0] * num_shards, [0] * num_shards

  def write(self, i: int, record: bytes) -> int:
    """Writes example i's record; returns its offset in its shard."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    s = i % self.n
    if s not in self.files:
      self.files[s] = tf.io.gfile.GFile(os.path.join(self.directory, shard_name(s, self.n)), "wb")
      self.digests[s] = hashlib.sha256()
    self.files[s].write(record)
    self.digests[s].update(record)
    offset, self.sizes[s], self.counts[s] = self.sizes[s], self.sizes[s] + len(record), \
        self.counts[s] + 1
    return offset

  def close(self, examples: int) -> list:
    """Closes them; with fewer examples than shards, shard i (example i) is renamed i of
    `examples`, which keeps example i in shard i mod the count. Returns their entries."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    for f in self.files.values():
      f.close()
    n = min(self.n, examples)
    if n < self.n:
      for s in range(n):
        tf.io.gfile.rename(os.path.join(self.directory, shard_name(s, self.n)),
                           os.path.join(self.directory, shard_name(s, n)))
    return [{"file": shard_name(s, n), "examples": self.counts[s], "bytes": self.sizes[s],
             "sha256": self.digests[s].hexdigest()} for s in range(n)]

  def abandon(self) -> None:
    for f in self.files.values():
      f.close()


def _chunks(examples: Iterable[dict]) -> Iterator[list]:
  """`examples` in lists of images.CHUNK, as the readers decode them."""
  examples = iter(examples)
  while True:
    chunk = list(itertools.islice(examples, images.CHUNK))
    if not chunk:
      return
    yield chunk


def write_images(out: str, examples: Iterable[dict], task: str, labels, *, class_names=(),
                 num_shards: int = 2, overwrite: bool = False,
                 progress: Optional[prepare.Progress] = None) -> dict:
  """Writes `examples` (dicts of `image` and the label fields `labels`, its spec's:
  tfpar.tasks.specs) as a prepared image set of `task` at `out`, a chunk at a time as they
  come; returns its manifest. A DataError from the reader leaves `out` as it was.
  `progress`, if given, is told each chunk's images and record bytes."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tmp = prepare._begin(out, overwrite)  # pylint: disable=protected-access
  shards = _Shards(tmp, num_shards)
  try:
    tf.io.gfile.rmtree(os.path.join(tmp, "parts"))
    fields, n, rows, largest = None, 0, 1, -1
    with tf.io.gfile.GFile(os.path.join(tmp, INDEX), "wb") as index:
      for chunk in _chunks(examples):
        for example in chunk:
          if fields is None:
            if tuple(k for k in example if k != "image") != tuple(labels):
              raise DataError(f"a {task} set has {', '.join(labels)} labels, not "
                              f"{', '.join(k for k in example if k != 'image')}")
            fields = _fields(example["image"].shape, labels, rows)
          if example["image"].shape != fields[0].shape:
            raise DataError(f"example {n} is an image of {example['image'].shape}, not "
                            f"{fields[0].shape} as the first: decode all at one size")
          n += 1
          if "boxes" in example:
            rows = max(rows, len(example["boxes"]))
          for name in ("label", "classes", "mask"):
            if name in example:
              largest = max(largest, int(np.max(example[name], initial=-1)))
        records = _records(fields, chunk)
        for i, record in enumerate(records, n - len(records)):
          index.write(np.array([shards.write(i, record), len(record)], "<u8").tobytes())
        if progress:
          progress.add(sum(map(len, records)), len(records))
    if progress:
      progress.show()
    if fields is None:
      raise DataError(f"--data holds no {task} examples: bring some images")
    fields = _fields(fields[0].shape, labels, rows)
    manifest = {
        "format": FORMAT, "task": task, "examples": n,
        "fields": [{k: v for k, v in dataclasses.asdict(f).items() if v is not None}
                   for f in fields],
        "class_names": list(class_names), "max_class_id": largest, "shards": shards.close(n),
        "index": {"file": INDEX, "bytes": 16 * n,
                  "sha256": prepared.sha256_of(os.path.join(tmp, INDEX))}}
    with tf.io.gfile.GFile(os.path.join(tmp, prepared.MANIFEST), "w") as f:
      f.write(json.dumps(manifest, indent=1) + "\n")  # Last: a set without it is incomplete.
    prepare._publish(tmp, out)  # pylint: disable=protected-access
  except BaseException:
    shards.abandon()
    if tf.io.gfile.exists(tmp):
      tf.io.gfile.rmtree(tmp)
    raise
  return manifest


def is_image_set(directory: str) -> bool:
  """Whether `directory` is a prepared image set (its manifest says so), of any format."""
  path = os.path.join(directory, prepared.MANIFEST)
  if not storage.exists(path):
    return False
  try:
    return str(json.loads(storage.read_text(path)).get("format")).startswith(
        "tfpar.prepared-images/")
  except (ValueError, AttributeError):
    return False


@dataclasses.dataclass(frozen=True)
class ImageStream:
  """The examples `index` (default: all) of a prepared image set, read on demand."""
  paths: Tuple[str, ...]
  sizes: Tuple[int, ...]  # Each shard's bytes.
  records: np.ndarray  # [examples, 2] (offset in its shard, length).
  fields: Tuple[Field, ...]
  class_names: Tuple[str, ...] = ()
  index: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return len(self.records) if self.index is None else len(self.index)

  def take(self, index: np.ndarray) -> "ImageStream":
    """The examples at `index` of this one (a subset, in that order): no read."""
    mine = np.arange(len(self)) if self.index is None else self.index
    return dataclasses.replace(self, index=mine[np.asarray(index)])

  @property
  def image_shape(self) -> Tuple[int, ...]:
    return self.fields[0].shape

  def read(self, i, images: bool = True):
    """A dataset of one element: example i's fields (a dict of tensors), by one ranged read;
    without `images`, its image is not decoded (zeros of its shape)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    record = i if self.index is None else tf.gather(tf.constant(self.index, tf.int64), i)
    shard = record % len(self.paths)
    offset = tf.gather(tf.constant(self.records[:, 0].astype(np.int64)), record)
    length = tf.gather(tf.constant(self.records[:, 1].astype(np.int64)), record)
    footer = tf.gather(tf.constant(self.sizes, tf.int64), shard) - offset - length
    raw = tf.data.FixedLengthRecordDataset(tf.gather(tf.constant(self.paths), shard), length,
                                           header_bytes=offset, footer_bytes=footer,
                                           buffer_size=0)
    return raw.map(lambda r: self._decode(r, images))

  def _decode(self, raw, images: bool = True):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    out, at = {}, tf.constant(0, tf.int32)
    for f in self.fields:
      size = tf.io.decode_raw(tf.strings.substr(raw, at, 4), tf.int32, little_endian=True)[0]
      part = tf.strings.substr(raw, at + 4, size)
      at += 4 + size
      dtype = tf.as_dtype(np.dtype(f.dtype).name)
      if f.name == "image" and not images:
        out[f.name] = tf.zeros(f.shape, dtype)
        continue
      if f.encoding == "png":
        value = tf.io.decode_png(part, channels=f.shape[2] if len(f.shape) == 3 else 1,
                                 dtype=tf.uint8 if f.dtype == "|u1" else tf.uint16)
        out[f.name] = tf.cast(tf.reshape(value, f.shape), dtype)
        continue
      value = tf.io.decode_raw(part, dtype, little_endian=True)
      if f.pad is None:
        out[f.name] = tf.reshape(value, f.shape)
        continue
      value = tf.reshape(value, [-1, *f.shape[1:]])
      pad = [[0, f.shape[0] - tf.shape(value)[0]]] + [[0, 0]] * (len(f.shape) - 1)
      out[f.name] = tf.ensure_shape(tf.pad(value, pad, constant_values=tf.cast(f.pad, dtype)),
                                    f.shape)
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
    fields = tuple(Field(f["name"], f["dtype"], tuple(f["shape"]), f.get("encoding", "raw"),
                         f.get("pad")) for f in manifest["fields"])
    shards, examples, entry = manifest["shards"], int(manifest["examples"]), manifest["index"]
    names = [f.name for f in fields]
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise _bad(directory, f"{prepared.MANIFEST} is not a valid image manifest ({e})") from None
  if manifest.get("format") == DECODED:
    raise _bad(directory, f"it holds decoded pixels ({DECODED}), a format tfpar no longer reads")
  if manifest.get("format") != FORMAT:
    raise _bad(directory, f"its format {manifest.get('format')} is not {FORMAT}, which this "
               "tfpar reads")
  if manifest.get("task") != task or names[1:] != list(labels):
    raise DataError(f"--data={directory} is a prepared {manifest.get('task')} set, not a {task} "
                    f"set: pass --task={manifest.get('task')} or prepare the {task} data")
  shape = (image_size, image_size, channels)
  if fields[0].shape != shape:
    raise DataError(f"--data={directory} holds images of {'x'.join(map(str, fields[0].shape))}, "
                    f"not --image_size={image_size} x --num_channels={channels}: pass those "
                    "flags or prepare the images again at these")
  verify = sum(s["bytes"] for s in shards) + entry["bytes"] <= verify_bytes
  for kind, s in [("shard", s) for s in shards] + [("index", entry)]:
    path = os.path.join(directory, s["file"])
    if not storage.exists(path):
      raise _bad(directory, f"its {kind} {s['file']} is missing")
    size = tf.io.gfile.stat(path).length
    if size != s["bytes"]:
      raise _bad(directory, f"its {kind} {s['file']} is truncated or altered ({size:,} bytes; "
                 f"its manifest says {s['bytes']:,})")
    if verify and prepared.sha256_of(path) != s["sha256"]:
      raise _bad(directory, f"its {kind} {s['file']} is corrupt (its sha256 is not the "
                 "manifest's)")
  if entry["bytes"] != 16 * examples or sum(s["examples"] for s in shards) != examples:
    raise _bad(directory, f"{prepared.MANIFEST} counts {examples} examples, but its index or "
               "shards hold another count")
  with tf.io.gfile.GFile(os.path.join(directory, entry["file"]), "rb") as f:
    records = np.frombuffer(f.read(), "<u8").reshape(examples, 2)
  stream = ImageStream(paths=tuple(os.path.join(directory, s["file"]) for s in shards),
                       sizes=tuple(int(s["bytes"]) for s in shards), records=records,
                       fields=fields, class_names=tuple(manifest.get("class_names", ())))
  largest = manifest.get("max_class_id", -1)
  if largest >= num_classes:
    raise DataError(f"--data={directory} has class id {largest}; --num_classes={num_classes} "
                    f"holds ids 0..{num_classes - 1}: pass --num_classes={largest + 1} or more")
  return stream
