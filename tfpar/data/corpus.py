"""Finding and reading text: the embedded default corpus, text files, globs, TFRecords, and
the ids of shards tfpar.data.prepared wrote.

Text becomes bytes (byte-level tokens 0..255, no vocabulary to download);
documents are joined with a NUL byte, which plain text never contains, so the
model sees where one document ends and the next begins.
"""

import glob
import json
import os
import sysconfig
from typing import List, Optional, Sequence

import numpy as np

from tfpar import storage

DOC_SEPARATOR = b"\x00"
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfrec")
# A prepared shard (tfpar.data.prepared): each record's int64 feature, and the file beside it.
IDS = "ids"
META = "tokenizer.json"


class DataError(ValueError):
  """Data that cannot be used; the message names the path and the fix."""


def default_corpus_files() -> List[str]:
  """The Python standard library's top-level source files: real text on every machine."""
  stdlib = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
  if not files:
    raise DataError(f"no *.py files under the standard library at {stdlib}: pass --data=PATH")
  return files


def list_files(data: Optional[str]) -> List[str]:
  """Expands --data (None, a file, a directory, or a glob) into a sorted list of files."""
  if data is None:
    return default_corpus_files()
  import tensorflow as tf  # gfile reads local paths and gs:// alike.
  if tf.io.gfile.isdir(data):
    files = [os.path.join(root, name) for root, _, names in tf.io.gfile.walk(data)
             for name in names if not name.startswith(".")]
  else:
    files = tf.io.gfile.glob(data)
  files = sorted(f for f in files if not tf.io.gfile.isdir(f))
  if not files:
    raise DataError(f"--data={data} matches no file: pass a text file, a directory, a glob "
                    "or TFRecord shards")
  return files


def read_documents(path: str, tfrecord_key: str = "text") -> List[bytes]:
  """The documents of one file: the whole text file, or each TFRecord example's text."""
  import tensorflow as tf
  from google.protobuf.message import DecodeError  # pylint: disable=import-outside-toplevel
  if path.endswith(TFRECORD_SUFFIXES):
    docs = []
    try:
      for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
        try:
          example = tf.train.Example.FromString(record)
        except DecodeError:
          raise DataError(f"{path}: a record is not a tf.train.Example: write each text as "
                          f"an Example with a bytes feature '{tfrecord_key}'") from None
        feature = example.features.feature.get(tfrecord_key)
        if feature is None:
          raise DataError(f"{path}: a record has no feature '{tfrecord_key}': "
                          "pass --tfrecord_key=NAME of the bytes feature holding the text")
        docs.extend(feature.bytes_list.value)
    except tf.errors.DataLossError:
      raise DataError(f"{path} is not a valid TFRecord file: check the file or rename it "
                      "without a .tfrecord suffix to read it as text") from None
    return docs
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      return [f.read()]
  except tf.errors.OpError as e:
    raise DataError(f"{path} cannot be read ({e.message.splitlines()[0]}): check the file or "
                    "its permissions, or pass another --data") from None


def read_tokens(files: Sequence[str], tfrecord_key: str = "text", tokenizer=None) -> np.ndarray:
  """Reads files into one token array, documents separated by the tokenizer's separator.

  Without a tokenizer (or with tfpar.tokenizer's 'bytes' on text): uint8 bytes,
  DOC_SEPARATOR between documents; else the tokenizer's int32 ids, its separator_id
  between them. Shards of tfpar.data.prepared are read as the ids they hold.
  """
  if tokenizer is not None and (tokenizer.spec != "bytes" or
                                any(is_prepared(f) for f in files)):
    ids = []
    for path in files:
      if is_prepared(path):  # Tokenized once by python -m tfpar.data prepare.
        docs = [d for d in read_ids(path, tokenizer) if len(d)]
      else:
        docs = [tokenizer.encode(d.replace(DOC_SEPARATOR, b"").decode("utf-8", "replace"))
                for d in read_documents(path, tfrecord_key) if d]
      for doc in docs:
        ids.append(doc)
        ids.append(np.array([tokenizer.separator_id], np.int32))
    return np.concatenate(ids) if ids else np.zeros([0], np.int32)
  pieces = []
  for path in files:
    for doc in read_documents(path, tfrecord_key):
      if doc:
        pieces.append(doc.replace(DOC_SEPARATOR, b""))
        pieces.append(DOC_SEPARATOR)
  return np.frombuffer(b"".join(pieces), dtype=np.uint8)


def is_prepared(path: str) -> bool:
  """Is `path` a shard tfpar.data.prepared wrote (its directory holds tokenizer.json)?"""
  return path.endswith(TFRECORD_SUFFIXES) and storage.exists(
      os.path.join(os.path.dirname(path), META))


def read_ids(path: str, tok) -> List[np.ndarray]:
  """A shard's documents as int32 ids; DataError if another tokenizer wrote it."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  meta = json.loads(storage.read_text(os.path.join(os.path.dirname(path), META)))
  if meta["tokenizer"] != tok.spec:
    raise DataError(f"{path} was prepared with --tokenizer={meta['tokenizer']}, not "
                    f"--tokenizer={tok.spec}: pass --tokenizer={meta['tokenizer']} or "
                    "prepare the corpus again with python -m tfpar.data prepare")
  return [np.asarray(tf.train.Example.FromString(r).features.feature[IDS].int64_list.value,
                     np.int32) for r in tf.data.TFRecordDataset(path).as_numpy_iterator()]


def encode(text: str) -> List[int]:
  """Text -> byte tokens."""
  return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
  """Byte tokens -> text; invalid UTF-8 (a byte model can emit it) is replaced, not fatal."""
  return bytes(int(t) for t in tokens if int(t) != DOC_SEPARATOR[0]).decode("utf-8", "replace")
