"""python -m tfpar.data prepare: tokenize a corpus once into a prepared set (tfpar.data.prepare).

    python -m tfpar.data prepare --data='corpus/*.txt' --out=/data/prep --workers=8
        [--tokenizer=sentencepiece:sp.model] [--num_shards=4] [--overwrite]
    python -m tfpar.data prepare --task=classify|detect|segment --data=IMAGES --out=DIR
        --image_size=S --num_channels=C --num_classes=N [--num_shards=4] [--overwrite]

Training then streams the ids the set holds (--data=DIR) instead of tokenizing
on every start (docs/data.md). Bad input ends with one line on stderr and exit status 2.
"""

import functools
import sys
from typing import Sequence

from tfpar import console, storage, tasks
from tfpar import tokenizer as tokenizer_lib
from tfpar.cli import tool
from tfpar.data import corpus
from tfpar.data.prepare import Progress, prepare

fail = functools.partial(tool.fail, "data")
MAX_WORKERS = 256  # Processes prepare may start; more is a typo, not a machine.


def define_prepare_flags():
  """The flags of `python -m tfpar.data prepare`, on fresh absl FlagValues."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FlagValues()
  flags.DEFINE_string("data", None, "Text to tokenize, as tfpar.train's --data (default: the "
                      "embedded standard library source).", flag_values=fv)
  flags.DEFINE_string("tfrecord_key", "text", "The bytes feature of text TFRecords.",
                      flag_values=fv)
  flags.DEFINE_string("tokenizer", "bytes", "As tfpar.train's --tokenizer.", flag_values=fv)
  flags.DEFINE_string("out", None, "The directory the prepared set goes to.", flag_values=fv)
  flags.DEFINE_integer("num_shards", 4, "Shard files to write (equal token counts).",
                       flag_values=fv)
  flags.DEFINE_integer("workers", 1, "Processes tokenizing files in parallel (text; a "
                       "vision task encodes on TensorFlow's threads in one process).",
                       flag_values=fv)
  flags.DEFINE_enum("task", "lm", ["lm", "classify", "detect", "segment"], "lm: tokenize text; "
                    "a vision task: its images (--data in the layouts tfpar.train reads for it), "
                    "decoded at --image_size and stored as PNG with their labels, a chunk at a "
                    "time in one process (tfpar.data.image_prepared).",
                    flag_values=fv)
  flags.DEFINE_integer("image_size", None, "Vision tasks: as tfpar.train's.", flag_values=fv)
  flags.DEFINE_integer("num_channels", 3, "Vision tasks: as tfpar.train's.", flag_values=fv)
  flags.DEFINE_integer("num_classes", None, "Vision tasks: as tfpar.train's.", flag_values=fv)
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out (once the new set is "
                    "complete).", flag_values=fv)
  return fv


def check_prepare_flags(fv) -> None:
  """The flags of `prepare`, and --out, before the tokenizer or any text is read.

  Raises:
    DataError: bad input, in one line naming the flag; also a remote --out (gs://) that
      does not answer now: a person runs this tool, and nothing retries it.
  """
  if not fv.out:
    raise corpus.DataError("--out=DIR is required: where the prepared set goes")
  for flag in ("data", "out", "tokenizer", "tfrecord_key"):
    line = console.not_utf8(flag, fv[flag].value)
    if line:
      raise corpus.DataError(line)
  if fv.num_shards < 1 or fv.num_shards >= 2 ** 31:
    raise corpus.DataError(f"--num_shards={fv.num_shards} must be >= 1 and < 2**31: pass "
                           "e.g. --num_shards=4")
  if not 1 <= fv.workers <= MAX_WORKERS:
    raise corpus.DataError(f"--workers={fv.workers} must be between 1 and {MAX_WORKERS}: pass "
                           "at most the cores this machine has")
  if fv.workers > 1 and tasks.spec(fv.task).labels:
    raise corpus.DataError(f"--workers={fv.workers} is for text (--task=lm): --task={fv.task} "
                           "prepares in one process, its images encoded on TensorFlow's "
                           "threads: drop --workers")
  try:  # The output first: a tokenization that cannot be written is time lost.
    storage.check_output(fv.out, "out", directory=True)
  except (storage.NotWritable, storage.Unreachable) as e:
    raise corpus.DataError(str(e)) from None


def main(argv: Sequence[str]) -> None:
  """python -m tfpar.data prepare --data=... --tokenizer=... --out=DIR."""
  fv = define_prepare_flags()
  if tool.parse_args(
      fv, argv, fail, doc=__doc__, command="prepare",
      usage="usage: python -m tfpar.data prepare --data=... --tokenizer=... --out=DIR"):
    return
  try:
    check_prepare_flags(fv)
  except corpus.DataError as e:
    fail(str(e))
  if tasks.spec(fv.task).labels:  # A vision task's images, not text.
    return _prepare_images(fv)
  try:  # A local SentencePiece model is read before TensorFlow is imported; keras-hub imports it.
    if tokenizer_lib.parse(fv.tokenizer)[0] == "keras_hub":
      console.import_tensorflow_quietly()
    tok = tokenizer_lib.load(fv.tokenizer)
  except tokenizer_lib.TokenizerError as e:
    fail(str(e))
  try:
    files = corpus.list_files(fv.data)  # A bad local --data refused before TensorFlow starts.
    console.import_tensorflow_quietly()
    manifest = prepare(files, tok, fv.out, num_shards=fv.num_shards, workers=fv.workers,
                       overwrite=fv.overwrite, tfrecord_key=fv.tfrecord_key)
  except (tokenizer_lib.TokenizerError, corpus.DataError) as e:
    fail(str(e))
  print(f"wrote {console.count(len(manifest['shards']), 'shard')} of {manifest['dtype']} ids, "
        f"{manifest['tokens']:,} tokens of {manifest['documents']:,} documents, to {fv.out} "
        f"({tok.spec})", flush=True)


def _prepare_images(fv) -> None:
  """A vision task's images and labels as a prepared image set."""
  if not (fv.data and fv.image_size and fv.num_classes):
    fail(f"--task={fv.task} needs --data, --image_size and --num_classes: the images, the size "
         "to decode them at, and the classes their labels count")
  console.import_tensorflow_quietly()
  from tfpar.data import image_prepared, image_records  # pylint: disable=import-outside-toplevel
  spec = tasks.spec(fv.task)
  try:
    found = image_records.examples_of(fv.data, spec, image_size=fv.image_size,
                                      channels=fv.num_channels, num_classes=fv.num_classes)
    if isinstance(found, image_prepared.ImageStream):
      fail(f"--data={fv.data} is a prepared image set already: train on it (tfpar.train "
           f"--data={fv.data}), or pass the images it was prepared from")
    manifest = image_prepared.write_images(fv.out, found, fv.task, spec.labels,
                                           class_names=found.class_names,
                                           num_shards=fv.num_shards, overwrite=fv.overwrite,
                                           progress=Progress("image", of="records"))
  except corpus.DataError as e:
    fail(str(e))
  print(f"wrote {console.count(len(manifest['shards']), 'shard')} of "
        f"{manifest['examples']:,} {fv.task} examples to {fv.out}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
