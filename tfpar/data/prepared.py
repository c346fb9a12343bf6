"""Prepared corpora: token ids in fixed-width binary shards that training streams.

    python -m tfpar.data prepare --tokenizer=sentencepiece:/tmp/sp.model --out=/tmp/prep
    python -m tfpar.train --data=/tmp/prep --tokenizer=sentencepiece:/tmp/sp.model ...

A prepared set is one directory (tfpar.data.prepare writes it):

  tokens-00000-of-00004.bin ...  the token stream, cut into shards: little-endian
                                 ids of `dtype` (uint8 up to 256 ids, uint16 up to
                                 65,536, else uint32), no header. The stream is the
                                 documents joined by the tokenizer's separator,
                                 exactly as tfpar.data.corpus joins text, so a
                                 prepared corpus gives the same windows, held-out
                                 tail and batches as its text.
  index.bin                      uint64 offset in the stream of each document's first id.
  manifest.json                  written last: the format, the tokenizer (spec, sha256
                                 of its content, vocabulary size, separator), dtype,
                                 and each file with its size and sha256.

Token t of the stream is at byte (t - first token of its shard) * itemsize of
one shard, so a window at any position is one ranged read (two where it
crosses a shard's end), without reading what comes before it
(tfpar.data.pipeline reads a local set's with `TokenStream.windows`, a remote one's with
tf.data.FixedLengthRecordDataset).

`open_set` is what training calls: it reads the manifest and refuses, with
one line naming the fix, a set that is incomplete (no manifest), written by
another tokenizer (by content, not path) or at another width, or whose files
are missing, truncated or, up to VERIFY_BYTES of shards, corrupt (their
sha256; past that size a start-up would read the whole corpus, so only sizes
are checked). Training reads only the files the
manifest lists. TFRecord shards of an older tfpar (int64 ids, tokenizer.json)
are refused with the line that says to prepare again.
"""

import dataclasses
import hashlib
import json
import os
import threading
from typing import Optional, Tuple

import numpy as np

from tfpar import storage
from tfpar.data import corpus

FORMAT = "tfpar.prepared/2"
MANIFEST = "manifest.json"
INDEX = "index.bin"
OLD_META = "tokenizer.json"  # The older TFRecord format's only record of its tokenizer.
VERIFY_BYTES = 1 << 30
KEYS = ("format", "tokenizer", "tokenizer_sha256", "vocab_size", "separator_id", "dtype",
        "tokens", "documents", "shards", "index")


def dtype_for(vocab_size: int) -> str:
  """The narrowest unsigned width that holds ids 0..vocab_size-1."""
  return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(i: int, n: int) -> str:
  return f"tokens-{i:05d}-of-{n:05d}.bin"


def sha256_of(path: str) -> str:
  """sha256 of a file, read a block at a time."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  digest = hashlib.sha256()
  with tf.io.gfile.GFile(path, "rb") as f:
    while block := f.read(1 << 22):
      digest.update(block)
  return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """Tokens [start, start + length) of a prepared set's stream, read on demand.

  Attributes:
    paths: the shards, in stream order; sizes: each one's token count.
    dtype: the ids' width ('uint8', 'uint16', 'uint32').
  """
  paths: Tuple[str, ...]
  sizes: Tuple[int, ...]
  dtype: str
  start: int = 0
  length: Optional[int] = None

  def __len__(self) -> int:
    return sum(self.sizes) - self.start if self.length is None else self.length

  def __getitem__(self, item: slice) -> "TokenStream":
    """A view of a range (what tfpar.data.pipeline.split_tokens takes)."""
    begin, end, step = item.indices(len(self))
    assert step == 1, "a TokenStream view is contiguous"
    return dataclasses.replace(self, start=self.start + begin, length=max(end - begin, 0))

  @property
  def itemsize(self) -> int:
    return np.dtype(self.dtype).itemsize

  @property
  def wire_dtype(self) -> np.dtype:
    """The ids' dtype as the shards store them (little-endian)."""
    return np.dtype(self.dtype).newbyteorder("<")

  def _spans(self, at: int, n: int):
    """(shard path, byte offset in it, token count) of each piece of stream tokens
    [at, at + n), in order: one, or two where they cross a shard's end."""
    ends = np.cumsum(self.sizes)
    k = int(np.searchsorted(ends, at, side="right"))
    while n > 0 and k < len(self.sizes):
      first = int(ends[k]) - self.sizes[k]
      take = min(n, int(ends[k]) - at)
      yield self.paths[k], (at - first) * self.itemsize, take
      at, n, k = at + take, n - take, k + 1

  def read(self, begin: int = 0, n: Optional[int] = None) -> np.ndarray:
    """Tokens [begin, begin + n) of this view as int32, by ranged reads."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    n = len(self) - begin if n is None else min(n, len(self) - begin)
    out = []
    for path, offset, count in self._spans(self.start + begin, n):
      with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(offset)
        out.append(np.frombuffer(f.read(count * self.itemsize), self.wire_dtype))
    return np.concatenate(out).astype(np.int32) if out else np.zeros([0], np.int32)

  @property
  def local(self) -> bool:
    """Whether every shard is a local file (read by `windows`, no TensorFlow op)."""
    return not any(storage.is_remote(p) for p in self.paths)

  def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows `indices` of this view ([B, seq_len + 1] ids of `dtype`): window i is tokens
    [i * seq_len, i * seq_len + seq_len + 1), each one `os.pread` of a local shard (two where
    it crosses a shard's end) into the batch; the page cache holds the file, not this
    process, so its resident memory does not grow with what it has read."""
    out = np.empty((len(indices), seq_len + 1), self.wire_dtype)
    for row, i in enumerate(np.asarray(indices, np.int64)):
      filled = 0
      for path, offset, count in self._spans(self.start + int(i) * seq_len, seq_len + 1):
        data = os.pread(_descriptor(path), count * self.itemsize, offset)
        if len(data) != count * self.itemsize:
          raise corpus.DataError(f"{path} is shorter than its manifest says: "
                                 "prepare the set again")
        out[row, filled:filled + count] = np.frombuffer(data, out.dtype)
        filled += count
    return out


_DESCRIPTORS: dict = {}  # path -> an open file descriptor (os.pread takes no seek).
_LOCK = threading.Lock()


def _descriptor(path: str) -> int:
  with _LOCK:
    if path not in _DESCRIPTORS:
      _DESCRIPTORS[path] = os.open(path, os.O_RDONLY)
    return _DESCRIPTORS[path]


def locate(data: Optional[str]) -> Optional[str]:
  """The prepared set --data names (its directory, or its manifest.json), else None.

  DataError for a directory, or files of one, that a prepare left without its
  manifest (an interrupted prepare) or that an older tfpar prepared.
  """
  if data is None:
    return None
  glob = any(c in data for c in "*?[")
  directory = os.path.dirname(data) if glob or os.path.basename(data) == MANIFEST else data
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if not directory or not tf.io.gfile.isdir(directory):
    return None
  if storage.exists(os.path.join(directory, MANIFEST)):
    if glob:
      raise corpus.DataError(f"--data={data} names files inside the prepared set {directory}: "
                             f"pass --data={directory}")
    return directory
  names = tf.io.gfile.listdir(directory)
  if OLD_META in names and any(n.endswith(corpus.TFRECORD_SUFFIXES) for n in names):
    raise corpus.DataError(
        f"--data={data}: {directory} holds TFRecord shards of an older tfpar.data prepare "
        "(int64 ids): prepare the text again with python -m tfpar.data prepare --overwrite "
        f"--out={directory}, which writes the streamed format")
  if not glob and any(n == INDEX or (n.startswith("tokens-") and n.endswith(".bin"))
                      for n in names):
    raise corpus.DataError(f"--data={data}: this prepare is incomplete ({directory} has no "
                           f"{MANIFEST}, which a prepare writes last): run python -m tfpar.data "
                           "prepare again")
  return None


def _bad(directory: str, what: str) -> corpus.DataError:
  return corpus.DataError(f"the prepared set {directory}: {what}: prepare it again with python -m "
                          "tfpar.data prepare --overwrite")


def _describes_files(manifest: dict) -> bool:
  """Shards and index, each {file: a name in the set, bytes: int, sha256: str}, shards with
  tokens: int; a width tfpar writes."""
  shards, index = manifest["shards"], manifest["index"]
  if not isinstance(shards, list) or not shards or manifest["dtype"] not in (
      "uint8", "uint16", "uint32"):
    return False
  for entry in shards + [index]:
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and
            os.path.basename(entry["file"]) == entry["file"] and
            isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
      return False
  return all(isinstance(entry.get("tokens"), int) for entry in shards)


def read_manifest(directory: str) -> dict:
  """The manifest, checked for form; DataError (one line) where it is not one."""
  path = os.path.join(directory, MANIFEST)
  try:
    manifest = json.loads(storage.read_text(path))
  except (ValueError, UnicodeDecodeError) as e:
    raise _bad(directory, f"{MANIFEST} is not valid JSON ({e})") from None
  if not isinstance(manifest, dict) or any(k not in manifest for k in KEYS):
    missing = [k for k in KEYS if not isinstance(manifest, dict) or k not in manifest]
    raise _bad(directory, f"{MANIFEST} lacks {', '.join(missing)}")
  if manifest["format"] != FORMAT:
    raise _bad(directory, f"its format is {manifest['format']!r}, not {FORMAT!r}")
  if not _describes_files(manifest):
    raise _bad(directory, f"{MANIFEST} does not describe its files")
  return manifest


def check_files(directory: str, manifest: dict, *, verify_bytes: int = VERIFY_BYTES) -> None:
  """Every listed file is there at its size; checksums too while the shards total <= verify_bytes."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  entries = [dict(s, kind="shard") for s in manifest["shards"]] + [
      dict(manifest["index"], kind="index")]
  itemsize = np.dtype(manifest["dtype"]).itemsize
  for entry in entries:
    path = os.path.join(directory, entry["file"])
    if not storage.exists(path):
      raise _bad(directory, f"its {entry['kind']} {entry['file']} is missing")
    size = tf.io.gfile.stat(path).length
    if size != entry["bytes"] or (entry["kind"] == "shard" and
                                  entry["bytes"] != entry["tokens"] * itemsize):
      raise _bad(directory, f"its {entry['kind']} {entry['file']} is truncated or altered "
                 f"({size:,} bytes; its manifest says {entry['bytes']:,})")
  total = sum(s["bytes"] for s in manifest["shards"])
  for entry in entries:
    if (entry["kind"] == "index" or total <= verify_bytes) and \
        sha256_of(os.path.join(directory, entry["file"])) != entry["sha256"]:
      raise _bad(directory, f"its {entry['kind']} {entry['file']} is corrupt (its sha256 is not "
                 "the manifest's)")


def check_tokenizer(directory: str, manifest: dict, tok) -> None:
  """The set was written by `tok`: the same content, vocabulary and id width."""
  fix = (f"pass the tokenizer it was prepared with, or prepare it again with --tokenizer={tok.spec}"
         " and --overwrite")
  if manifest["tokenizer_sha256"] != tok.fingerprint:
    same = manifest["tokenizer"] == tok.spec
    raise corpus.DataError(
        f"the prepared set {directory} was written by --tokenizer={manifest['tokenizer']}"
        f"{' as it was then' if same else ''} (sha256 {manifest['tokenizer_sha256'][:12]}), not "
        f"by --tokenizer={tok.spec}{' as it is now' if same else ''} (sha256 "
        f"{tok.fingerprint[:12]}): {fix}")
  if manifest["vocab_size"] != tok.vocab_size or manifest["dtype"] != dtype_for(tok.vocab_size):
    raise corpus.DataError(
        f"the prepared set {directory} holds {manifest['dtype']} ids of a {manifest['vocab_size']}"
        f"-id vocabulary; --tokenizer={tok.spec} has {tok.vocab_size} ids "
        f"({dtype_for(tok.vocab_size)}): {fix}")


def open_set(directory: str, tok, *, verify_bytes: int = VERIFY_BYTES) -> TokenStream:
  """The whole token stream of a checked prepared set (see the module docstring)."""
  manifest = read_manifest(directory)
  check_tokenizer(directory, manifest, tok)
  check_files(directory, manifest, verify_bytes=verify_bytes)
  return TokenStream(paths=tuple(os.path.join(directory, s["file"]) for s in manifest["shards"]),
                     sizes=tuple(int(s["tokens"]) for s in manifest["shards"]),
                     dtype=manifest["dtype"])
