"""The rules a run's settings must obey: pure functions of the config, before TensorFlow.

Every rule raises ConfigError with one line naming the flag and the fix.
`validate(cfg)` (called by tfpar.config.from_flags) checks the flags alone;
what differs by task is asked of the task's spec (tfpar.tasks.specs); the
rules a model-parallel plan must obey (`check_batch`, `check_model_split`) are
called again by tfpar.layout.placement with the real devices, not a second copy.
What the flags meet on the machine is checked elsewhere, with the same
ConfigError: the run directory by tfpar.config.rundir, TF_CONFIG by tfpar.config.cluster.
Nothing here imports TensorFlow (tests/test_config.py checks it).
"""

import dataclasses
import glob
import math
import os

from tfpar import families, hub, tasks, tokenizer
from tfpar.console import count
from tfpar.config.schema import VOCAB_SIZE, COMPRESSIONS, ON_NONFINITE, Config, ConfigError, ModelConfig
from tfpar.config.schema import ParallelConfig
from tfpar.tasks.specs import positive as _positive

MAX_INT = 2 ** 31 - 1  # TensorFlow counts steps, shapes and batches in int32 in places.
MAX_SEED = 2 ** 32 - 1  # numpy and tf.random take seeds in [0, 2^32).
# Logical CPU devices share the host's cores (they test correctness, not speed)
# and each gets its own thread pools: 64 covers every plan a test or a laptop
# run needs; more is a typo that would start thousands of threads.
MAX_CPU_DEVICES = 64
MAX_COLLECTIVE_TIMEOUT = 24 * 3600  # A day: longer than any save or restart should take.
# --strategy -> why its gradients cannot be compressed; a strategy not named here
# all-reduces them between replicas (tfpar.parallel.compression compresses that).
UNCOMPRESSED = {
    "parameter_server": "its workers push gradients to the parameter servers one by one, "
                        "asynchronously; no all-reduce between replicas runs",
    "tpu": "TPUStrategy all-reduces inside its compiled step over the TPU interconnect, "
           "which tfpar does not compress",
}


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


def family_of(m: ModelConfig) -> "families.Family":
  """The registered family --architecture names, or ConfigError listing the language models."""
  if m.architecture not in families.names("lm"):
    raise ConfigError(f"--architecture={m.architecture} is not a registered language model "
                      f"family: use one of {', '.join(families.names('lm'))} (tfpar/models/), or "
                      "register yours with tfpar.register")
  return families.get(m.architecture)


def validate_model(m: ModelConfig) -> None:
  """Raises ConfigError naming the first model flag that cannot work."""
  for value, flag in ((m.seq_len, "seq_len"), (m.num_layers, "num_layers"),
                      (m.d_model, "d_model"), (m.num_heads, "num_heads"), (m.d_ff, "d_ff")):
    _positive(value, flag)
  try:
    kind, _ = tokenizer.parse(m.tokenizer)
  except tokenizer.TokenizerError as e:
    raise ConfigError(str(e)) from None
  if kind == tokenizer.BYTES and m.vocab_size < VOCAB_SIZE:
    raise ConfigError(f"--vocab_size={m.vocab_size} is smaller than the {VOCAB_SIZE} byte values "
                      f"the data pipeline feeds: use --vocab_size >= {VOCAB_SIZE}")
  if m.d_model % m.num_heads:
    raise ConfigError(f"--num_heads={m.num_heads} does not divide --d_model={m.d_model}: "
                      "pick a head count that divides d_model (e.g. 4 or 8 for 256)")
  if m.num_kv_heads is not None and (m.num_kv_heads <= 0 or m.num_heads % m.num_kv_heads):
    raise ConfigError(f"--num_kv_heads={m.num_kv_heads} does not divide --num_heads="
                      f"{m.num_heads}: pick a divisor of the head count (1: multi-query)")
  family = family_of(m)
  if m.kv_heads != m.num_heads and not family.grouped_query:
    grouped = [f.name for f in map(families.get, families.names("lm")) if f.grouped_query]
    raise ConfigError(f"--num_kv_heads={m.num_kv_heads} (grouped-query attention) is for "
                      f"--architecture={' or '.join(grouped)}, not {m.architecture}: drop the "
                      f"flag, or pass --architecture={grouped[0]}")
  if family.positions and m.positions not in family.positions:
    raise ConfigError(f"--positions={m.positions} does not fit --architecture={m.architecture}, "
                      f"whose positions are {' or '.join(family.positions)}: drop the flag")
  if m.positions == "rotary" and (m.d_model // m.num_heads) % 2:
    raise ConfigError(f"--positions=rotary needs an even head size, got "
                      f"d_model/num_heads={m.d_model // m.num_heads}: change --num_heads")
  tasks.spec(m.task).check_model(m)
  if not 0.0 <= m.dropout < 1.0:
    raise ConfigError(f"--dropout={m.dropout} must be in [0, 1): e.g. --dropout=0.1")


def validate(cfg: Config, resumed: bool = False) -> None:
  """Raises ConfigError naming the first flag that cannot work, and how to fix it.

  resumed: --model_dir holds a run that started from --init_from, whose checkpoint holds the
  preset's weights: a preset no longer there is not read.
  """
  m, d, o, t, s, p = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.dist, cfg.parallel
  _finite_floats(cfg)
  if not 0 <= t.seed <= MAX_SEED:
    raise ConfigError(f"--seed={t.seed} must be in [0, 2^32-1]: e.g. --seed=0")
  _bounded_ints(cfg)
  validate_model(m)
  tasks.spec(m.task).check_data(m, d)
  if m.init_from is not None and not (resumed and not os.path.isdir(m.init_from)):
    hub.check(m, m.init_from)
  for value, flag in ((t.train_steps, "train_steps"), (t.global_batch_size, "global_batch_size"),
                      (t.log_every, "log_every"), (t.checkpoint_every, "checkpoint_every"),
                      (t.keep_checkpoints, "keep_checkpoints"), (t.steps_per_call, "steps_per_call"),
                      (s.num_cpu_devices, "num_cpu_devices"), (s.ps_shards, "ps_shards"),
                      (p.pipeline_stages, "pipeline_stages"), (p.microbatches, "microbatches"),
                      (p.tensor_parallel, "tensor_parallel"), (p.virtual_stages, "virtual_stages")):
    _positive(value, flag)
  if t.profile_steps and not 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.train_steps:
    raise ConfigError(f"--profile_steps={t.profile_steps[0]},{t.profile_steps[1]} must satisfy "
                      f"1 <= FIRST <= LAST <= --train_steps={t.train_steps}: e.g. "
                      f"--profile_steps={min(5, t.train_steps)},{min(8, t.train_steps)}")
  if t.xla_auto_clustering != "none" and t.jit_compile:
    raise ConfigError(f"--xla_auto_clustering={t.xla_auto_clustering} is for a step not "
                      "compiled whole, and --jit_compile compiles every op with XLA already: "
                      "drop --xla_auto_clustering, or pass --nojit_compile")
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
                      f"{MAX_COLLECTIVE_TIMEOUT}] seconds: a peer that never comes must end "
                      "the job, not hang it; e.g. 300")
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
  check_sequence_parallel(cfg.model, p)
  _validate_parallel(cfg)
  _validate_compression(cfg)
  _validate_optimizer_sharding(cfg)


def _validate_optimizer_sharding(cfg: Config) -> None:
  """--optimizer_sharding: only where replicas in sync share one update (tfpar.parallel.zero)."""
  z, s, p = cfg.parallel.optimizer_sharding, cfg.dist, cfg.parallel
  if z == "none":
    return
  why = {"one_device": "one device is one replica, which holds all of the optimizer state",
         "parameter_server": "the optimizer state lives on the parameter servers, not on the "
                             "replicas",
         "tpu": "TPUStrategy's update is not wired to it"}.get(s.strategy)
  if p.model_parallel and s.strategy != "multi_worker_mirrored" and (
      p.data_parallel or s.num_cpu_devices // (p.pipeline_stages * p.tensor_parallel)) <= 1:
    why = "this plan has one data-parallel copy (--data_parallel=1), nothing to share"
  elif p.model_parallel:  # A model-parallel plan shards over its own D copies.
    why = None
  if why:
    raise ConfigError(f"--optimizer_sharding={z} shards over synchronous data-parallel "
                      f"replicas: --strategy=mirrored or multi_worker_mirrored, or a "
                      f"model-parallel plan's --data_parallel ({why}): use one of them, or "
                      "--optimizer_sharding=none")
  if cfg.train.precision == "mixed_float16":
    raise ConfigError(f"--optimizer_sharding={z} does not combine with --precision="
                      "mixed_float16 (its loss scaling is not sharded): use --precision="
                      "mixed_bfloat16 or float32")
  if z == "zero3":
    _validate_zero3(cfg)
  if z == "zero2" and cfg.compression.method != "none":
    raise ConfigError(f"--optimizer_sharding=zero2 sums the gradient itself, shard by shard, in "
                      f"float32: it does not combine with --grad_compression="
                      f"{cfg.compression.method}; use --optimizer_sharding=zero1 (which "
                      "composes with it) or --grad_compression=none")


def _validate_zero3(cfg: Config) -> None:
  """zero3 (tfpar.parallel.zero3): whole data-parallel replicas of one model, or the copies of
  a pipeline plan on one host (tfpar.engines.hybrid_zero3) (D > 1: the engine checks once the
  devices are counted, `check_zero3_replicas`)."""
  p, s = cfg.parallel, cfg.dist
  if p.model_parallel and (s.strategy != "mirrored" or p.tensor_parallel > 1 or
                           p.pipeline_schedule != "gpipe" or p.remat != "none"):
    raise ConfigError("--optimizer_sharding=zero3 shards whole data-parallel replicas "
                      "(mirrored, multi_worker_mirrored) or the copies of a pipeline plan on one "
                      "host (--strategy=mirrored with --data_parallel, --pipeline_stages, "
                      "--microbatches, --pipeline_schedule=gpipe); not tensor-parallel stages, "
                      "plans across workers, the 1f1b/interleaved schedules, or --remat (zero3 "
                      "recomputes every block anyway): drop those flags, or use "
                      "--optimizer_sharding=zero1 or zero2 with the plan")
  if cfg.compression.method != "none":
    raise ConfigError(f"--optimizer_sharding=zero3 sums each block's gradient itself in float32: "
                      f"it does not combine with --grad_compression={cfg.compression.method}; "
                      "use --optimizer_sharding=zero1 (which composes with it) or "
                      "--grad_compression=none")
  if cfg.model.dropout > 0:
    raise ConfigError(f"--optimizer_sharding=zero3 recomputes each block in its backward, which "
                      f"would draw other dropout masks than the forward (--dropout="
                      f"{cfg.model.dropout}): use --dropout=0 with zero3, or zero1/zero2")


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
  why = UNCOMPRESSED.get(s.strategy)
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


def check_zero3_replicas(replicas: int) -> None:
  """zero3 needs D > 1 data-parallel replicas to shard over (the engine checks again once
  GPUs and workers are counted)."""
  if replicas < 2:
    raise ConfigError("--optimizer_sharding=zero3 shards the weights over data-parallel "
                      "replicas and this run has one: use --strategy=mirrored on several devices "
                      "(--num_cpu_devices=2 or more) or several workers, or "
                      "--optimizer_sharding=none")


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
  check_schedule(m, p)
  check_sequence_parallel(m, p)
  if m.num_heads % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --num_heads="
                      f"{m.num_heads}: pick a T that divides the head count")
  if m.kv_heads % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --num_kv_heads="
                      f"{m.kv_heads}: pick a T that divides the key/value head count, or "
                      "more --num_kv_heads")
  if m.d_ff % p.tensor_parallel:
    raise ConfigError(f"--tensor_parallel={p.tensor_parallel} does not divide --d_ff={m.d_ff}: "
                      "pick a T that divides the MLP width")
  if p.remat == "full" and m.dropout > 0:
    # Keras dropout draws from a stateful seed: the recomputed forward would get new masks.
    # (--remat=selective recomputes only the attention core, which has no dropout.)
    raise ConfigError(f"--remat with --dropout={m.dropout} would recompute blocks with other "
                      "dropout masks than the forward used: use --dropout=0 with --remat, or "
                      "--remat=selective")
  if precision == "mixed_float16" and p.pipeline_stages * p.tensor_parallel > 1:
    raise ConfigError("--precision=mixed_float16 does not combine with model parallelism "
                      "(no loss scaling there yet): use --precision=mixed_bfloat16 or float32")


def check_sequence_parallel(m: ModelConfig, p: ParallelConfig) -> None:
  """What --sequence_parallel needs: T > 1 shards, a language model, seq_len split in T."""
  if not p.sequence_parallel:
    return
  t = p.tensor_parallel
  if t == 1:
    raise ConfigError("--sequence_parallel splits the sequence over the tensor-parallel shards, "
                      "and --tensor_parallel=1 has one: use --tensor_parallel=2 or more, or "
                      "drop --sequence_parallel")
  if not tasks.spec(m.task).splits_sequence:
    raise ConfigError(f"--sequence_parallel is for --task=lm, not --task={m.task} (a ViT's "
                      "sequence of patches is not split by it yet): drop --sequence_parallel")
  if m.seq_len % t:
    raise ConfigError(f"--sequence_parallel cuts --seq_len={m.seq_len} into --tensor_parallel="
                      f"{t} equal slices: use a --seq_len that is a multiple of {t}")


def check_schedule(m: ModelConfig, p: ParallelConfig) -> None:
  """What --pipeline_schedule and --virtual_stages need of the model's split."""
  k, v = p.pipeline_stages, p.virtual_stages
  if p.pipeline_schedule != "interleaved":
    if v != 1:
      raise ConfigError(f"--virtual_stages={v} is for --pipeline_schedule=interleaved, not "
                        f"{p.pipeline_schedule}: drop it or use --pipeline_schedule=interleaved")
    return
  if k < 2 or v < 2:
    raise ConfigError(f"--pipeline_schedule=interleaved needs --pipeline_stages >= 2 and "
                      f"--virtual_stages >= 2 (got {k} and {v}): e.g. --virtual_stages=2, or "
                      "--pipeline_schedule=1f1b")
  if m.num_layers % (k * v) or p.stage_layers is not None:
    raise ConfigError(f"--pipeline_schedule=interleaved cuts --num_layers={m.num_layers} into "
                      f"--pipeline_stages x --virtual_stages = {k}x{v} = {k * v} equal chunks: "
                      f"use a multiple of {k * v} layers (and no --stage_layers)")


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
  if p.pipeline_schedule == "interleaved" and p.microbatches % p.pipeline_stages:
    raise ConfigError(f"--pipeline_schedule=interleaved runs micro-batches in groups of "
                      f"--pipeline_stages={p.pipeline_stages}: make --microbatches="
                      f"{p.microbatches} a multiple of {p.pipeline_stages}")
  if s.strategy != "multi_worker_mirrored":
    needed = dp * p.pipeline_stages * p.tensor_parallel
    if s.num_cpu_devices > 1 and needed != s.num_cpu_devices:
      raise ConfigError(f"--data_parallel x --pipeline_stages x --tensor_parallel = {dp}x"
                        f"{p.pipeline_stages}x{p.tensor_parallel} = {needed} does not match "
                        f"--num_cpu_devices={s.num_cpu_devices}: make them equal")


def stages_across_workers(cfg: Config, devices_per_worker: int) -> bool:
  """Whether a replica spans workers: multi-worker, K x T more than a worker's G devices.

  Then every worker runs its own stages as its own program (tfpar.engines.stage_worker),
  whatever the task, its --optimizer_sharding (zero1, zero2) and --grad_compression.
  """
  p = cfg.parallel
  return (cfg.dist.strategy == "multi_worker_mirrored" and p.model_parallel and
          p.pipeline_stages * p.tensor_parallel > devices_per_worker)


def check_worker_job(cfg: Config, num_workers: int, devices_per_worker: int) -> bool:
  """A model-parallel job over workers, on every process before its servers start.

  `worker_layout`'s rules, and what stages on different workers refuse; every
  task of the job reaches the same answer, so all exit 2 together instead of
  servers waiting for a chief that refused. Returns whether a replica spans
  workers (`stages_across_workers`).
  """
  if not (cfg.dist.strategy == "multi_worker_mirrored" and cfg.parallel.model_parallel):
    return False
  worker_layout(cfg.parallel, num_workers, devices_per_worker, cfg.compression.method)
  across = stages_across_workers(cfg, devices_per_worker)
  if across and cfg.train.xla_auto_clustering != "none":
    raise ConfigError(f"--xla_auto_clustering={cfg.train.xla_auto_clustering} does not work "
                      "with pipeline stages on different workers (TensorFlow then puts the "
                      "chief's input iterator on two CPUs at once): use --xla_auto_clustering=none")
  return across


def worker_layout(p: ParallelConfig, num_workers: int, devices_per_worker: int,
                  compression: str = "none") -> tuple:
  """(D, workers per replica W) of a model-parallel plan over N workers of G devices each.

  A replica's K x T devices fill either part of one worker (K x T <= G: W=1,
  D=N, each worker one replica on its first K x T devices) or W = K x T / G
  whole workers (stages on different workers, D = N / W). A tensor-parallel
  group never leaves its worker: T must divide G then.

  Args:
    p: the parallel settings (K, T, --data_parallel).
    num_workers: N, the computing workers (the chief included).
    devices_per_worker: G, each worker's devices (GPUs, or --num_cpu_devices).
    compression: --grad_compression, which needs D >= 2 replicas to compress between.
  """
  k, t, n, g = p.pipeline_stages, p.tensor_parallel, num_workers, devices_per_worker
  if k * t <= g:
    d, w = n, 1
  else:
    if g % t:
      raise ConfigError(f"--tensor_parallel={t} does not fit a worker of {count(g, 'device')}: "
                        "a tensor-parallel group stays inside one worker; use a T that divides "
                        f"{g} (or --num_cpu_devices={k * t} to hold a whole replica per worker)")
    if (k * t) % g:
      raise ConfigError(f"--pipeline_stages x --tensor_parallel = {k}x{t} = {k * t} devices "
                        f"per replica do not fill whole workers of {count(g, 'device')}: use "
                        f"a multiple of {g}, or --num_cpu_devices={k * t}")
    w = k * t // g
    if n % w:
      raise ConfigError(f"a replica of {k}x{t} devices spans {w} workers of "
                        f"{count(g, 'device')}, and {count(n, 'worker')} do not split into "
                        f"replicas: use a multiple of {w} workers")
    d = n // w
    if compression != "none" and d == 1:
      raise ConfigError(f"--grad_compression={compression} needs data-parallel replicas, and "
                        f"{count(n, 'worker')} of {count(g, 'device')} hold one replica of "
                        f"{k}x{t} devices (--data_parallel=1): use {2 * w} workers or more, or "
                        "--grad_compression=none")
  if p.data_parallel not in (None, d):
    where = "one replica per worker" if w == 1 else f"a replica spans {w} workers"
    raise ConfigError(f"--data_parallel={p.data_parallel} does not match {count(n, 'worker')} "
                      f"of {count(g, 'device')} under {k}x{t} devices per replica ({where}): "
                      f"drop --data_parallel or set it to {d}")
  return d, w
