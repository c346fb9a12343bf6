"""Tokenizers: text <-> int32 ids, named by one spec string (what config.json records).

    python -m tfpar.tokenizer train --vocab_size=2000 --out=/tmp/stdlib.model   # embedded corpus
    python -m tfpar.tokenizer train --data='docs/*.txt' --vocab_size=8000 --out=gs://b/t.model

Specs `load` accepts:
  'bytes'                    byte-level, 256 ids, no file (tfpar's default and every
                             run before tokenizers were recorded).
  'sentencepiece:PATH'       a SentencePiece .model file, read through tf.io.gfile (gs://
                             works) and handed to sentencepiece as serialized bytes.
  'keras_hub:PRESET_DIR'     the tokenizer saved in a keras-hub preset directory
                             (keras_hub.tokenizers.Tokenizer.from_preset).

Documents are packed into one stream (tfpar.data.pipeline) with a separator
between them: NUL for bytes, the end-of-sequence id for the others.

`train` fits a SentencePiece BPE model (the `sentencepiece` package) on the
corpus tfpar.train would read (--data, default: the embedded standard library
source), with the normalisation that keeps code as it is (no whitespace
folding, no dummy prefix) and byte fallback (any text encodes, nothing is
<unk>). It prints bytes per token on the corpus, the number that turns a loss
per token into one per byte.
"""

import hashlib
import io
import os
import re
from typing import Iterable, Optional, Sequence

import numpy as np

from tfpar import storage
from tfpar.data import corpus

BYTES = "bytes"
KINDS = ("bytes", "sentencepiece:PATH", "keras_hub:PRESET_DIR")


class TokenizerError(ValueError):
  """A tokenizer spec or file that cannot be used; the message names it and the fix."""


class Tokenizer:
  """Text <-> ids. Attributes: spec (as config.json records it), vocab_size, separator_id,
  fingerprint (sha256 of what defines its ids: the model file's bytes, not its path)."""

  spec: str
  vocab_size: int
  separator_id: int
  fingerprint: str = hashlib.sha256(b"bytes").hexdigest()

  def encode_pieces(self, pieces: Iterable[bytes]) -> np.ndarray:
    """A document's int32 ids from its pieces (tfpar.data.corpus.pieces), encoded one by one, so
    a document of any length costs the tokenizer's memory for one piece (<= 1 MiB) at a time."""
    ids = [self.encode_piece(p) for p in pieces]
    return np.concatenate(ids) if ids else np.zeros([0], np.int32)

  def encode_piece(self, piece: bytes) -> np.ndarray:
    """One piece's int32 ids (invalid UTF-8 is replaced)."""
    return self.encode(piece.decode("utf-8", "replace"))

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 ids [n]."""
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    """Ids -> text; the separator and ids no text maps to are dropped."""
    raise NotImplementedError

  def to_keras_hub(self):
    """The same tokenizer as a keras-hub tokenizer (what tfpar.export puts in a preset)."""
    raise NotImplementedError

  def stream_bytes_per_token(self, ids: np.ndarray) -> float:
    """UTF-8 bytes per id of a packed stream (a separator counts as the NUL byte it stands for)."""
    ids = np.asarray(ids)
    n_bytes = len(self.decode(ids).encode("utf-8")) + int(np.sum(ids == self.separator_id))
    return n_bytes / max(len(ids), 1)

  def bytes_per_token(self, texts: Iterable[str]) -> float:
    """UTF-8 bytes per id over `texts`: loss per token / this = loss per byte."""
    n_bytes = n_ids = 0
    for text in texts:
      n_bytes += len(text.encode("utf-8"))
      n_ids += len(self.encode(text))
    return n_bytes / max(n_ids, 1)


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0..255 (tfpar.data.corpus's encoding)."""

  spec, vocab_size, separator_id = BYTES, 256, corpus.DOC_SEPARATOR[0]

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def encode_piece(self, piece: bytes) -> np.ndarray:
    return np.frombuffer(piece, np.uint8).astype(np.int32)  # The bytes as they are.

  def decode(self, ids: Sequence[int]) -> str:
    return corpus.decode(ids)

  def to_keras_hub(self):
    """A GPT2Tokenizer whose ids are these bytes' on any text without NUL.

    GPT-2's byte-level BPE maps each byte to a printable character
    (bytes_to_unicode); with these 256 characters as its vocabulary at their
    byte values and no merge that can apply, every byte of a text is its own
    token. keras-hub needs two more things: its end token '<|endoftext|>' in
    the vocabulary, which takes id 0 (tfpar's document separator, the NUL byte
    that tfpar.data strips out of documents), and at least one merge, whose
    two parts and result it requires in the vocabulary: bytes 0xFD and 0xFE
    (never in UTF-8 text), merged into id 255, the place of byte 0xFF (never in
    UTF-8 text either).
    """
    import keras_hub  # pylint: disable=import-outside-toplevel
    from keras_hub.src.tokenizers.byte_pair_tokenizer import bytes_to_unicode  # pylint: disable=import-outside-toplevel
    char = {b[0]: c for b, c in zip(*bytes_to_unicode())}
    vocabulary = {"<|endoftext|>": 0, **{char[b]: b for b in range(1, 255)},
                  char[0xFD] + char[0xFE]: 255}
    return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary,
                                          merges=[f"{char[0xFD]} {char[0xFE]}"])


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model from its serialized bytes."""

  def __init__(self, spec: str, model_proto: bytes):
    import sentencepiece  # pylint: disable=import-outside-toplevel
    self.spec, self.proto = spec, model_proto
    sentencepiece.set_min_log_level(1)  # Not its INFO line on an identity normalisation.
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(model_proto)
    except RuntimeError:
      raise TokenizerError(f"--tokenizer={spec}: the file is not a SentencePiece model: pass a "
                           ".model file (python -m tfpar.tokenizer train writes one)") from None
    self.vocab_size = self._sp.get_piece_size()
    self.fingerprint = hashlib.sha256(model_proto).hexdigest()
    eos = self._sp.eos_id()
    self.separator_id = eos if eos >= 0 else self._sp.unk_id()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def to_keras_hub(self):
    """keras-hub's LlamaTokenizer of this model (it needs the pieces <s> and </s>)."""
    import keras_hub  # pylint: disable=import-outside-toplevel
    try:
      return keras_hub.models.LlamaTokenizer(proto=self.proto)
    except ValueError as e:
      raise TokenizerError(f"--tokenizer={self.spec}: keras-hub's LlamaTokenizer refuses it "
                           f"({str(e).splitlines()[0][:160]}): train one with python -m "
                           "tfpar.tokenizer train, which has them") from None


class KerasHubTokenizer(Tokenizer):
  """The tokenizer of a keras-hub preset directory (its tokenizer.json and assets)."""

  def __init__(self, spec: str, preset_dir: str):
    import keras_hub  # pylint: disable=import-outside-toplevel
    self.spec = spec
    try:
      self._tok = keras_hub.tokenizers.Tokenizer.from_preset(preset_dir)
    except (ValueError, OSError, FileNotFoundError) as e:
      raise TokenizerError(f"--tokenizer={spec}: no keras-hub tokenizer there "
                           f"({str(e).splitlines()[0][:160]}): pass a preset directory written "
                           "by save_to_preset") from None
    self.vocab_size = int(self._tok.vocabulary_size())
    self.fingerprint = _tree_sha256(preset_dir)
    end = getattr(self._tok, "end_token_id", None)
    self.separator_id = int(end) if end is not None else 0

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.tokenize(text), np.int32).reshape(-1)

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids if int(i) != self.separator_id]
    out = self._tok.detokenize(np.asarray(ids, np.int32))
    out = out.numpy() if hasattr(out, "numpy") else out
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)

  def to_keras_hub(self):
    return self._tok


def _tree_sha256(preset_dir: str) -> str:
  """sha256 over a preset's tokenizer: tokenizer.json and the files under assets/ (names and
  bytes), not its weights."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  paths = [os.path.join(preset_dir, "tokenizer.json")]
  assets = os.path.join(preset_dir, "assets")
  if tf.io.gfile.isdir(assets):
    paths += [os.path.join(root, name) for root, _, names in tf.io.gfile.walk(assets)
              for name in names]
  digest = hashlib.sha256()
  for path in sorted(p for p in paths if storage.exists(p)):
    digest.update(os.path.relpath(path, preset_dir).encode() + b"\0")
    digest.update(hashlib.sha256(storage.read_bytes(path)).digest())
  return digest.hexdigest()


def parse(spec: Optional[str]):
  """(kind, path) of a spec, without reading anything; raises TokenizerError naming the fix."""
  if spec in (None, "", BYTES):
    return BYTES, ""
  kind, _, path = spec.partition(":")
  if kind not in ("sentencepiece", "keras_hub") or not path:
    raise TokenizerError(f"--tokenizer={spec} is not a tokenizer: pass one of {', '.join(KINDS)}")
  return kind, path


def load(spec: Optional[str], model_dir: Optional[str] = None) -> Tokenizer:
  """The tokenizer a spec names (None or '' mean 'bytes', as in an older config.json); a
  keras-hub preset that is gone, from the copy in the run `model_dir` (copy_into) where there."""
  kind, path = parse(spec)
  if kind == BYTES:
    return ByteTokenizer()
  if kind == "keras_hub" and model_dir and not storage.exists(path):
    preset = os.path.join(model_dir, RUN_PRESET)
    if storage.exists(preset):
      return KerasHubTokenizer(spec, preset)
  if not storage.exists(path):
    raise TokenizerError(f"--tokenizer={spec}: {path} does not exist: train one with python -m "
                         "tfpar.tokenizer train --out=PATH, or pass the path of yours")
  if kind == "sentencepiece":
    return SentencePieceTokenizer(spec, storage.read_bytes(path))
  return KerasHubTokenizer(spec, path)


RUN_COPY = "tokenizer.model"  # A run's own copy of its SentencePiece model, in --model_dir.
RUN_PRESET = "tokenizer_preset"  # A run's own copy of its keras-hub tokenizer, in --model_dir.


def copy_into(spec: str, model_dir: str) -> None:
  """Copies the run's tokenizer into its directory, so that the run (moved, or its tokenizer's
  original moved or deleted) still reads and decodes its ids: a SentencePiece model as
  RUN_COPY, a keras-hub preset's tokenizer.json, assets/tokenizer/ and config.json under RUN_PRESET."""
  kind, path = parse(spec)
  if kind == "sentencepiece":
    storage.write_atomically(os.path.join(model_dir, RUN_COPY), storage.read_bytes(path))
  elif kind == "keras_hub" and not storage.exists(os.path.join(model_dir, RUN_PRESET)):
    # keras-hub reads config.json (and metadata.json) too to know it a preset.
    names = [n for n in ("config.json", "metadata.json") if storage.exists(os.path.join(path, n))]
    names += ["tokenizer.json"] + [os.path.join("assets", "tokenizer", os.path.basename(f))
                                   for f in storage.glob(os.path.join(path, "assets", "tokenizer", "*"))]
    for name in names:
      storage.makedirs(os.path.dirname(os.path.join(model_dir, RUN_PRESET, name)))
      storage.write_atomically(os.path.join(model_dir, RUN_PRESET, name),
                               storage.read_bytes(os.path.join(path, name)))


def for_run(spec: Optional[str], model_dir: str) -> Tokenizer:
  """The tokenizer of the run in `model_dir` that recorded `spec`: its own copy of a
  SentencePiece model where there, of a keras-hub preset's where the preset is gone."""
  kind, _ = parse(spec)
  copy = os.path.join(model_dir, RUN_COPY)
  if kind == "sentencepiece" and storage.exists(copy):
    try:
      return SentencePieceTokenizer(spec, storage.read_bytes(copy))
    except TokenizerError:  # The run's copy, not the original (which may well be intact).
      raise TokenizerError(f"--model_dir={model_dir}: the run's own copy of its tokenizer, "
                           f"{copy}, is not a SentencePiece model: copy {parse(spec)[1]} (what "
                           f"the run was started with, --tokenizer={spec}) over it") from None
  return load(spec, model_dir)


def corpus_lines(files: Sequence[str], tfrecord_key: str = "text") -> Iterable[str]:
  """The corpus's documents, line by line (SentencePiece trains on sentences), with a
  progress bar over the files."""
  import keras  # pylint: disable=import-outside-toplevel
  bar = keras.utils.Progbar(len(files), unit_name="file")
  for i, path in enumerate(files):
    for doc in corpus.read_documents(path, tfrecord_key):
      for line in doc.decode("utf-8", "replace").splitlines():
        if line.strip():
          yield line
    bar.update(i + 1)


def train(files: Sequence[str], *, vocab_size: int, out: str,
          tfrecord_key: str = "text") -> SentencePieceTokenizer:
  """Trains a SentencePiece BPE model on `files` and writes it to `out` (through gfile).

  One trainer thread: the same corpus gives the same model.
  """
  import sentencepiece  # pylint: disable=import-outside-toplevel
  if os.path.dirname(out):
    storage.makedirs(os.path.dirname(out))
  model = io.BytesIO()
  try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines(files, tfrecord_key)), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True,
        max_sentence_length=1 << 14, character_coverage=1.0, num_threads=1, minloglevel=2)
  except RuntimeError as e:
    raise TokenizerError(_train_failure(vocab_size, str(e))) from None
  storage.write_atomically(out, model.getvalue())
  return SentencePieceTokenizer(f"sentencepiece:{out}", model.getvalue())


MAX_VOCAB_SIZE = 2 ** 31 - 1  # SentencePiece's vocab_size is an int32.


def _train_failure(vocab_size: int, text: str) -> str:
  """One line for SentencePiece's refusal: too few pieces for the text's characters (every
  character is a piece: ask for more), or more than the text holds (ask for fewer)."""
  line = text.splitlines()[0]
  few = re.search(r"smaller than required_chars\. \d+ vs (\d+)", line)
  if few:
    return (f"--vocab_size={vocab_size} is smaller than the {few.group(1)} characters and control "
            f"pieces of the text, each a piece of its own: pass a larger --vocab_size "
            f"(>= {few.group(1)})")
  many = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", line)
  if many:
    return (f"--vocab_size={vocab_size} is more pieces than this text can make: pass "
            f"--vocab_size <= {many.group(1)}, or more text")
  return f"cannot train a vocabulary of {vocab_size}: {line[:200]}"
