"""Frozen, validated configuration built from flags before TensorFlow starts.

`from_flags(FLAGS)` is the only reader of absl flags; everything below the
entry point takes these dataclasses (or the few fields it needs). `validate`
raises `ConfigError` with one line naming the flag and the fix.
"""

import dataclasses
import glob
import os
from typing import Optional, Tuple

VOCAB_SIZE = 256  # Byte-level tokens: no vocabulary file, nothing to download.


class ConfigError(ValueError):
  """A flag combination that cannot work; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = VOCAB_SIZE
  seq_len: int = 128
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 4
  d_ff: int = 512
  dropout: float = 0.0
  positions: str = "learned"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  data: Optional[str] = None  # None: the embedded default corpus.
  tfrecord_key: str = "text"
  eval_fraction: float = 0.05
  input_sharding: str = "auto"


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
  m = ModelConfig(vocab_size=f.vocab_size, seq_len=f.seq_len, num_layers=f.num_layers,
                  d_model=f.d_model, num_heads=f.num_heads, d_ff=d_ff, dropout=f.dropout,
                  positions=f.positions)
  validate_model(m)
  return m


def from_flags(f) -> Config:
  """Builds and validates a Config from parsed absl FLAGS (or any object with those attrs)."""
  warmup = f.warmup_steps if f.warmup_steps is not None else max(1, f.train_steps // 20)
  stage_layers = None
  if f.stage_layers:
    try:
      stage_layers = tuple(int(x) for x in f.stage_layers)
    except ValueError:
      raise ConfigError(f"--stage_layers={','.join(f.stage_layers)} is not a list of integers: "
                        "write blocks per stage, e.g. --stage_layers=3,3,2") from None
  if not f.model_dir:
    raise ConfigError("--model_dir is not set: pass --model_dir=DIR for checkpoints and metrics")
  cfg = Config(
      model=model_from_flags(f),
      data=DataConfig(data=f.data, tfrecord_key=f.tfrecord_key, eval_fraction=f.eval_fraction,
                      input_sharding=f.input_sharding),
      optim=OptimConfig(learning_rate=f.learning_rate, warmup_steps=warmup,
                        min_lr_ratio=f.min_lr_ratio, weight_decay=f.weight_decay,
                        clip_norm=f.clip_norm),
      train=TrainConfig(model_dir=f.model_dir, train_steps=f.train_steps,
                        global_batch_size=f.global_batch_size, seed=f.seed,
                        log_every=f.log_every, eval_every=f.eval_every, eval_steps=f.eval_steps,
                        checkpoint_every=f.checkpoint_every, keep_checkpoints=f.keep_checkpoints,
                        steps_per_call=f.steps_per_call, precision=f.precision,
                        jit_compile=f.jit_compile),
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
    return
  if not glob.glob(path):
    raise ConfigError(f"--data={path} matches no file or directory: "
                      "pass an existing text file, directory, glob or TFRecord shards")


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
  if not 0.0 <= m.dropout < 1.0:
    raise ConfigError(f"--dropout={m.dropout} must be in [0, 1): e.g. --dropout=0.1")


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first flag that cannot work, and how to fix it."""
  m, d, o, t, s, p = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.dist, cfg.parallel
  validate_model(m)
  for value, flag in ((t.train_steps, "train_steps"), (t.global_batch_size, "global_batch_size"),
                      (t.log_every, "log_every"), (t.checkpoint_every, "checkpoint_every"),
                      (t.keep_checkpoints, "keep_checkpoints"), (t.steps_per_call, "steps_per_call"),
                      (s.num_cpu_devices, "num_cpu_devices"), (s.ps_shards, "ps_shards"),
                      (p.pipeline_stages, "pipeline_stages"), (p.microbatches, "microbatches"),
                      (p.tensor_parallel, "tensor_parallel")):
    _positive(value, flag)
  if t.eval_every < 0 or t.eval_steps < 0:
    raise ConfigError("--eval_every and --eval_steps must be >= 0: use 0 to evaluate only at the end")
  if not 0.0 < d.eval_fraction < 0.5:
    raise ConfigError(f"--eval_fraction={d.eval_fraction} must be in (0, 0.5): e.g. 0.05")
  if d.data is not None:
    _check_data_path(d.data)
  if o.learning_rate <= 0:
    raise ConfigError(f"--learning_rate={o.learning_rate} must be positive: e.g. 1e-3")
  if o.warmup_steps < 0 or o.warmup_steps >= t.train_steps:
    raise ConfigError(f"--warmup_steps={o.warmup_steps} must be in [0, train_steps="
                      f"{t.train_steps}): shorten the warmup or train longer")
  if not 0.0 <= o.min_lr_ratio <= 1.0:
    raise ConfigError(f"--min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
  if o.weight_decay < 0:
    raise ConfigError(f"--weight_decay={o.weight_decay} must be >= 0")
  if o.clip_norm < 0:
    raise ConfigError(f"--clip_norm={o.clip_norm} must be >= 0 (0 disables clipping)")
  if s.collective_timeout < 0:
    raise ConfigError(f"--collective_timeout={s.collective_timeout} must be >= 0 (0: wait forever)")
  if s.strategy in ("one_device", "parameter_server", "tpu") and s.num_cpu_devices > 1 \
      and not p.model_parallel:
    raise ConfigError(f"--num_cpu_devices={s.num_cpu_devices} is unused by --strategy={s.strategy}: "
                      "use --strategy=mirrored to train on the logical devices")
  if t.precision == "mixed_float16" and s.strategy == "tpu":
    raise ConfigError("--precision=mixed_float16 is not for TPUs: use --precision=mixed_bfloat16")
  _validate_parallel(cfg)
  _validate_compression(cfg)


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


def _validate_parallel(cfg: Config) -> None:
  m, t, s, p = cfg.model, cfg.train, cfg.dist, cfg.parallel
  if not p.model_parallel:
    return
  if s.strategy in ("parameter_server", "tpu"):
    raise ConfigError(f"--strategy={s.strategy} does not combine with model parallelism: "
                      "use one_device, mirrored or multi_worker_mirrored")
  if p.data_parallel is not None and p.data_parallel <= 0:
    raise ConfigError(f"--data_parallel={p.data_parallel} must be positive")
  if p.pipeline_stages > m.num_layers:
    raise ConfigError(f"--pipeline_stages={p.pipeline_stages} is more than --num_layers="
                      f"{m.num_layers}: use at most one stage per block")
  if p.stage_layers is not None:
    if len(p.stage_layers) != p.pipeline_stages:
      raise ConfigError(f"--stage_layers has {len(p.stage_layers)} entries but --pipeline_stages="
                        f"{p.pipeline_stages}: give one block count per stage")
    if any(n <= 0 for n in p.stage_layers) or sum(p.stage_layers) != m.num_layers:
      raise ConfigError(f"--stage_layers={','.join(map(str, p.stage_layers))} must be positive "
                        f"and sum to --num_layers={m.num_layers}")
  if m.num_heads % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --num_heads="
                      f"{m.num_heads}: pick a T that divides the head count")
  if m.d_ff % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --d_ff={m.d_ff}: "
                      "pick a T that divides the MLP width")
  # Default D: as many replicas as the devices hold (across workers, one per worker:
  # tfpar.parallel.plan checks that once the cluster is known).
  dp = p.data_parallel or max(1, s.num_cpu_devices // (p.pipeline_stages * p.tensor_parallel))
  if s.strategy == "multi_worker_mirrored":
    dp = p.data_parallel or 1
  if t.global_batch_size % dp:
    raise ConfigError(f"--global_batch_size={t.global_batch_size} does not divide over "
                      f"--data_parallel={dp} replicas: use a multiple of {dp}")
  per_replica = t.global_batch_size // dp
  if per_replica % p.microbatches:
    raise ConfigError(f"--microbatches={p.microbatches} does not divide the per-replica batch "
                      f"{per_replica}: use a divisor of {per_replica}")
  if s.strategy != "multi_worker_mirrored":
    needed = dp * p.pipeline_stages * p.tensor_parallel
    if s.num_cpu_devices > 1 and needed != s.num_cpu_devices:
      raise ConfigError(f"--data_parallel x --pipeline_stages x --tensor_parallel = {dp}x"
                        f"{p.pipeline_stages}x{p.tensor_parallel} = {needed} does not match "
                        f"--num_cpu_devices={s.num_cpu_devices}: make them equal")
