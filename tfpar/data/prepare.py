"""Tokenizes a corpus once into a prepared set (tfpar.data.prepared); its command is
`python -m tfpar.data prepare` (tfpar.cli.data).

Streaming: each input file is tokenized by one of --workers processes, a
document piece by piece (tfpar.data.corpus.pieces), into a part file of ids;
the parent writes the index as parts arrive (in file order) and then copies
the parts into --num_shards shards of equal token counts. So memory is a few
pieces per process, whatever the corpus, and the output depends on the files
alone: the same corpus prepared twice, with any --workers, gives the same
bytes.

Complete or absent: everything is written into a hidden directory beside
--out, the manifest last, and renamed into place when whole. A non-empty --out
is refused unless --overwrite, which replaces it only once the new set is
complete. An interrupted prepare leaves --out as it was (and a hidden
.NAME.partial-PID directory to delete).
"""

import json
import os
import sys
import time
from typing import Iterable, Optional, Sequence

import numpy as np

from tfpar import console, storage
from tfpar.data import corpus, prepared

_TOKENIZER = {}  # spec -> the tokenizer a worker process loaded.


def _tokenizer(spec: str):
  from tfpar import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  if spec not in _TOKENIZER:
    _TOKENIZER[spec] = tokenizer_lib.load(spec)
  return _TOKENIZER[spec]


def _write_part(task) -> tuple:
  """Tokenizes one file into `part`: (document lengths with their separators, text bytes)."""
  path, spec, fingerprint, key, part = task
  tok = _tokenizer(spec)
  if tok.fingerprint != fingerprint:
    raise corpus.DataError(f"--tokenizer={spec} changed while the corpus was being prepared: "
                           "prepare again")
  dtype = "<" + np.dtype(prepared.dtype_for(tok.vocab_size)).str[1:]
  separator = np.array([tok.separator_id], dtype).tobytes()
  lengths = []
  with storage.open_file(part, "wb") as f:
    for doc in corpus.iter_documents(path, key):
      n = 0
      for piece in doc:
        ids = tok.encode_piece(piece)
        f.write(ids.astype(dtype).tobytes())
        n += len(ids)
      f.write(separator)
      lengths.append(n + 1)
  return np.asarray(lengths, np.uint64), storage.size(path)


class Progress:
  """One line on stderr at most every 2 s, and one at the end: what is done (of how many,
  where known ahead), the MB it came to, and the rates. Text prepare counts files and MB of
  text; image prepare (tfpar.data.image_prepared) counts images and MB of records."""

  def __init__(self, noun: str, total: Optional[int] = None, of: str = "text"):
    self.noun, self.total, self.of = noun, total, of
    self.done, self.bytes, self.t0, self.last, self.shown = 0, 0, time.time(), 0.0, -1

  def add(self, n_bytes: int, count: int = 1) -> None:
    self.done, self.bytes = self.done + count, self.bytes + n_bytes
    if time.time() - self.last >= 2 or self.done == self.total:
      self.show()

  def show(self) -> None:
    """Prints the line now (unless it shows this count already): the end's line."""
    if self.shown == self.done:
      return
    now = time.time()
    self.last, self.shown, seconds = now, self.done, max(now - self.t0, 1e-9)
    of = f"/{self.total:,}" if self.total is not None else ""
    print(f"prepare: {self.done:,}{of} {self.noun}s, {self.bytes / 1e6:,.1f} MB of {self.of}, "
          f"{self.bytes / 1e6 / seconds:,.2f} MB/s, {self.done / seconds:,.1f} {self.noun}s/s",
          file=sys.stderr, flush=True)


def _partial(out: str) -> str:
  """The hidden directory beside --out that this process writes the set into."""
  parent, name = os.path.split(out.rstrip("/"))
  return os.path.join(parent, f".{name}.partial-{os.getpid()}")


def _begin(out: str, overwrite: bool) -> str:
  """Checks --out and makes the hidden directory the set is written into."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  out = out.rstrip("/")
  try:
    if tf.io.gfile.exists(out):
      if not tf.io.gfile.isdir(out):
        raise corpus.DataError(f"--out={out} is a file: pass a directory for the prepared set")
      held = tf.io.gfile.listdir(out)
      if held and not overwrite:
        raise corpus.DataError(f"--out={out} already holds {console.count(len(held), 'file')}: "
                               "pass --overwrite to replace it (at once, when the new set is "
                               "complete), or another --out")
    tmp = _partial(out)
    tf.io.gfile.makedirs(os.path.join(tmp, "parts"))
  except (OSError, tf.errors.OpError) as e:
    why = getattr(e, "message", str(e)).splitlines()[0]
    raise corpus.DataError(f"--out={out} cannot be written ({why}): pass a directory you can "
                           "write") from None
  return tmp


def _publish(tmp: str, out: str) -> None:
  """Renames the complete set into place, replacing what --out held."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  out = out.rstrip("/")
  if tf.io.gfile.exists(out):
    old = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.old-{os.getpid()}")
    tf.io.gfile.rename(out, old)
    tf.io.gfile.rename(tmp, out)
    tf.io.gfile.rmtree(old)
  else:
    tf.io.gfile.rename(tmp, out)


def _part_path(tmp: str, i: int) -> str:
  return os.path.join(tmp, "parts", f"part-{i:06d}.bin")


def _pack(parts: Sequence[str], directory: str, dtype: str, num_shards: int) -> list:
  """Copies the parts, in order, into shards of equal token counts: their manifest entries."""
  import hashlib  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  itemsize = np.dtype(dtype).itemsize
  total = sum(tf.io.gfile.stat(p).length for p in parts) // itemsize
  num_shards = max(min(num_shards, total), 1)
  per = -(-total // num_shards)
  sources = iter(parts)
  source, entries = None, []
  for i in range(num_shards):
    name, left = prepared.shard_name(i, num_shards), min(per, total - i * per) * itemsize
    digest, size = hashlib.sha256(), left
    with tf.io.gfile.GFile(os.path.join(directory, name), "wb") as f:
      while left:
        block = source.read(min(left, 1 << 22)) if source is not None else b""
        if not block:
          source = tf.io.gfile.GFile(next(sources), "rb")
          continue
        f.write(block)
        digest.update(block)
        left -= len(block)
    entries.append({"file": name, "tokens": size // itemsize, "bytes": size,
                    "sha256": digest.hexdigest()})
  return entries


def write_set(out: str, tok, parts: Iterable, *, num_shards: int = 4, overwrite: bool = False,
              progress: Optional[Progress] = None) -> dict:
  """Writes a prepared set from `parts`, a callable per part file (called with its path, in
  order) that writes the part and returns (document lengths, text bytes); returns the manifest."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tmp = _begin(out, overwrite)
  try:
    dtype = prepared.dtype_for(tok.vocab_size)
    paths, offset, documents = [], 0, 0
    with tf.io.gfile.GFile(os.path.join(tmp, prepared.INDEX), "wb") as index:
      for i, write_part in enumerate(parts):
        lengths, text_bytes = write_part(_part_path(tmp, i))
        if len(lengths):  # A file without a document (an empty one) writes no part.
          paths.append(_part_path(tmp, i))
        starts = offset + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.uint64)])
        index.write(starts.astype("<u8").tobytes() if len(lengths) else b"")
        offset, documents = offset + int(np.sum(lengths)), documents + len(lengths)
        if progress:
          progress.add(text_bytes)
    shards = _pack(paths, tmp, dtype, num_shards)
    tf.io.gfile.rmtree(os.path.join(tmp, "parts"))
    manifest = {
        "format": prepared.FORMAT, "tokenizer": tok.spec, "tokenizer_sha256": tok.fingerprint,
        "vocab_size": tok.vocab_size, "separator_id": tok.separator_id, "dtype": dtype,
        "tokens": offset, "documents": documents, "shards": shards,
        "index": {"file": prepared.INDEX, "bytes": documents * 8,
                  "sha256": prepared.sha256_of(os.path.join(tmp, prepared.INDEX))}}
    with tf.io.gfile.GFile(os.path.join(tmp, prepared.MANIFEST), "w") as f:
      f.write(json.dumps(manifest, indent=1) + "\n")
    _publish(tmp, out)
  except BaseException:
    if tf.io.gfile.exists(tmp):
      tf.io.gfile.rmtree(tmp)
    raise
  return manifest


def write_arrays(out: str, tok, documents: Iterable[np.ndarray], **kwargs) -> dict:
  """A prepared set of documents given as id arrays (one part): what tests write with numpy."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  dtype = "<" + np.dtype(prepared.dtype_for(tok.vocab_size)).str[1:]

  def part(path):
    lengths = []
    with tf.io.gfile.GFile(path, "wb") as f:
      for doc in documents:
        f.write(np.append(doc, tok.separator_id).astype(dtype).tobytes())
        lengths.append(len(doc) + 1)
    return np.asarray(lengths, np.uint64), 0

  return write_set(out, tok, [part], **kwargs)


def prepare(files: Sequence[str], tok, out: str, *, num_shards: int = 4, workers: int = 1,
            overwrite: bool = False, tfrecord_key: str = "text") -> dict:
  """Tokenizes `files` (in order) with `workers` processes into the prepared set `out`."""
  tasks = [(path, tok.spec, tok.fingerprint, tfrecord_key) for path in files]
  progress = Progress("file", len(files))
  if workers == 1:
    _TOKENIZER[tok.spec] = tok
    parts = (lambda part, t=t: _write_part(t + (part,)) for t in tasks)
    return write_set(out, tok, parts, num_shards=num_shards, overwrite=overwrite,
                     progress=progress)
  import multiprocessing  # pylint: disable=import-outside-toplevel

  def parts():  # Each worker writes a whole file's part, at the path write_set gives it.
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
      paths = [_part_path(_partial(out), i) for i in range(len(tasks))]
      for result in pool.imap(_write_part, [t + (p,) for t, p in zip(tasks, paths)]):
        yield lambda part, r=result: r

  return write_set(out, tok, parts(), num_shards=num_shards, overwrite=overwrite,
                   progress=progress)
