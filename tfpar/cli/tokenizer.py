"""python -m tfpar.tokenizer train: fit a SentencePiece model on a corpus (tfpar.tokenizer.train).

    python -m tfpar.tokenizer train --vocab_size=2000 --out=/tmp/stdlib.model   # embedded corpus
    python -m tfpar.tokenizer train --data='docs/*.txt' --vocab_size=8000 --out=gs://b/t.model

It prints bytes per token on the corpus, the number that turns a loss per
token into one per byte. Bad input ends with one line on stderr and exit status 2.
"""

import functools
import sys
from typing import Sequence

from tfpar import console, storage, tokenizer
from tfpar.cli import tool
from tfpar.data import corpus

fail = functools.partial(tool.fail, "tokenizer")


def define_train_flags():
  """The flags of `python -m tfpar.tokenizer train`, on fresh absl FlagValues."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FlagValues()
  flags.DEFINE_string("data", None, "Text to train on, as tfpar.train's --data (default: the "
                      "embedded standard library source).", flag_values=fv)
  flags.DEFINE_string("tfrecord_key", "text", "The bytes feature of TFRecord examples.",
                      flag_values=fv)
  flags.DEFINE_integer("vocab_size", 2000, "Pieces in the vocabulary (>= 260: the 256 byte "
                       "fallbacks and the control ids).", flag_values=fv)
  flags.DEFINE_string("out", None, "Where the .model file goes (gs:// works).", flag_values=fv)
  return fv


def check_train_flags(fv) -> None:
  """The flags of `train`, and --out, before any text is read.

  Raises:
    TokenizerError: bad input, in one line naming the flag; also a remote --out (gs://)
      that does not answer now: a person runs this tool, and nothing retries it.
  """
  if not fv.out:
    raise tokenizer.TokenizerError("--out=PATH is required: where the trained .model file goes")
  for flag in ("data", "out", "tfrecord_key"):
    line = console.not_utf8(flag, fv[flag].value)
    if line:
      raise tokenizer.TokenizerError(line)
  if fv.vocab_size < 260:
    raise tokenizer.TokenizerError(f"--vocab_size={fv.vocab_size} is below 260, the 256 byte pieces and 4 "
                         "control ids: pass a larger --vocab_size")
  if fv.vocab_size > tokenizer.MAX_VOCAB_SIZE:
    raise tokenizer.TokenizerError(f"--vocab_size={fv.vocab_size} is more than SentencePiece can count "
                         f"({tokenizer.MAX_VOCAB_SIZE:,}): pass a vocabulary the text can fill, e.g. "
                         "--vocab_size=8000")
  try:  # The output path first: a training that cannot be written is time lost.
    storage.check_output(fv.out, "out", directory=False)
  except (storage.NotWritable, storage.Unreachable) as e:
    raise tokenizer.TokenizerError(str(e)) from None


def main(argv: Sequence[str]) -> None:
  """python -m tfpar.tokenizer train --data=... --vocab_size=N --out=PATH."""
  fv = define_train_flags()
  if tool.parse_args(
      fv, argv, fail, doc=__doc__, command="train",
      usage="usage: python -m tfpar.tokenizer train --data=... --vocab_size=N --out=PATH"):
    return
  try:
    check_train_flags(fv)
  except tokenizer.TokenizerError as e:
    fail(str(e))
  try:
    files = corpus.list_files(fv.data)  # A bad local --data refused before TensorFlow starts.
    console.import_tensorflow_quietly()
    tok = tokenizer.train(files, vocab_size=fv.vocab_size, out=fv.out, tfrecord_key=fv.tfrecord_key)
  except (tokenizer.TokenizerError, corpus.DataError) as e:
    fail(str(e))
  sample = [d.decode("utf-8", "replace") for d in corpus.read_documents(files[-1], fv.tfrecord_key)]
  print(f"wrote {fv.out}: {tok.vocab_size} pieces, {tok.bytes_per_token(sample):.2f} bytes per "
        f"token on {files[-1]}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
