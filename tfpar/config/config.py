"""A frozen, validated `Config` from parsed flags, before TensorFlow starts.

`from_flags(FLAGS)` is the only reader of absl flags; everything below the
entry point takes the dataclasses (or the few fields it needs). It resolves
the flags whose defaults depend on others (--warmup_steps, --jit_compile,
--xla_auto_clustering, --vocab_size from the tokenizer) and runs the rules of
tfpar.config.rules, each of which raises `ConfigError` with one line naming
the flag and the fix.
"""

import dataclasses
import json
import os
from typing import Optional, Tuple

from tfpar import console, hub, storage, tokenizer
from tfpar.config import rules as rules_lib
from tfpar.config.rules import MAX_CPU_DEVICES, validate, validate_model
from tfpar.config.rundir import RUN_CONFIG
from tfpar.config.schema import VOCAB_SIZE, Config, ConfigError, ModelConfig, settings


def _ints(values, flag: str, fix: str) -> Tuple[int, ...]:
  """A list flag's values as integers, else ConfigError: --flag=values and `fix`."""
  try:
    return tuple(int(x) for x in values)
  except ValueError:
    raise ConfigError(f"--{flag}={','.join(values)} {fix}") from None


def _warmup(f, warn) -> int:
  """--warmup_steps, or 5% of --train_steps; one at or past the end is clamped (with a warning).

  Shortening a flagfile's --train_steps for a quick try should not need a
  second edit; a warmup that never ends would leave the decay no step at all.
  """
  if f.warmup_steps is None:
    return max(1, f.train_steps // 20) if f.train_steps > 1 else 0
  if isinstance(f.train_steps, int) and 0 < f.train_steps <= f.warmup_steps:
    if warn is not None:
      warn(f"--warmup_steps={f.warmup_steps} is not below --train_steps={f.train_steps}: "
           f"warming up for {f.train_steps - 1} step(s) instead")
    return f.train_steps - 1
  return f.warmup_steps


def _section(kind, f, **resolved):
  """A section dataclass from the flags of its fields; `resolved` overrides (flag name -> value)."""
  return kind(**{s.field.name: resolved[s.flag] if s.flag in resolved else getattr(f, s.flag)
                 for s in settings(kind)})


def resumed_preset(model_dir: Optional[str]) -> Optional[dict]:
  """The model section of the run in a local --model_dir that started from a keras-hub preset
  (--init_from), else None; read before TensorFlow starts (check_run reads it again, and
  says what is wrong with a config.json that cannot be read)."""
  if not model_dir or "://" in model_dir:
    return None
  try:
    with open(os.path.join(model_dir, RUN_CONFIG), encoding="utf-8") as f:
      model = json.load(f).get("model")
  except (OSError, ValueError, AttributeError):
    return None
  return model if isinstance(model, dict) and isinstance(model.get("init_from"), str) else None


def _init_from(f, resumed: Optional[dict]) -> Optional[str]:
  """--init_from; on a resume of a run started from a preset, that preset, flag or no flag
  (the checkpoint holds its weights: the preset is read no more and may have moved)."""
  flag = getattr(f, "init_from", None)
  if resumed is not None and flag in (None, resumed["init_from"]):
    return resumed["init_from"]
  return flag


def _tokenizer(f, init_from: Optional[str], resumed: Optional[dict]) -> str:
  """--tokenizer, or the tokenizer of the --init_from preset where it holds one, or bytes; on a
  resume whose preset is gone, the tokenizer the run recorded (it keeps a copy)."""
  spec = getattr(f, "tokenizer", None)
  if spec is None and init_from:
    if resumed is not None and init_from == resumed["init_from"] and not os.path.isdir(init_from):
      return resumed.get("tokenizer") or tokenizer.BYTES
    spec = hub.tokenizer_of(init_from)
  return spec or tokenizer.BYTES


def _vocab_size(f, spec: str) -> int:
  """--vocab_size, or the tokenizer's vocabulary; one smaller than that vocabulary is refused.

  Reads a tokenizer file (through tfpar.storage) only when one is named: the
  embedding's rows must be known before the model is built. A local SentencePiece
  model needs no TensorFlow, so a refusal of it costs no TensorFlow start.
  """
  try:
    kind, path = tokenizer.parse(spec)
    if kind == tokenizer.BYTES:
      return f.vocab_size if f.vocab_size is not None else VOCAB_SIZE
    if kind != "sentencepiece" or storage.is_remote(path):
      # keras-hub (or gs://) may start TensorFlow's runtime: split the CPU first (a valid count).
      devices = getattr(f, "num_cpu_devices", 1)
      console.import_tensorflow_quietly(
          cpu_devices=devices if isinstance(devices, int) and devices <= MAX_CPU_DEVICES else 1)
    size = tokenizer.load(spec, getattr(f, "model_dir", None)).vocab_size
  except tokenizer.TokenizerError as e:
    raise ConfigError(str(e)) from None
  if f.vocab_size is not None and f.vocab_size < size:
    raise ConfigError(f"--tokenizer={spec} has {size} pieces, more than --vocab_size="
                      f"{f.vocab_size}: drop --vocab_size (it defaults to the tokenizer's) or "
                      f"pass --vocab_size >= {size}")
  return f.vocab_size if f.vocab_size is not None else size


def model_from_flags(f, resumed: Optional[dict] = None) -> ModelConfig:
  """The validated model shape alone (tfpar.plan needs no model_dir or data); `resumed`: the
  model section of the run resumed (resumed_preset)."""
  family = rules_lib.family_of(f)
  init_from = _init_from(f, resumed)
  spec = _tokenizer(f, init_from, resumed)
  m = _section(ModelConfig, f, d_ff=f.d_ff if f.d_ff is not None else 4 * f.d_model,
               tokenizer=spec, vocab_size=_vocab_size(f, spec), init_from=init_from,
               positions=f.positions or (family.positions or (ModelConfig.positions,))[0])
  validate_model(m)
  return m


def jit_compile_default(precision: str, strategy: str) -> bool:
  """--jit_compile when not passed: XLA, except for bfloat16 off TPUs.

  XLA's CPU backend turns a bfloat16 dot into converts around a float32 dot,
  while TensorFlow's own kernels reach oneDNN's bfloat16 matmuls; TPUs compile
  everything with XLA. The measurements: docs/benchmarks.md (scripts/bf16.py).
  """
  return precision != "mixed_bfloat16" or strategy == "tpu"


# Where --xla_auto_clustering=fusible is the default: the strategies whose devices are all
# this process's own (tested under them: tests/test_train.py). Across processes it is the
# user's choice, and refused with stages on other workers (tfpar.runner).
AUTO_CLUSTERING_STRATEGIES = ("one_device", "mirrored")


def auto_clustering_default(precision: str, jit_compile: bool, strategy: str) -> str:
  """--xla_auto_clustering when not passed: 'fusible' for a mixed_bfloat16 step not compiled
  whole on this process's devices (AUTO_CLUSTERING_STRATEGIES), else 'none'.

  The matmuls stay on oneDNN's bfloat16 kernels and XLA fuses the elementwise
  ops around them (docs/benchmarks.md, scripts/bf16.py).
  """
  return ("fusible" if precision == "mixed_bfloat16" and not jit_compile and
          strategy in AUTO_CLUSTERING_STRATEGIES else "none")


def from_flags(f, warn=None) -> Config:
  """Builds and validates a Config from parsed absl FLAGS (or any object with those attrs).

  `warn(text)`, when given, hears of flags adjusted rather than refused
  (a --warmup_steps past the end of training).
  """
  for s in settings():  # Before any of them is read as a path or a tokenizer.
    line = console.not_utf8(s.flag, getattr(f, s.flag, None))
    if line:
      raise ConfigError(line)
  warmup = _warmup(f, warn)
  profile_steps = None
  if f.profile_steps:
    fix = "must be two step numbers FIRST,LAST: e.g. --profile_steps=5,8"
    profile_steps = _ints(f.profile_steps, "profile_steps", fix)
    if len(profile_steps) != 2:
      raise ConfigError(f"--profile_steps={','.join(f.profile_steps)} {fix}")
  stage_layers = None
  if f.stage_layers:
    stage_layers = _ints(f.stage_layers, "stage_layers", "is not a list of integers: write "
                         "blocks per stage, e.g. --stage_layers=3,3,2")
  if not f.model_dir:
    raise ConfigError("--model_dir is not set: pass --model_dir=DIR for checkpoints and metrics")
  # The flags from_flags resolves; every other field is its flag's value.
  jit = f.jit_compile if f.jit_compile is not None else jit_compile_default(f.precision,
                                                                           f.strategy)
  resolved = {"warmup_steps": warmup, "profile_steps": profile_steps,
              "stage_layers": stage_layers, "jit_compile": jit,
              "xla_auto_clustering": f.xla_auto_clustering or auto_clustering_default(
                  f.precision, jit, f.strategy)}
  sections = {s.name: _section(s.default.__class__, f, **resolved)
              for s in dataclasses.fields(Config) if s.name != "model"}
  resumed = resumed_preset(f.model_dir)
  cfg = Config(model=model_from_flags(f, resumed), **sections)
  validate(cfg, resumed=resumed is not None)
  return cfg
