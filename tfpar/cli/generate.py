"""Sample text from a trained model.

    python -m tfpar.generate --model_dir=runs/gpt_tiny --prompt="def " --max_new_tokens=200

Wiring only: read the model flags from DIR/config.json of a --task=lm run of
`python -m tfpar.train` (through tfpar.config.rundir, as tfpar.predict and a resume
read it), rebuild the GPT, restore the weights of the latest
canonical checkpoint (no optimizer state; any parallel plan may have written
it), then sample bytes one at a time. Bad input ends with one line on stderr
and exit status 2. These few flags belong to this tool alone, so they live
here, on their own FlagValues, not among the training flags.
"""

import functools
import math
import os
import sys
from typing import Callable, List, Sequence

import numpy as np
from absl import flags

from tfpar import console, storage
from tfpar.cli import tool
from tfpar.config import rundir
from tfpar import tasks
from tfpar import tokenizer
from tfpar.config.schema import VOCAB_SIZE, ConfigError


def define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("model_dir", None, "A run directory written by tfpar.train.", flag_values=fv)
  flags.DEFINE_string("prompt", "", "Text to continue (empty: start a new document).",
                      flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", 200, "Tokens (bytes, under the default tokenizer) to sample.", flag_values=fv)
  flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 always takes the likeliest token.",
                     flag_values=fv)
  flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: all).",
                       flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Seeds sampling: the same seed gives the same text.",
                       flag_values=fv)
  return fv


class GenerateError(ValueError):
  """Input generate cannot use; the message names the flag and the fix."""


def check_run_dir(d: str) -> None:
  """--model_dir holds a --task=lm run with a checkpoint (tfpar.export asks the same)."""
  task = rundir.find_run(d, GenerateError, warn).model.task
  if tasks.spec(task).tool != "tfpar.generate":  # Say why, not "another version".
    raise GenerateError(f"--model_dir={d} holds a vision run (--task={task}), but "
                        "tfpar.generate samples text from a --task=lm run: pass the --model_dir "
                        "of one, or run python -m tfpar.predict on this one")
  if not storage.glob(os.path.join(d, "checkpoints", "ckpt-*.index")):
    raise GenerateError(f"--model_dir={d} has no checkpoint yet: train into it first "
                        f"(python -m tfpar.train --model_dir={d} ...)")


def check(fv: flags.FlagValues) -> None:
  """Validates the flags and the run directory (through tfpar.storage: gs:// works, and a local
  --model_dir is read before TensorFlow is imported)."""
  for flag in ("model_dir", "prompt"):
    line = console.not_utf8(flag, fv[flag].value)
    if line:
      raise GenerateError(line)
  check_run_dir(fv.model_dir)
  if fv.max_new_tokens < 0:
    raise GenerateError(f"--max_new_tokens={fv.max_new_tokens} must be >= 0")
  if not (math.isfinite(fv.temperature) and fv.temperature >= 0):
    raise GenerateError(f"--temperature={fv.temperature} must be a finite number >= 0 (0: greedy)")
  if not 0 <= fv.top_k <= VOCAB_SIZE:
    raise GenerateError(f"--top_k={fv.top_k} must be in [0, {VOCAB_SIZE}] (0: no top-k cut)")
  if not 0 <= fv.seed < 2 ** 64:  # numpy's generator takes any non-negative seed; 64 bits are plenty.
    raise GenerateError(f"--seed={fv.seed} must be in [0, 2^64): e.g. --seed=0")


def pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
  """Chooses the next byte from its logits [V]."""
  logits = np.asarray(logits, np.float64)
  if temperature == 0:
    return int(np.argmax(logits))
  if top_k:
    kth = np.sort(logits)[-top_k]
    logits = np.where(logits < kth, -np.inf, logits)
  # Shifted before the division: a tiny temperature (1e-310) would make logits/T infinite.
  # Then the others' (shifted, negative) logits / T may still overflow to -inf: their
  # exp is 0, which is the right answer (the maximum is all but certain), so no warning.
  with np.errstate(over="ignore"):
    p = np.exp((logits - logits.max()) / temperature)
  return int(rng.choice(len(p), p=p / p.sum()))


def sample(next_logits: Callable[[List[int]], np.ndarray], prompt: Sequence[int],
           max_new_tokens: int, *, seq_len: int, temperature: float = 0.8, top_k: int = 0,
           seed: int = 0, start: int = 0) -> List[int]:
  """Samples `max_new_tokens` tokens after `prompt`, the context cropped to the last `seq_len`.

  Args:
    next_logits: context tokens -> logits [V] of the token that follows them.
    prompt: the tokens to continue (empty: a document start).
    start: the document separator's id (the bytes tokenizer's NUL by default), the
      context of an empty prompt.
  """
  rng = np.random.default_rng(seed)
  tokens = list(prompt) or [start]
  new = []
  for _ in range(max_new_tokens):
    token = pick(next_logits(tokens[-seq_len:]), temperature, top_k, rng)
    tokens.append(token)
    new.append(token)
  return new


def load_model(model_dir: str):
  """The run's language model (GPT or Llama) and its next-token logits, for `sample`:
  (model, next_logits), the weights of the latest checkpoint restored (tfpar.cli.tool.load_run)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  _, model = tool.load_run(model_dir)
  seq_len = model.config.seq_len

  @tf.function(input_signature=[tf.TensorSpec([1, seq_len], tf.int32), tf.TensorSpec([], tf.int32)])
  def logits_at(tokens, last):
    return model(tokens)[0, last]  # [V]

  def next_logits(context: List[int]) -> np.ndarray:
    # One compiled shape for every context length: pad on the right; causality
    # keeps the padding out of the logits at the context's last position.
    padded = np.zeros((1, seq_len), np.int32)
    padded[0, :len(context)] = context
    return logits_at(padded, len(context) - 1).numpy()

  return model, next_logits


fail = functools.partial(tool.fail, "generate")
warn = functools.partial(tool.warn, "generate")


def main(argv: Sequence[str]) -> None:
  fv = define_flags()
  if tool.parse_args(fv, argv, fail, doc=__doc__):
    return
  try:
    check(fv)
  except (GenerateError, ConfigError) as e:
    fail(str(e))
  console.import_tensorflow_quietly()
  from tfpar.training.checkpoint import CheckpointMismatchError  # pylint: disable=import-outside-toplevel
  try:
    model, next_logits = load_model(fv.model_dir)
    tok = tokenizer.for_run(model.config.tokenizer, fv.model_dir)  # 'bytes' for older runs.
  except (GenerateError, tool.RunError, ConfigError, CheckpointMismatchError,
          tokenizer.TokenizerError) as e:
    fail(str(e))
  new = sample(next_logits, tok.encode(fv.prompt), fv.max_new_tokens,
               seq_len=model.config.seq_len, temperature=fv.temperature, top_k=fv.top_k,
               seed=fv.seed, start=tok.separator_id)
  print(fv.prompt + tok.decode(new), flush=True)


if __name__ == "__main__":
  main(sys.argv)
