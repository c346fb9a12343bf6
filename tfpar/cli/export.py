"""Write a trained language model out as a keras-hub preset.

    python -m tfpar.export --model_dir=runs/llama_tiny --format=keras_hub --out=presets/llama_tiny

then, anywhere keras-hub runs: `keras_hub.models.LlamaCausalLM.from_preset("presets/llama_tiny")`
(GPT2CausalLM for --architecture=gpt). Wiring only: the run is found and its
latest checkpoint restored as every tool does (tfpar.cli.tool.load_run) (any parallel plan may
have written it), its canonical weights mapped to the backbone's
(tfpar.hub), and keras-hub's `save_to_preset` writes the directory. The
CausalLM's preprocessor holds the run's tokenizer as keras-hub's
(tfpar.tokenizer's `to_keras_hub`): a preset's own (--init_from), the run's
copy of its SentencePiece model as a LlamaTokenizer, or bytes as a GPT-2
byte-level tokenizer with the same ids. Bad input ends with one line on
stderr and exit status 2, before anything is written.
"""

import functools
import os
import sys
from typing import Sequence

from absl import flags

from tfpar import console, storage, tokenizer
from tfpar.cli import generate, tool
from tfpar.config.schema import ConfigError

FORMATS = ("keras_hub",)


def define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("model_dir", None, "A --task=lm run directory written by tfpar.train.",
                      flag_values=fv)
  flags.DEFINE_enum("format", "keras_hub", FORMATS, "What to write: a keras-hub preset "
                    "directory (GPT2Backbone or LlamaBackbone, and the CausalLM's tokenizer).",
                    flag_values=fv)
  flags.DEFINE_string("out", None, "The preset directory to write (new or empty).",
                      flag_values=fv)
  return fv


fail = functools.partial(tool.fail, "export")


def check_out(out) -> None:
  """--out, before the weights are read: a new or empty directory that can be made (not under
  /proc or a file) on a store that answers (an unreachable gs:// is bad input here, exit 2: a
  person runs export, and nothing retries it)."""
  if not out:
    raise ConfigError("--out is not set: pass --out=DIR, the preset directory to write")
  try:  # First: the questions below would raise TensorFlow's own error on a store out of reach.
    storage.check_output(out, "out", directory=True)
  except (storage.NotWritable, storage.Unreachable) as e:
    raise ConfigError(str(e)) from None
  if storage.exists(out) and (not storage.isdir(out) or storage.listdir(out)):
    raise ConfigError(f"--out={out} exists and is not an empty directory: pass a new one")


def export(model_dir: str, out: str) -> str:
  """Writes the run's latest weights to the preset `out`; returns the CausalLM class to load it."""
  from tfpar.hub import preset  # pylint: disable=import-outside-toplevel
  from tfpar.training import checkpoint  # pylint: disable=import-outside-toplevel
  _, model = tool.load_run(model_dir)
  m = model.config
  hub_tokenizer = tokenizer.for_run(m.tokenizer, model_dir).to_keras_hub()
  weights = checkpoint.read_canonical(checkpoint.model_layout(model))
  return preset.save(m, weights, out, hub_tokenizer)


def main(argv: Sequence[str]) -> None:
  fv = define_flags()
  if tool.parse_args(fv, argv, fail, doc=__doc__):
    return
  try:  # Through tfpar.storage: a local path is checked before TensorFlow is imported.
    generate.check_run_dir(fv.model_dir)
    check_out(fv.out)
  except (generate.GenerateError, ConfigError) as e:
    fail(str(e))
  console.import_tensorflow_quietly()
  from tfpar.training.checkpoint import CheckpointMismatchError  # pylint: disable=import-outside-toplevel
  try:
    task = export(fv.model_dir, fv.out)
  except (generate.GenerateError, tool.RunError, ConfigError, CheckpointMismatchError,
          tokenizer.TokenizerError) as e:
    fail(str(e))
  print(f"tfpar.export: wrote {os.path.join(fv.out, '')} (keras_hub.models.{task}.from_preset)",
        flush=True)


if __name__ == "__main__":
  main(sys.argv)
