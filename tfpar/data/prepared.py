"""Corpora tokenized once into sharded TFRecords (what Megatron's preprocess_data does).

    python -m tfpar.data prepare --tokenizer=sentencepiece:/tmp/sp.model --out=/tmp/prep
    python -m tfpar.train --data='/tmp/prep/*.tfrecord' --tokenizer=sentencepiece:/tmp/sp.model ...

Each record is one document, a tf.train.Example whose int64 feature 'ids'
holds its ids; DIR/tokenizer.json names the tokenizer that wrote them. Read
back, the documents are joined with the tokenizer's separator exactly as
tfpar.data.corpus joins text, so a prepared corpus gives the same stream, the
same held-out tail and the same batches as its text, without tokenizing at
start-up. A shard written with another tokenizer than --tokenizer is refused.
"""

import json
import os
import sys
from typing import List, Optional, Sequence

import numpy as np

from tfpar import console
from tfpar import storage
from tfpar import tokenizer as tokenizer_lib
from tfpar.data import corpus

IDS = "ids"
META = "tokenizer.json"


def write(files: Sequence[str], tok, out: str, *, num_shards: int = 4,
          tfrecord_key: str = "text") -> List[str]:
  """Tokenizes `files` into `num_shards` TFRecord shards under `out` (documents in order)."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  storage.makedirs(out)
  docs = [d for path in files for d in corpus.read_documents(path, tfrecord_key) if d]
  per_shard = -(-len(docs) // num_shards)
  paths = [os.path.join(out, f"tokens-{i:05d}-of-{num_shards:05d}.tfrecord")
           for i in range(num_shards)]
  bar = keras.utils.Progbar(len(docs), unit_name="doc")
  for i, path in enumerate(paths):
    with tf.io.TFRecordWriter(path) as writer:
      for doc in docs[i * per_shard:(i + 1) * per_shard]:
        ids = tok.encode(doc.replace(corpus.DOC_SEPARATOR, b"").decode("utf-8", "replace"))
        writer.write(tf.train.Example(features=tf.train.Features(feature={
            IDS: tf.train.Feature(int64_list=tf.train.Int64List(value=ids))})).SerializeToString())
        bar.add(1)
  storage.write_atomically(os.path.join(out, META), json.dumps(
      {"tokenizer": tok.spec, "vocab_size": tok.vocab_size, "documents": len(docs)}) + "\n")
  return paths


def is_prepared(path: str) -> bool:
  """Is `path` a shard `write` wrote (its directory holds tokenizer.json)?"""
  return path.endswith(corpus.TFRECORD_SUFFIXES) and storage.exists(
      os.path.join(os.path.dirname(path), META))


def read_ids(path: str, tok) -> List[np.ndarray]:
  """A shard's documents as int32 ids; DataError if another tokenizer wrote it."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  meta = json.loads(storage.read_text(os.path.join(os.path.dirname(path), META)))
  if meta["tokenizer"] != tok.spec:
    raise corpus.DataError(f"{path} was prepared with --tokenizer={meta['tokenizer']}, not "
                           f"--tokenizer={tok.spec}: pass --tokenizer={meta['tokenizer']} or "
                           "prepare the corpus again with python -m tfpar.data prepare")
  return [np.asarray(tf.train.Example.FromString(r).features.feature[IDS].int64_list.value,
                     np.int32) for r in tf.data.TFRecordDataset(path).as_numpy_iterator()]


def main(argv: Sequence[str]) -> None:
  """python -m tfpar.data prepare --data=... --tokenizer=... --out=DIR."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FlagValues()
  flags.DEFINE_string("data", None, "Text to tokenize, as tfpar.train's --data (default: the "
                      "embedded standard library source).", flag_values=fv)
  flags.DEFINE_string("tfrecord_key", "text", "The bytes feature of text TFRecords.",
                      flag_values=fv)
  flags.DEFINE_string("tokenizer", "bytes", "As tfpar.train's --tokenizer.", flag_values=fv)
  flags.DEFINE_string("out", None, "The directory the shards go to (gs:// works).",
                      flag_values=fv)
  flags.DEFINE_integer("num_shards", 4, "TFRecord files to write.", flag_values=fv)

  def fail(message: Optional[str]):
    print(f"tfpar.data: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)

  if console.parse_tool_args(
      fv, argv, fail, doc=__doc__, command="prepare",
      usage="usage: python -m tfpar.data prepare --data=... --tokenizer=... --out=DIR"):
    return
  if not fv.out:
    fail("--out=DIR is required: where the TFRecord shards go")
  if fv.num_shards < 1:
    fail(f"--num_shards={fv.num_shards} must be >= 1")
  console.import_tensorflow_quietly()
  try:
    tok = tokenizer_lib.load(fv.tokenizer)
    files = corpus.list_files(fv.data)
    paths = write(files, tok, fv.out, num_shards=fv.num_shards, tfrecord_key=fv.tfrecord_key)
  except (tokenizer_lib.TokenizerError, corpus.DataError) as e:
    fail(str(e))
  print(f"wrote {len(paths)} shards to {fv.out} ({tok.spec})", flush=True)
