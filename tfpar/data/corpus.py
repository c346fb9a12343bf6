"""Finding and reading text: the embedded default corpus, text files, globs, TFRecords.

Text becomes bytes (byte-level tokens 0..255, no vocabulary to download);
documents are joined with a NUL byte, which plain text never contains, so the
model sees where one document ends and the next begins.

A document is tokenized in pieces of at most PIECE_BYTES, cut after the last
line break of the piece (a line longer than that, at a character boundary):
a tokenizer's memory grows with what it is given (SentencePiece's about 55
times), so a piece, not a document, bounds it. The cut is a function of the
document's bytes alone, so text read here and text prepared by
tfpar.data.prepare give the same ids.

Text read whole into memory stops at MAX_TEXT_BYTES of files: past that,
`python -m tfpar.data prepare` writes the corpus once into shards that
training streams (tfpar.data.prepared).
"""

import glob
import os
import sysconfig
from typing import Iterator, List, Optional, Sequence

import numpy as np

from tfpar import storage

DOC_SEPARATOR = b"\x00"
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfrec")
PIECE_BYTES = 1 << 20
MAX_TEXT_BYTES = 1 << 30


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
  if storage.isdir(data):  # A local path asks the OS (no TensorFlow yet), gs:// tf.io.gfile.
    files = [os.path.join(root, name) for root, _, names in storage.walk(data)
             for name in names if not name.startswith(".")]
  else:
    files = storage.glob(data)
  files = sorted(f for f in files if not storage.isdir(f))
  if not files:
    raise DataError(f"--data={data} matches no file: pass a text file, a directory, a glob "
                    "or TFRecord shards")
  return files


def _records(path: str, tfrecord_key: str) -> Iterator[bytes]:
  """Each TFRecord example's text, one at a time."""
  import tensorflow as tf
  from google.protobuf.message import DecodeError  # pylint: disable=import-outside-toplevel
  try:
    for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
      try:
        example = tf.train.Example.FromString(record)
      except DecodeError:
        raise DataError(f"{path}: a record is not a tf.train.Example: write each text as "
                        f"an Example with a bytes feature '{tfrecord_key}'") from None
      feature = example.features.feature.get(tfrecord_key)
      if feature is None:
        if "ids" in example.features.feature:
          raise DataError(f"{path} holds token ids of an older or incomplete tfpar.data prepare: "
                          "prepare the text again with python -m tfpar.data prepare and pass "
                          "--data=ITS_DIR")
        raise DataError(f"{path}: a record has no feature '{tfrecord_key}': "
                        "pass --tfrecord_key=NAME of the bytes feature holding the text")
      yield from feature.bytes_list.value
  except tf.errors.DataLossError:
    raise DataError(f"{path} is not a valid TFRecord file: check the file or rename it "
                    "without a .tfrecord suffix to read it as text") from None


def _unreadable(path: str, e) -> DataError:
  return DataError(f"{path} cannot be read ({storage.error_line(e)}): check the file or "
                   "its permissions, or pass another --data")


def read_documents(path: str, tfrecord_key: str = "text") -> List[bytes]:
  """The documents of one file: the whole text file, or each TFRecord example's text."""
  import tensorflow as tf
  if path.endswith(TFRECORD_SUFFIXES):
    return list(_records(path, tfrecord_key))
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      return [f.read()]
  except tf.errors.OpError as e:
    raise _unreadable(path, e) from None


def _cut(buf: bytes, start: int) -> int:
  """Where the piece of `buf` starting at `start` ends (len(buf) - start > PIECE_BYTES)."""
  limit = start + PIECE_BYTES
  newline = buf.rfind(b"\n", start, limit)
  if newline >= 0:
    return newline + 1
  end = limit
  while end > start and buf[end] & 0xC0 == 0x80:  # Not inside a UTF-8 character.
    end -= 1
  return end if end > start else limit


def pieces(doc: bytes) -> Iterator[bytes]:
  """A document's pieces (see the module docstring), NUL bytes removed."""
  doc, start = doc.replace(DOC_SEPARATOR, b""), 0
  while len(doc) - start > PIECE_BYTES:
    end = _cut(doc, start)
    yield doc[start:end]
    start = end
  if start < len(doc):
    yield doc[start:]


def _text_pieces(f, first: bytes) -> Iterator[bytes]:
  """`pieces` of an open text file, read a block at a time."""
  buf, block = first.replace(DOC_SEPARATOR, b""), first
  while block:
    block = f.read(PIECE_BYTES)
    buf += block.replace(DOC_SEPARATOR, b"")
    while len(buf) > PIECE_BYTES:
      end = _cut(buf, 0)
      yield buf[:end]
      buf = buf[end:]
  if buf:
    yield buf


def iter_documents(path: str, tfrecord_key: str = "text") -> Iterator[Iterator[bytes]]:
  """The non-empty documents of one file, each as its `pieces`, holding one piece (a text
  file) or one record (TFRecords) at a time. Consume each document before the next."""
  if path.endswith(TFRECORD_SUFFIXES):
    for doc in _records(path, tfrecord_key):
      if doc:
        yield pieces(doc)
    return
  try:
    with storage.open_file(path, "rb") as f:  # A local file: no TensorFlow (prepare's workers).
      first = f.read(PIECE_BYTES)
      if first:
        yield _text_pieces(f, first)
  except storage.read_errors() as e:
    raise _unreadable(path, e) from None


def check_in_memory(files: Sequence[str], limit: int = MAX_TEXT_BYTES) -> None:
  """DataError when `files` hold more than `limit` bytes: too much to read into memory."""
  import tensorflow as tf
  total = sum(tf.io.gfile.stat(f).length for f in files)
  if total > limit:
    raise DataError(f"--data holds {total / 2**30:.1f} GiB, more than the {limit / 2**30:g} GiB "
                    "tfpar reads into memory: prepare it once with python -m tfpar.data prepare "
                    "--data=... --out=DIR and train with --data=DIR, which streams it")


def read_tokens(files: Sequence[str], tfrecord_key: str = "text", tokenizer=None) -> np.ndarray:
  """Reads files into one token array, documents separated by the tokenizer's separator.

  Without a tokenizer (or with tfpar.tokenizer's 'bytes'): uint8 bytes,
  DOC_SEPARATOR between documents; else the tokenizer's int32 ids, its
  separator_id between them.
  """
  if tokenizer is not None and tokenizer.spec != "bytes":
    ids = []
    for path in files:
      for doc in iter_documents(path, tfrecord_key):
        ids.append(tokenizer.encode_pieces(doc))
        ids.append(np.array([tokenizer.separator_id], np.int32))
    return np.concatenate(ids) if ids else np.zeros([0], np.int32)
  chunks = []
  for path in files:
    for doc in iter_documents(path, tfrecord_key):
      chunks.extend(doc)
      chunks.append(DOC_SEPARATOR)
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def encode(text: str) -> List[int]:
  """Text -> byte tokens."""
  return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
  """Byte tokens -> text; invalid UTF-8 (a byte model can emit it) is replaced, not fatal."""
  return bytes(int(t) for t in tokens if int(t) != DOC_SEPARATOR[0]).decode("utf-8", "replace")
