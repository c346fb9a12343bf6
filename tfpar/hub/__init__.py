"""keras-hub presets in and out: a preset directory's backbone <-> tfpar's canonical weights.

A keras-hub preset directory (what `save_to_preset` writes) holds config.json
(the backbone's class and config), model.weights.h5 and, for a task,
tokenizer.json with its assets. One module per backbone maps its config to
tfpar's model flags and its weight paths to tfpar's canonical names
(tfpar.training.checkpoint): tfpar.hub.llama (LlamaBackbone), tfpar.hub.gpt2
(GPT2Backbone). A run started with `--init_from=PRESET_DIR` assigns the
preset's weights in the canonical layout, so any parallel plan fine-tunes
them; `python -m tfpar.export --format=keras_hub` writes a run back as a
preset that keras-hub's CausalLM loads.

This module is TF-free (tfpar.rules calls `check` before TensorFlow starts);
tfpar.hub.preset reads and writes weights with keras-hub.
"""

import json
import os

from tfpar.hub import gpt2, llama
from tfpar.schema import ConfigError

BACKBONES = {m.CLASS: m for m in (gpt2, llama)}
BY_ARCHITECTURE = {m.ARCHITECTURE: m for m in (gpt2, llama)}
TOKENIZER_FILES = {"LlamaTokenizer": ("vocabulary.spm",),
                   "GPT2Tokenizer": ("vocabulary.json", "merges.txt")}


def read_json(preset: str, name: str, flag: str = "init_from") -> dict:
  path = os.path.join(preset, name)
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except OSError:
    raise ConfigError(f"--{flag}={preset} has no readable {name}: pass a keras-hub preset "
                      "directory (what save_to_preset writes)") from None
  except ValueError:
    raise ConfigError(f"--{flag}={preset}: its {name} is not JSON: pass a keras-hub preset "
                      "directory (what save_to_preset writes)") from None


def backbone_of(preset: str):
  """(the tfpar.hub module of the preset's backbone class, its keras-hub config)."""
  saved = read_json(preset, "config.json")
  name = saved.get("class_name")
  if name not in BACKBONES:
    raise ConfigError(f"--init_from={preset} holds a {name}, which tfpar cannot map: use a "
                      f"preset of {' or '.join(BACKBONES)}")
  return BACKBONES[name], saved.get("config", {})


def tokenizer_vocabulary(preset: str):
  """The vocabulary size of the preset's tokenizer, or None where it has none.

  Raises ConfigError where tokenizer.json names files the preset lacks.
  """
  if not os.path.exists(os.path.join(preset, "tokenizer.json")):
    return None
  kind = read_json(preset, "tokenizer.json").get("class_name")
  files = [os.path.join(preset, "assets", "tokenizer", n) for n in TOKENIZER_FILES.get(kind, ())]
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    raise ConfigError(f"--init_from={preset}: its {kind} lacks {missing[0]}: copy the whole "
                      "preset directory, assets included")
  if kind == "LlamaTokenizer":
    import sentencepiece  # pylint: disable=import-outside-toplevel
    return sentencepiece.SentencePieceProcessor(model_file=files[0]).get_piece_size()
  if kind == "GPT2Tokenizer":
    with open(files[0], encoding="utf-8") as f:
      return len(json.load(f))
  return None


def check(m, preset: str) -> None:
  """The preset against the model flags m (a ModelConfig): ConfigError on the first mismatch."""
  if "://" in preset:  # gs://: checked when read.
    return
  if not os.path.isdir(preset):
    raise ConfigError(f"--init_from={preset} is not a directory: pass a keras-hub preset "
                      "directory (what save_to_preset writes)")
  module, config = backbone_of(preset)
  for key, want in module.FIXED.items():
    if config.get(key, want) != want:
      raise ConfigError(f"--init_from={preset}: its {key}={config[key]} is not what tfpar's "
                        f"{module.ARCHITECTURE} computes ({want}): use a preset with {want}")
  vocabulary = tokenizer_vocabulary(preset)
  if vocabulary is not None and vocabulary > m.vocab_size:
    raise ConfigError(f"--init_from={preset}: its tokenizer has {vocabulary} tokens, more than "
                      f"--vocab_size={m.vocab_size}: pass --vocab_size={vocabulary} or more")
  flags = module.flags_of(config)
  ours = {**{k: getattr(m, k) for k in flags}, "num_kv_heads": m.kv_heads}
  for key, value in flags.items():
    if ours[key] != value:
      raise ConfigError(f"--{key}={ours[key]} disagrees with the {module.CLASS} of "
                        f"--init_from={preset} ({key} {value}): pass --{key}={value}")
  positions = config.get("max_sequence_length")
  if positions is not None and m.seq_len > positions:
    raise ConfigError(f"--seq_len={m.seq_len} is longer than the {positions} positions of "
                      f"--init_from={preset}: use --seq_len <= {positions}")
