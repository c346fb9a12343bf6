"""keras-hub presets in and out: a preset directory's backbone <-> tfpar's canonical weights.

A keras-hub preset directory (what `save_to_preset` writes) holds config.json
(the backbone's class and config), model.weights.h5 and, for a task,
tokenizer.json with its assets. One module per backbone maps its config to
tfpar's model flags and its weight paths to tfpar's canonical names
(tfpar.training.checkpoint): each model family's folder holds its own
(tfpar/models/<family>/hub.py, named by its tfpar.families registration).
A run started with `--init_from=PRESET_DIR` assigns the preset's weights in the canonical layout, so any parallel plan fine-tunes
them, reading the ids of the preset's tokenizer (`tokenizer_of`: what
--tokenizer defaults to); `python -m tfpar.export --format=keras_hub` writes a
run back as a preset that keras-hub's CausalLM loads.

This module is TF-free (tfpar.config.rules calls `check` before TensorFlow starts);
tfpar.hub.preset reads and writes weights with keras-hub.
"""

import json
import os

from tfpar import families
from tfpar.config.schema import ConfigError

WEIGHTS = "model.weights.h5"
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


def _object(preset: str, name: str, value, what: str = "") -> dict:
  """`value` where it is a JSON object, else ConfigError naming the preset's file."""
  if not isinstance(value, dict):
    raise ConfigError(f"--init_from={preset}: its {name} holds {what or 'a'} "
                      f"{type(value).__name__}, not an object: pass a keras-hub preset directory "
                      "(what save_to_preset writes), or restore its files")
  return value


def backbone_of(preset: str):
  """(the tfpar.families.Family of the preset's backbone class, its keras-hub config)."""
  saved = _object(preset, "config.json", read_json(preset, "config.json"))
  name = saved.get("class_name")
  by_class = {f.hub.CLASS: f for f in families.with_hub()}
  if name not in by_class:
    raise ConfigError(f"--init_from={preset} holds a {name}, which tfpar cannot map: use a "
                      f"preset of {' or '.join(by_class)}")
  return by_class[name], _object(preset, "config.json", saved.get("config", {}),
                                 '"config": a')


def model_flags(preset: str, module, config: dict) -> dict:
  """module.flags_of(config), or ConfigError naming the key the preset's config.json lacks."""
  try:
    return module.flags_of(config)
  except KeyError as e:
    raise ConfigError(f"--init_from={preset}: its config.json lacks {e} of a {module.CLASS}: "
                      "restore the preset's config.json (what save_to_preset writes)") from None


def tokenizer_of(preset: str):
  """'keras_hub:PRESET' where the preset holds a tokenizer (what --tokenizer defaults to with
  --init_from), else None (a backbone alone, or a remote preset, read only once TF runs).

  Raises ConfigError where its tokenizer.json names files the preset lacks.
  """
  if "://" in preset or not os.path.exists(os.path.join(preset, "tokenizer.json")):
    return None
  kind = _object(preset, "tokenizer.json", read_json(preset, "tokenizer.json")).get("class_name")
  for name in TOKENIZER_FILES.get(kind, ()):
    path = os.path.join(preset, "assets", "tokenizer", name)
    if not os.path.isfile(path):
      raise ConfigError(f"--init_from={preset}: its {kind} lacks {path}: copy the whole "
                        "preset directory, assets included")
  return f"keras_hub:{preset}"


def _same_tokenizer(spec: str, own: str) -> bool:
  (kind, path), preset = spec.partition(":")[::2], own.partition(":")[2]
  return kind == "keras_hub" and os.path.abspath(path) == os.path.abspath(preset)


def check(m, preset: str) -> None:
  """The preset against the model flags m (a ModelConfig): ConfigError on the first mismatch."""
  if "://" in preset:  # gs://: checked when read.
    return
  if not os.path.isdir(preset):
    raise ConfigError(f"--init_from={preset} is not a directory: pass a keras-hub preset "
                      "directory (what save_to_preset writes)")
  family, config = backbone_of(preset)
  module = family.hub
  for key, want in module.FIXED.items():
    if config.get(key, want) != want:
      raise ConfigError(f"--init_from={preset}: its {key}={config[key]} is not what tfpar's "
                        f"{family.name} computes ({want}): use a preset with {want}")
  own = tokenizer_of(preset)
  if own is not None and not _same_tokenizer(m.tokenizer, own):
    raise ConfigError(f"--tokenizer={m.tokenizer} is not the tokenizer of --init_from={preset}, "
                      f"whose weights read its ids: drop --tokenizer (it defaults to {own})")
  weights = os.path.join(preset, WEIGHTS)
  if not os.path.isfile(weights):
    raise ConfigError(f"--init_from={preset} has no {WEIGHTS}: copy the whole preset directory "
                      "(what save_to_preset writes)")
  import h5py  # pylint: disable=import-outside-toplevel  # keras' own reader of the file, TF-free.
  try:
    h5py.File(weights, "r").close()
  except OSError as e:  # A copy cut short: "truncated file: eof = ...".
    raise ConfigError(f"--init_from={preset}: its {WEIGHTS} cannot be read ({e}): restore it "
                      "(what save_to_preset writes), or start from another preset") from None
  flags = model_flags(preset, module, config)
  ours = {**{k: getattr(m, k) for k in flags}, "num_kv_heads": m.kv_heads}
  for key, value in flags.items():
    if ours[key] != value:
      raise ConfigError(f"--{key}={ours[key]} disagrees with the {module.CLASS} of "
                        f"--init_from={preset} ({key} {value}): pass --{key}={value}")
  positions = config.get("max_sequence_length")
  if positions is not None and m.seq_len > positions:
    raise ConfigError(f"--seq_len={m.seq_len} is longer than the {positions} positions of "
                      f"--init_from={preset}: use --seq_len <= {positions}")
