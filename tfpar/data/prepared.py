"""Corpora tokenized once into sharded TFRecords (what Megatron's preprocess_data does).

    python -m tfpar.data prepare --tokenizer=sentencepiece:/tmp/sp.model --out=/tmp/prep
    python -m tfpar.train --data='/tmp/prep/*.tfrecord' --tokenizer=sentencepiece:/tmp/sp.model ...

Each record is one document, a tf.train.Example whose int64 feature 'ids'
holds its ids; DIR/tokenizer.json names the tokenizer that wrote them. Read
back (tfpar.data.corpus reads them), the documents are joined with the
tokenizer's separator exactly as text is, so a prepared corpus gives the same
stream, the same held-out tail and the same batches as its text, without tokenizing at
start-up. A shard written with another tokenizer than --tokenizer is refused.
"""

import json
import os
from typing import List, Sequence

from tfpar import storage
from tfpar.data import corpus


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
        writer.write(tf.train.Example(features=tf.train.Features(feature={corpus.IDS: (
            tf.train.Feature(int64_list=tf.train.Int64List(value=ids)))})).SerializeToString())
        bar.add(1)
  storage.write_atomically(os.path.join(out, corpus.META), json.dumps(
      {"tokenizer": tok.spec, "vocab_size": tok.vocab_size, "documents": len(docs)}) + "\n")
  return paths
