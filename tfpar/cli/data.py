"""python -m tfpar.data prepare: tokenize a corpus once into TFRecord shards (tfpar.data.prepared).

    python -m tfpar.data prepare --data='docs/*.txt' --tokenizer=sentencepiece:t.model --out=DIR

Training then reads the ids the shards hold (--data=DIR/*.tfrecord) instead of
tokenizing on every start. Bad input ends with one line on stderr and exit status 2.
"""

import functools
import sys
from typing import Sequence

from tfpar import console
from tfpar import tokenizer as tokenizer_lib
from tfpar.cli import tool
from tfpar.data import corpus, prepared

fail = functools.partial(tool.fail, "data")


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

  if tool.parse_args(
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
    paths = prepared.write(files, tok, fv.out, num_shards=fv.num_shards, tfrecord_key=fv.tfrecord_key)
  except (tokenizer_lib.TokenizerError, corpus.DataError) as e:
    fail(str(e))
  print(f"wrote {len(paths)} shards to {fv.out} ({tok.spec})", flush=True)


if __name__ == "__main__":
  main(sys.argv)
