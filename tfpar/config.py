"""Frozen, validated configuration built from flags before TensorFlow starts.

`from_flags(FLAGS)` is the only reader of absl flags; everything below the
entry point takes these dataclasses (or the few fields it needs).

This module is tfpar's one validator of input. Every rule raises `ConfigError`
with one line naming the flag and the fix, and runs before TensorFlow starts:
  * `validate(cfg)` (called by `from_flags`): the flags alone;
  * `check_run(cfg, cluster)`: what the flags meet on this machine: the
    --model_dir on disk (a file, not writable, or a run started with other
    flags that a resume must keep) and the job's TF_CONFIG (workers, ps tasks;
    `check_cluster`, which tfpar.train calls before TensorFlow even starts).
The rules a model-parallel plan must obey are functions here that
tfpar.parallel.plan calls again with the real devices, not a second copy.
What can only be found while reading (a TFRecord whose records are not
tf.train.Example) fails later, with the same one line and exit status 2.
"""

import dataclasses
import glob
import json
import math
import os
import tempfile
from typing import Optional, Tuple

from tfpar import storage
from tfpar.console import count

VOCAB_SIZE = 256  # Byte-level tokens: no vocabulary file, nothing to download.
# --task=classify's built-in data, scikit-learn's digits: 8x8 greyscale scans of 0-9.
DIGITS_IMAGE_SIZE, DIGITS_CHANNELS, DIGITS_CLASSES = 8, 1, 10
# What the image readers (tf.io.decode_image) decode --data to: grey, RGB, RGBA (not JPEG).
IMAGE_CHANNELS = (1, 3, 4)
MAX_INT = 2 ** 31 - 1  # TensorFlow counts steps, shapes and batches in int32 in places.
MAX_SEED = 2 ** 32 - 1  # numpy and tf.random take seeds in [0, 2^32).
# Logical CPU devices share the host's cores (they test correctness, not speed)
# and each gets its own thread pools: 64 covers every plan a test or a laptop
# run needs; more is a typo that would start thousands of threads.
MAX_CPU_DEVICES = 64
MAX_COLLECTIVE_TIMEOUT = 24 * 3600  # A day: longer than any save or restart should take.
ON_NONFINITE = ("stop", "skip")
# Flags a resumed run must keep: the model, and what fixes the data order
# (tfpar.data.pipeline reads position step * global_batch_size under seed).
RESUME_FIXED = ("global_batch_size", "seed")


class ConfigError(ValueError):
  """A flag combination that cannot work; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  task: str = "lm"  # What is learned (tfpar.tasks): it decides the model, data and loss.
  vocab_size: int = VOCAB_SIZE
  seq_len: int = 128
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 4
  d_ff: int = 512
  dropout: float = 0.0
  positions: str = "learned"
  # Vision tasks (a ViT on image patches; unused by --task=lm).
  image_size: int = 8
  patch_size: int = 2
  num_channels: int = 1
  num_classes: int = 10
  pooling: str = "cls"

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class DataConfig:
  data: Optional[str] = None  # None: the embedded default corpus.
  tfrecord_key: str = "text"
  eval_fraction: float = 0.05
  input_sharding: str = "auto"
  max_shift: int = 1  # Images: random shift of up to this many pixels in training.
  random_flip: bool = False  # Images: random left-right flips in training.


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model_dir: str = "runs/default"
  train_steps: int = 200
  global_batch_size: int = 16
  seed: int = 0
  log_every: int = 10
  eval_every: int = 100
  eval_steps: int = 4
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  steps_per_call: int = 10
  precision: str = "float32"
  jit_compile: bool = True
  on_nonfinite: str = "stop"  # "stop" or "skip": see tfpar.training.loop
  profile_steps: Optional[Tuple[int, int]] = None  # (first, last) traced with tf.profiler


@dataclasses.dataclass(frozen=True)
class DistConfig:
  strategy: str = "one_device"
  num_cpu_devices: int = 1
  collective: str = "auto"
  collective_timeout: int = 300
  tpu: str = "local"
  ps_shards: int = 1
  all_reduce_pack_mb: float = 0.0  # 0: TensorFlow picks the pack size.


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
  """How the data-parallel gradient all-reduce is compressed (tfpar.parallel.compression)."""
  method: str = "none"  # none | fp16 | bf16 | powersgd
  rank: int = 4
  warmup_steps: int = 0
  min_size: int = 1024  # PowerSGD sends smaller matrices uncompressed.


COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  pipeline_stages: int = 1
  microbatches: int = 1
  stage_layers: Optional[Tuple[int, ...]] = None
  tensor_parallel: int = 1
  data_parallel: Optional[int] = None
  remat: bool = False

  @property
  def model_parallel(self) -> bool:
    """True when the model itself is split (pipeline, tensor, or an explicit plan)."""
    return (self.pipeline_stages > 1 or self.tensor_parallel > 1 or self.remat
            or self.data_parallel is not None or self.microbatches > 1)


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  dist: DistConfig = DistConfig()
  parallel: ParallelConfig = ParallelConfig()
  compression: CompressionConfig = CompressionConfig()

  def replace(self, **sections) -> "Config":
    """Returns a copy with fields replaced, e.g. `cfg.replace(train={"train_steps": 5})`."""
    updated = {name: dataclasses.replace(getattr(self, name), **fields)
               for name, fields in sections.items()}
    return dataclasses.replace(self, **updated)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def model_from_flags(f) -> ModelConfig:
  """The validated model shape alone (tfpar.plan needs no model_dir or data)."""
  d_ff = f.d_ff if f.d_ff is not None else 4 * f.d_model
  m = ModelConfig(task=f.task, vocab_size=f.vocab_size, seq_len=f.seq_len,
                  num_layers=f.num_layers, d_model=f.d_model, num_heads=f.num_heads, d_ff=d_ff,
                  dropout=f.dropout, positions=f.positions, image_size=f.image_size,
                  patch_size=f.patch_size, num_channels=f.num_channels,
                  num_classes=f.num_classes, pooling=f.pooling)
  validate_model(m)
  return m


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


def from_flags(f, warn=None) -> Config:
  """Builds and validates a Config from parsed absl FLAGS (or any object with those attrs).

  `warn(text)`, when given, hears of flags adjusted rather than refused
  (a --warmup_steps past the end of training).
  """
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
  cfg = Config(
      model=model_from_flags(f),
      data=DataConfig(data=f.data, tfrecord_key=f.tfrecord_key, eval_fraction=f.eval_fraction,
                      input_sharding=f.input_sharding, max_shift=f.max_shift,
                      random_flip=f.random_flip),
      optim=OptimConfig(learning_rate=f.learning_rate, warmup_steps=warmup,
                        min_lr_ratio=f.min_lr_ratio, weight_decay=f.weight_decay,
                        clip_norm=f.clip_norm),
      train=TrainConfig(model_dir=f.model_dir, train_steps=f.train_steps,
                        global_batch_size=f.global_batch_size, seed=f.seed,
                        log_every=f.log_every, eval_every=f.eval_every, eval_steps=f.eval_steps,
                        checkpoint_every=f.checkpoint_every, keep_checkpoints=f.keep_checkpoints,
                        steps_per_call=f.steps_per_call, precision=f.precision,
                        jit_compile=f.jit_compile, on_nonfinite=f.on_nonfinite,
                        profile_steps=profile_steps),
      dist=DistConfig(strategy=f.strategy, num_cpu_devices=f.num_cpu_devices,
                      collective=f.collective, collective_timeout=f.collective_timeout,
                      tpu=f.tpu, ps_shards=f.ps_shards,
                      all_reduce_pack_mb=f.all_reduce_pack_mb),
      parallel=ParallelConfig(pipeline_stages=f.pipeline_stages, microbatches=f.microbatches,
                              stage_layers=stage_layers, tensor_parallel=f.tensor_parallel,
                              data_parallel=f.data_parallel, remat=f.remat),
      compression=CompressionConfig(method=f.grad_compression, rank=f.powersgd_rank,
                                    warmup_steps=f.powersgd_warmup_steps,
                                    min_size=f.powersgd_min_size),
  )
  validate(cfg)
  return cfg


def _positive(value, flag, fix="pass a positive integer"):
  if value is None or value <= 0:
    raise ConfigError(f"--{flag}={value} must be positive: {fix}")


def _check_data_path(path: str):
  if "://" in path:  # gs://, hdfs://: checked by tf.io.gfile when read.
    return
  if os.path.isdir(path):
    if not os.access(path, os.R_OK | os.X_OK):
      raise ConfigError(f"--data={path} is a directory this user cannot read: fix its "
                        "permissions or pass another --data")
    return
  matches = glob.glob(path)
  if not matches:
    raise ConfigError(f"--data={path} matches no file or directory: "
                      "pass an existing text file, directory, glob or TFRecord shards")
  for match in matches:
    if not os.path.isdir(match) and not (os.path.isfile(match) and os.access(match, os.R_OK)):
      raise ConfigError(f"--data={path}: {match} cannot be read (a broken link, or no read "
                        "permission): fix or remove it, or pass another --data")


def _finite_floats(cfg: Config) -> None:
  for section in (cfg.model, cfg.data, cfg.optim):
    for field in dataclasses.fields(section):
      value = getattr(section, field.name)
      if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"--{field.name}={value} is not a finite number: pass a real value "
                          f"(default {field.default})")


def _bounded_ints(cfg: Config) -> None:
  for section in (cfg.model, cfg.train, cfg.dist, cfg.parallel):
    for field in dataclasses.fields(section):
      value = getattr(section, field.name)
      if type(value) is int and field.name != "seed" and abs(value) > MAX_INT:  # pylint: disable=unidiomatic-typecheck
        raise ConfigError(f"--{field.name}={value} is too large: it must be below 2^31")


def validate_model(m: ModelConfig) -> None:
  """Raises ConfigError naming the first model flag that cannot work."""
  for value, flag in ((m.seq_len, "seq_len"), (m.num_layers, "num_layers"),
                      (m.d_model, "d_model"), (m.num_heads, "num_heads"), (m.d_ff, "d_ff")):
    _positive(value, flag)
  if m.vocab_size < VOCAB_SIZE:
    raise ConfigError(f"--vocab_size={m.vocab_size} is smaller than the {VOCAB_SIZE} byte values "
                      f"the data pipeline feeds: use --vocab_size >= {VOCAB_SIZE}")
  if m.d_model % m.num_heads:
    raise ConfigError(f"--num_heads={m.num_heads} does not divide --d_model={m.d_model}: "
                      "pick a head count that divides d_model (e.g. 4 or 8 for 256)")
  if m.positions == "rotary" and (m.d_model // m.num_heads) % 2:
    raise ConfigError(f"--positions=rotary needs an even head size, got "
                      f"d_model/num_heads={m.d_model // m.num_heads}: change --num_heads")
  if m.task != "lm":
    _validate_vision(m)
  if not 0.0 <= m.dropout < 1.0:
    raise ConfigError(f"--dropout={m.dropout} must be in [0, 1): e.g. --dropout=0.1")


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first flag that cannot work, and how to fix it."""
  m, d, o, t, s, p = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.dist, cfg.parallel
  _finite_floats(cfg)
  if not 0 <= t.seed <= MAX_SEED:
    raise ConfigError(f"--seed={t.seed} must be in [0, 2^32-1]: e.g. --seed=0")
  _bounded_ints(cfg)
  validate_model(m)
  if m.task != "lm":
    _validate_vision_data(m, d)
  for value, flag in ((t.train_steps, "train_steps"), (t.global_batch_size, "global_batch_size"),
                      (t.log_every, "log_every"), (t.checkpoint_every, "checkpoint_every"),
                      (t.keep_checkpoints, "keep_checkpoints"), (t.steps_per_call, "steps_per_call"),
                      (s.num_cpu_devices, "num_cpu_devices"), (s.ps_shards, "ps_shards"),
                      (p.pipeline_stages, "pipeline_stages"), (p.microbatches, "microbatches"),
                      (p.tensor_parallel, "tensor_parallel")):
    _positive(value, flag)
  if t.profile_steps and not 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.train_steps:
    raise ConfigError(f"--profile_steps={t.profile_steps[0]},{t.profile_steps[1]} must satisfy "
                      f"1 <= FIRST <= LAST <= --train_steps={t.train_steps}: e.g. "
                      f"--profile_steps={min(5, t.train_steps)},{min(8, t.train_steps)}")
  if t.eval_every < 0 or t.eval_steps < 0:
    raise ConfigError("--eval_every and --eval_steps must be >= 0: use 0 to evaluate only at the end")
  if not 0.0 < d.eval_fraction < 0.5:
    raise ConfigError(f"--eval_fraction={d.eval_fraction} must be in (0, 0.5): e.g. 0.05")
  if d.data is not None:
    _check_data_path(d.data)
  if o.learning_rate <= 0:
    raise ConfigError(f"--learning_rate={o.learning_rate} must be positive: e.g. 1e-3")
  if o.warmup_steps < 0 or o.warmup_steps >= t.train_steps:  # from_flags clamps a long one.
    raise ConfigError(f"--warmup_steps={o.warmup_steps} must be in [0, train_steps="
                      f"{t.train_steps}): shorten the warmup or train longer")
  if not 0.0 <= o.min_lr_ratio <= 1.0:
    raise ConfigError(f"--min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
  if o.weight_decay < 0:
    raise ConfigError(f"--weight_decay={o.weight_decay} must be >= 0")
  if o.clip_norm < 0:
    raise ConfigError(f"--clip_norm={o.clip_norm} must be >= 0 (0 disables clipping)")
  if t.on_nonfinite not in ON_NONFINITE:
    raise ConfigError(f"--on_nonfinite={t.on_nonfinite} is unknown: use stop or skip")
  if not 0 < s.collective_timeout <= MAX_COLLECTIVE_TIMEOUT:
    raise ConfigError(f"--collective_timeout={s.collective_timeout} must be in (0, "
                      f"{MAX_COLLECTIVE_TIMEOUT}] seconds: a dead peer must end the job, "
                      "not hang it; e.g. 300")
  if s.num_cpu_devices > MAX_CPU_DEVICES:
    raise ConfigError(f"--num_cpu_devices={s.num_cpu_devices} is more than {MAX_CPU_DEVICES}: "
                      "logical CPUs share the host's cores; use at most the devices a plan needs")
  if s.strategy in ("one_device", "parameter_server", "tpu") and s.num_cpu_devices > 1 \
      and not p.model_parallel:
    raise ConfigError(f"--num_cpu_devices={s.num_cpu_devices} is unused by --strategy={s.strategy}: "
                      "use --strategy=mirrored to train on the logical devices")
  if t.precision == "mixed_float16" and s.strategy == "tpu":
    raise ConfigError("--precision=mixed_float16 is not for TPUs: use --precision=mixed_bfloat16")
  if s.strategy == "mirrored" and not p.model_parallel:
    # On a CPU host the replicas are the logical CPUs (on GPUs the engine checks again).
    check_batch(t.global_batch_size, s.num_cpu_devices)
  _validate_parallel(cfg)
  _validate_compression(cfg)


def _validate_vision(m: ModelConfig) -> None:
  """The ViT's shape (tfpar.plan checks it too, with no data)."""
  for value, flag in ((m.image_size, "image_size"), (m.patch_size, "patch_size"),
                      (m.num_channels, "num_channels"), (m.num_classes, "num_classes")):
    _positive(value, flag)
  if m.image_size % m.patch_size:
    raise ConfigError(f"--image_size={m.image_size} is not divisible by --patch_size="
                      f"{m.patch_size}: pick a patch size that divides the image size "
                      f"(e.g. --patch_size=2 for --image_size=8)")
  if m.positions != "learned":
    raise ConfigError(f"--positions={m.positions} is for --task=lm: a ViT learns its patch "
                      "positions; drop the flag")


def _validate_vision_data(m: ModelConfig, d: DataConfig) -> None:
  """What a vision task's data needs of the model and the augmentation flags."""
  if d.max_shift < 0:
    raise ConfigError(f"--max_shift={d.max_shift} must be >= 0 (0: no shifts)")
  if d.data is not None and m.num_channels not in IMAGE_CHANNELS:
    # Else the reader fails on the first image and seems to blame it.
    raise ConfigError(f"--num_channels={m.num_channels} is not a channel count images decode "
                      "to: use 1 (greyscale), 3 (RGB) or 4 (RGBA, PNG only)")
  if m.task == "classify" and d.data is None:  # The built-in digits.
    if (m.image_size, m.num_channels) != (DIGITS_IMAGE_SIZE, DIGITS_CHANNELS):
      raise ConfigError(f"--image_size={m.image_size} --num_channels={m.num_channels} do not fit "
                        f"the built-in digits ({DIGITS_IMAGE_SIZE}x{DIGITS_IMAGE_SIZE} "
                        f"greyscale): use --image_size={DIGITS_IMAGE_SIZE} --num_channels="
                        f"{DIGITS_CHANNELS}, or pass --data")
    if m.num_classes < DIGITS_CLASSES:
      raise ConfigError(f"--num_classes={m.num_classes} cannot hold the built-in digits' class "
                        f"ids 0..{DIGITS_CLASSES - 1}: use --num_classes={DIGITS_CLASSES}")
  if m.task in ("detect", "segment") and d.data is None:  # Canvases of the built-in digits.
    if m.num_channels != DIGITS_CHANNELS or m.image_size < 2 * DIGITS_IMAGE_SIZE:
      raise ConfigError(f"--image_size={m.image_size} --num_channels={m.num_channels} do not fit "
                        f"the built-in digit canvases (greyscale, several {DIGITS_IMAGE_SIZE}-pixel "
                        f"digits): use --num_channels={DIGITS_CHANNELS} and --image_size of at "
                        "least 16 (e.g. 48), or pass --data")
    # Segmentation labels the background 0 and a digit's ink 1 + digit.
    needed = DIGITS_CLASSES + (m.task == "segment")
    if m.num_classes != needed:
      raise ConfigError(f"--num_classes={m.num_classes} does not fit the digit canvases' "
                        f"{needed} classes for --task={m.task}: use --num_classes={needed}")


def _validate_compression(cfg: Config) -> None:
  c, s, p = cfg.compression, cfg.dist, cfg.parallel
  if c.method not in COMPRESSIONS:
    raise ConfigError(f"--grad_compression={c.method} is unknown: use one of "
                      f"{', '.join(COMPRESSIONS)}")
  if c.rank < 1:
    raise ConfigError(f"--powersgd_rank={c.rank} must be at least 1: e.g. --powersgd_rank=4")
  if c.warmup_steps < 0 or c.min_size < 0:
    raise ConfigError("--powersgd_warmup_steps and --powersgd_min_size must be >= 0")
  if s.all_reduce_pack_mb < 0:
    raise ConfigError(f"--all_reduce_pack_mb={s.all_reduce_pack_mb} must be >= 0 "
                      "(0: TensorFlow picks the pack size)")
  if s.all_reduce_pack_mb and s.strategy != "multi_worker_mirrored":
    raise ConfigError(f"--all_reduce_pack_mb is for --strategy=multi_worker_mirrored, not "
                      f"--strategy={s.strategy}: drop the flag")
  if c.method == "none":
    return
  why = {
      "parameter_server": "its workers push gradients to the parameter servers one by one, "
                          "asynchronously; no all-reduce between replicas runs",
      "tpu": "TPUStrategy all-reduces inside its compiled step over the TPU interconnect, "
             "which tfpar does not compress",
  }.get(s.strategy)
  if s.strategy == "one_device" and not p.model_parallel:
    why = "one device is one replica: there is no gradient all-reduce to compress"
  if p.model_parallel and s.strategy != "multi_worker_mirrored" and (
      p.data_parallel or s.num_cpu_devices // (p.pipeline_stages * p.tensor_parallel)) <= 1:
    raise ConfigError(f"--grad_compression={c.method} needs data-parallel replicas and this plan "
                      "has one (--data_parallel=1): use --data_parallel=2 or more, or "
                      "--grad_compression=none")
  if why:
    raise ConfigError(f"--grad_compression={c.method} does not combine with --strategy="
                      f"{s.strategy}: {why}. Use --strategy=mirrored or multi_worker_mirrored, "
                      "or --grad_compression=none")


def check_batch(global_batch_size: int, replicas: int, microbatches: int = 1,
                flag: str = "") -> None:
  """The global batch must split evenly over the replicas, and each share over micro-batches.

  Args:
    flag: the flag that set `replicas`, named in the message (e.g. "--data_parallel=2").
  """
  if global_batch_size % replicas:
    source = f" ({flag})" if flag else ""
    raise ConfigError(f"--global_batch_size={global_batch_size} does not split evenly over "
                      f"{replicas} replicas{source}: use a multiple of {replicas}")
  per_replica = global_batch_size // replicas
  if per_replica % microbatches:
    raise ConfigError(f"--microbatches={microbatches} does not divide the per-replica batch "
                      f"{per_replica}: use a divisor of {per_replica}")


def check_model_split(m: ModelConfig, p: ParallelConfig, precision: str = "float32") -> None:
  """What a pipeline x tensor split of the model needs, whatever the devices."""
  if p.pipeline_stages > m.num_layers:
    raise ConfigError(f"--pipeline_stages={p.pipeline_stages} is more than --num_layers="
                      f"{m.num_layers}: use at most one stage per block")
  if p.stage_layers is not None:
    if len(p.stage_layers) != p.pipeline_stages:
      raise ConfigError(f"--stage_layers has {count(len(p.stage_layers), 'entry', 'entries')} "
                        f"but --pipeline_stages={p.pipeline_stages}: give one block count per "
                        "stage")
    if any(n <= 0 for n in p.stage_layers) or sum(p.stage_layers) != m.num_layers:
      raise ConfigError(f"--stage_layers={','.join(map(str, p.stage_layers))} must be positive "
                        f"and sum to --num_layers={m.num_layers}")
  if m.num_heads % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --num_heads="
                      f"{m.num_heads}: pick a T that divides the head count")
  if m.d_ff % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --d_ff={m.d_ff}: "
                      "pick a T that divides the MLP width")
  if p.remat and m.dropout > 0:
    # Keras dropout draws from a stateful seed: the recomputed forward would get new masks.
    raise ConfigError(f"--remat with --dropout={m.dropout} would recompute blocks with other "
                      "dropout masks than the forward used: use --dropout=0 with --remat")
  if precision == "mixed_float16":
    raise ConfigError("--precision=mixed_float16 does not combine with model parallelism "
                      "(no loss scaling there yet): use --precision=mixed_bfloat16 or float32")


def _validate_parallel(cfg: Config) -> None:
  t, s, p = cfg.train, cfg.dist, cfg.parallel
  if not p.model_parallel:
    return
  if s.strategy in ("parameter_server", "tpu"):
    raise ConfigError(f"--strategy={s.strategy} does not combine with model parallelism: "
                      "use one_device, mirrored or multi_worker_mirrored")
  if p.data_parallel is not None and p.data_parallel <= 0:
    raise ConfigError(f"--data_parallel={p.data_parallel} must be positive")
  check_model_split(cfg.model, p, t.precision)
  # Default D: as many replicas as the devices hold (across workers, one per worker:
  # check_run counts them once TF_CONFIG is known).
  dp = p.data_parallel or max(1, s.num_cpu_devices // (p.pipeline_stages * p.tensor_parallel))
  if s.strategy == "multi_worker_mirrored":
    dp = p.data_parallel or 1
  check_batch(t.global_batch_size, dp, p.microbatches, flag=f"--data_parallel={dp}")
  if s.strategy != "multi_worker_mirrored":
    needed = dp * p.pipeline_stages * p.tensor_parallel
    if s.num_cpu_devices > 1 and needed != s.num_cpu_devices:
      raise ConfigError(f"--data_parallel x --pipeline_stages x --tensor_parallel = {dp}x"
                        f"{p.pipeline_stages}x{p.tensor_parallel} = {needed} does not match "
                        f"--num_cpu_devices={s.num_cpu_devices}: make them equal")


# --- a run's config.json ----------------------------------------------------------------------

RUN_CONFIG = "config.json"  # In --model_dir: the run's flags (tfpar.runner.write_run_config).
CLASS_NAMES = "class_names"  # Beside the sections in config.json, where the data names classes.


def read_saved(model_dir: str) -> dict:
  """A run's config.json, parsed: tfpar.train (a resume), tfpar.generate and tfpar.predict.

  Read through tf.io.gfile (gs:// too). Raises ConfigError, in one line, where
  the file cannot be read or is not an object of sections.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    with tf.io.gfile.GFile(os.path.join(model_dir, RUN_CONFIG)) as f:
      saved = json.load(f)
    if not isinstance(saved, dict) or not all(
        isinstance(saved.get(field.name, {}), dict) for field in dataclasses.fields(Config)):
      raise ValueError("not an object of sections model, data, train, ...")
  except (ValueError, tf.errors.OpError) as e:
    raise ConfigError(f"--model_dir={model_dir} has a config.json that cannot be read "
                      f"({str(e).splitlines()[0]}): restore it from the run's first flags, or "
                      "use a new --model_dir") from None
  return saved


def from_saved(saved: dict) -> Config:
  """The Config a config.json (read_saved) records, from any tfpar version's file.

  A field added since the run was written takes its default; one this version
  no longer knows is dropped (inference must not fail on it); JSON lists
  become the tuples the dataclasses hold.
  """
  sections = {}
  for section in dataclasses.fields(Config):
    kind = section.default.__class__
    known = {f.name for f in dataclasses.fields(kind)}
    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in saved.get(section.name, {}).items() if k in known}
    sections[section.name] = kind(**values)
  return Config(**sections)


def saved_class_names(saved: dict) -> Tuple[str, ...]:
  """The class names a config.json (read_saved) records, in id order; () where it has none."""
  names = saved.get(CLASS_NAMES)
  return tuple(str(n) for n in names) if isinstance(names, list) else ()


# --- what the flags meet on this machine ------------------------------------------------------


def check_run(cfg: Config, cluster=None) -> None:
  """The run directory and the job (tfpar.cluster.Cluster), before TensorFlow starts.

  Reads (never writes) --model_dir: the chief writes config.json only once
  the data has been read, so bad input leaves the directory as it was.
  """
  _check_model_dir(cfg)
  if cluster is not None and cluster.spec:
    check_cluster(cfg, cluster)


def _check_local_model_dir(path: str) -> None:
  """A local --model_dir: a directory, or one that this user can create."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"--model_dir={path} is a file: pass a directory (new or a run's)")
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"--model_dir={path} is not writable ({existing} refuses this user): "
                      "pass a directory you can write to")
  if existing != os.path.abspath(path):
    # access() says yes to root anywhere, /proc and /sys included: create (and remove) a
    # directory where the run's would go, so that one that cannot be made fails here.
    try:
      os.rmdir(tempfile.mkdtemp(prefix=".tfpar_probe_", dir=existing))
    except OSError as e:
      raise ConfigError(f"--model_dir={path} cannot be created in {existing} ({e.strerror}): "
                        "pass a directory on a filesystem that holds files") from None


def _check_model_dir(cfg: Config) -> None:
  """--model_dir: writable, and (on resume) holding a run of the same model and data order.

  Raises:
    ConfigError: the directory cannot work or holds another run.
    tfpar.storage.Unreachable: a remote filesystem (gs://) cannot be reached now.
  """
  path = cfg.train.model_dir
  if "://" not in path:
    _check_local_model_dir(path)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  # gfile only: reads gs:// too.
  try:
    if not tf.io.gfile.exists(os.path.join(path, RUN_CONFIG)):
      return
  except tf.errors.OpError as e:  # Never for a local path: a remote store that does not answer.
    raise storage.describe_unreachable(f"--model_dir={path}", e) from None
  saved = read_saved(path)
  saved_model, saved_train = saved.get("model"), saved.get("train", {})
  ours = cfg.to_dict()
  if saved_model is not None:  # A model field added since the run started has its default.
    saved_model = {**dataclasses.asdict(ModelConfig()), **saved_model}
  if saved_model is not None and saved_model != ours["model"]:
    diff = sorted(k for k in saved_model if saved_model[k] != ours["model"].get(k))
    raise ConfigError(f"--model_dir={path} holds a run with other model flags "
                      f"({', '.join(diff)}): use the same flags to resume, or a new --model_dir")
  for flag in RESUME_FIXED:
    if flag in saved_train and saved_train[flag] != ours["train"][flag]:
      raise ConfigError(f"--{flag}={ours['train'][flag]}, but the run in --model_dir={path} was "
                        f"started with {saved_train[flag]}: a resume with another would read "
                        f"other data than the run left off at; pass --{flag}="
                        f"{saved_train[flag]}, or a new --model_dir")


def check_cluster(cfg: Config, cluster) -> None:
  """The job's shape (a tfpar.cluster.Cluster) against the flags: tfpar.train and tfpar.k8s.

  Needs no TensorFlow: tfpar.train calls it before TensorFlow starts.
  """
  t, s, p = cfg.train, cfg.dist, cfg.parallel
  tasks = cluster.num_tasks
  if s.strategy in ("one_device", "mirrored") and tasks > 1:
    # Each task would train its own copy, and only the chief's would be kept: a non-chief
    # task would train, print nothing and write nothing (the launcher refuses the same).
    me = f"{cluster.task_type} {cluster.task_index}"
    raise ConfigError(f"TF_CONFIG names a cluster of {tasks} tasks (this is {me}), but "
                      f"--strategy={s.strategy} trains in one process: unset TF_CONFIG, or "
                      "pass --strategy=multi_worker_mirrored to train across them")
  if s.strategy == "multi_worker_mirrored" and not p.model_parallel:
    # One replica per worker on CPU hosts (GPU hosts have more: the engine checks again).
    check_batch(t.global_batch_size, cluster.num_workers,
                flag=f"{cluster.num_workers} workers in TF_CONFIG")
  if s.strategy == "multi_worker_mirrored" and p.model_parallel:
    workers = cluster.num_workers
    if p.data_parallel not in (None, workers):
      raise ConfigError(f"--data_parallel={p.data_parallel} does not match the {workers} "
                        "workers: across workers each worker is one replica; drop "
                        f"--data_parallel or set it to {workers}")
    check_batch(t.global_batch_size, workers, p.microbatches, flag=f"{workers} workers")
  if s.strategy == "parameter_server":
    num_ps = len(cluster.spec.get("ps", []))
    if num_ps and s.ps_shards > num_ps:
      raise ConfigError(f"--ps_shards={s.ps_shards} is more than the {num_ps} parameter "
                        f"server(s) of the job: use --ps_shards<={num_ps} or start more ps tasks")
