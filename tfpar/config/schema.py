"""The run's settings, each written once: the frozen dataclasses and their flags.

A field is a setting. Its metadata carries what the command line needs (the
help text, the flag's name where it differs, the default the flag shows
where it differs from the resolved one, the enum's choices), so that
tfpar.config.flags defines every training flag from these fields and
tfpar.config.from_flags reads them back without listing any by hand.

No TensorFlow and no absl here: tfpar.config.rules validates these values before
TensorFlow starts, and tfpar.config.rundir reads them back from a run's config.json.
"""

import dataclasses
import typing
from typing import Optional, Tuple

from tfpar import families

VOCAB_SIZE = 256  # Byte-level tokens: no vocabulary file, nothing to download.
STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "tpu")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
ON_NONFINITE = ("stop", "skip")
REMAT = ("none", "full", "selective")  # What blocks recompute in the backward pass.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")  # tfpar.parallel.schedules.
CAUSAL_ATTENTION = ("query_blocks", "online_softmax")  # tfpar.layers.attention.CAUSAL_CORES.
OPTIMIZER_SHARDING = ("none", "zero1", "zero2", "zero3")  # tfpar.parallel.zero, zero3.
XLA_AUTO_CLUSTERING = ("none", "fusible")  # tfpar.console.XLA_AUTO_CLUSTERING_FLAGS.
HOST_ALLOCATORS = ("bfc", "system")  # tfpar.console.set_host_allocator.
TASKS = ("lm", "classify", "detect", "segment")  # --task: tfpar.tasks.<name>.
UNSET = object()  # A flag's default where it is the field's own.


def remat_mode(value) -> str:
  """--remat's mode from what a flag or an older config.json holds (True: full, False: none)."""
  return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


class ConfigError(ValueError):
  """A flag combination that cannot work; the message names the flag and the fix."""


def setting(default, text: str, *, flag: str = "", flag_default=UNSET,
            choices: Tuple[str, ...] = (), boolean: Tuple[str, ...] = ()):
  """A dataclass field that is also the absl flag `--flag` (default: the field's name), with
  help `text`.

  Args:
    flag_default: what the flag holds when not passed, where from_flags resolves
      it to `default` (None: "4 * d_model", "5% of train_steps", "required").
    choices: the values of an enum flag.
    boolean: (off, on): two of `choices` that `--noflag` and `--flag` alone stand for,
      so that an enum which was once a boolean flag keeps its old spellings.
  """
  return dataclasses.field(default=default, metadata={
      "help": text, "flag": flag, "flag_default": flag_default, "choices": tuple(choices),
      "boolean": tuple(boolean)})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # What is learned (tfpar.tasks): it decides the model, data and loss.
  task: str = setting(
      "lm", "What to train: 'lm' a language model (--architecture) on text; with a ViT on "
      "images, 'classify' (a class per image), 'detect' (boxes and classes) or 'segment' (a "
      "class per pixel) "
      "(the model, data, loss and metrics come from tfpar.tasks).", choices=TASKS)
  # Tokens: the tokenizer (tfpar.tokenizer) fixes the ids the model embeds and predicts.
  tokenizer: str = setting(
      "bytes", "--task=lm: how text becomes ids: 'bytes' (256 byte values, no file), "
      "'sentencepiece:PATH' (a .model file; python -m tfpar.tokenizer train writes one) or "
      "'keras_hub:PRESET_DIR' (the tokenizer of a keras-hub preset; the default with an "
      "--init_from preset that holds one). config.json records it and tfpar.generate decodes "
      "with it.", flag_default=None)
  vocab_size: int = setting(
      VOCAB_SIZE, "Embedding rows (default: the tokenizer's vocabulary, 256 for bytes; larger "
      "sizes pad it, or model another tokenizer's vocabulary for tfpar.plan).",
      flag_default=None)
  seq_len: int = setting(128, "Tokens (bytes) per training sequence.")
  num_layers: int = setting(4, "Transformer blocks.")
  d_model: int = setting(128, "Width of the residual stream.")
  num_heads: int = setting(4, "Attention heads; must divide d_model.")
  d_ff: int = setting(512, "MLP hidden width (default 4 * d_model).", flag_default=None)
  dropout: float = setting(0.0, "Dropout rate (0 for pretraining-style runs, as nanoGPT).")
  positions: str = setting("learned", "Position encoding (default: the --architecture's "
                           "own, the first its family lists in tfpar.families).",
                           choices=("learned", "rotary"), flag_default=None)
  # The language model's family (tfpar.families: one folder of tfpar/models each).
  architecture: str = setting(
      families.default("lm"), "--task=lm: the model family, one of tfpar/models/ ("
      f"{', '.join(families.names('lm'))}; each folder's docstring says what it is), or one "
      "registered with tfpar.register from Python (checked by tfpar.config.rules).")
  num_kv_heads: Optional[int] = setting(  # None: --num_heads (see kv_heads).
      None, "Key/value heads of grouped-query attention (default --num_heads; 1: multi-query); "
      "must divide --num_heads; fewer than --num_heads needs a family with grouped-query "
      "attention.")
  init_from: Optional[str] = setting(  # tfpar.hub: keras-hub presets in (tfpar.export: out).
      None, "--task=lm: start a new run from a keras-hub preset directory (what save_to_preset "
      "writes, of a backbone a family of tfpar/models converts): its weights, mapped to "
      "tfpar's names, under any "
      "parallel plan. The model flags must match its config; a resumed run restores its "
      "checkpoint instead.")
  # Vision tasks (a ViT on image patches; unused by --task=lm).
  image_size: int = setting(8, "Image height and width in pixels (square).")
  patch_size: int = setting(2, "ViT patch height and width; must divide --image_size.")
  num_channels: int = setting(
      1, "Image channels: 1 grey, 3 RGB or 4 RGBA (PNG only); the built-in digits are grey.")
  num_classes: int = setting(10, "Classes of the task's labels (ids 0..num_classes-1).")
  pooling: str = setting(
      "cls", "How the ViT pools patches for the classifier: a class token, or the mean of "
      "patches.", choices=("cls", "mean"))

  @property
  def kv_heads(self) -> int:
    """Key/value heads: --num_kv_heads, or one per query head."""
    return self.num_kv_heads or self.num_heads

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class DataConfig:
  data: Optional[str] = setting(  # None: the task's built-in data.
      None,
      "What to train on, by --task. lm: text, as a file, a directory, a glob of text files, "
      "or TFRecord shards (*.tfrecord, a tf.train.Example with a bytes feature "
      "--tfrecord_key, or the ids python -m tfpar.data prepare wrote); default: the Python standard library's own source files, present on "
      "every machine. classify: a directory with one sub-directory of images per class "
      "(DIR/<class>/*.png|jpg); default: scikit-learn's digits. detect: a COCO instances "
      "JSON (images relative to its directory); segment: a directory with images/NAME.png|jpg "
      "and masks/NAME.png (pixel = class id); default for both: canvases of the digits. "
      "Any vision task also reads TFRecord shards (tfpar/data/image_records.py); "
      "tfpar/data/images.py describes the layouts.")
  tfrecord_key: str = setting(
      "text", "--task=lm: the bytes feature holding the text in TFRecord examples.")
  eval_fraction: float = setting(0.05, "Fraction of the corpus (its tail) held out for eval.")
  input_sharding: str = setting(
      "auto", "How workers split the input: 'data' gives each worker its slice of every global "
      "batch (step-for-step identical to one device); 'file' gives each worker its own files; "
      "'auto' picks 'file' when there are at least 4 files per worker, else 'data'.",
      choices=("auto", "data", "file"))
  max_shift: int = setting(
      1, "Images: in training, shift each image by up to this many pixels (0: off).")
  random_flip: bool = setting(
      False, "Images: in training, flip left-right at random (off: a mirrored digit is "
      "another digit).")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = setting(1e-3, "Peak learning rate of the warmup + cosine schedule.")
  warmup_steps: int = setting(10, "Linear warmup steps (default: 5% of train_steps).",
                              flag_default=None)
  min_lr_ratio: float = setting(0.1, "Cosine decay ends at learning_rate * min_lr_ratio.")
  weight_decay: float = setting(
      0.1, "AdamW decoupled weight decay (kernels and embeddings only).")
  clip_norm: float = setting(1.0, "Global gradient norm clip (0 disables).")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model_dir: str = setting("runs/default", "Where checkpoints, summaries and metrics.jsonl go.",
                           flag_default=None)
  train_steps: int = setting(200, "Optimizer steps in total (a resumed run stops here too).")
  global_batch_size: int = setting(16, "Sequences per step, summed over all replicas.")
  seed: int = setting(0, "Seeds initialisation, data order and dropout.")
  log_every: int = setting(10, "Steps between train records in metrics.jsonl.")
  eval_every: int = setting(100, "Steps between evaluations (0: only at the end).")
  eval_steps: int = setting(4, "Global batches per evaluation.")
  checkpoint_every: int = setting(
      100, "Steps between checkpoints (one is always written at the end).")
  keep_checkpoints: int = setting(3, "How many recent checkpoints to keep.")
  async_checkpoint: bool = setting(
      True, "Write checkpoints in the background while training goes on (each process's "
      "slices copied first; a preemption or the end waits for the write in flight).")
  steps_per_call: int = setting(
      10, "Steps run inside one tf.function call (fewer Python round trips).")
  precision: str = setting("float32", "Compute precision policy.", choices=PRECISIONS)
  jit_compile: bool = setting(  # Resolved by tfpar.config.jit_compile_default.
      True, "Compile the step with XLA (faster on CPU and GPU in float32). Default: on, but off "
      "under --precision=mixed_bfloat16 except with --strategy=tpu: on an AVX512_BF16 CPU, "
      "TensorFlow's own (oneDNN) bfloat16 matmuls ran the step faster than XLA, whose CPU dot "
      "computes bfloat16 in float32 (docs/benchmarks.md); on GPUs that is not measured, pass "
      "--jit_compile there.", flag_default=None)
  xla_auto_clustering: str = setting(  # Resolved by tfpar.config.auto_clustering_default.
      "none", "For a step not compiled whole (--nojit_compile): 'fusible' lets TensorFlow's XLA "
      "auto-clustering compile the elementwise ops (norms, activations, softmax, the update) "
      "and leaves the matmuls to TensorFlow's own (oneDNN) kernels; 'none' runs every op as "
      "its own kernel. Default: fusible under --precision=mixed_bfloat16 without --jit_compile on "
      "one_device and mirrored, else none (refused with pipeline stages on other workers). Set through TF_XLA_FLAGS as the process starts (docs/benchmarks.md).",
      choices=XLA_AUTO_CLUSTERING, flag_default=None)
  host_allocator: str = setting(
      "bfc", "How TensorFlow holds tensors in host (CPU) memory. 'bfc': its oneDNN allocator's "
      "pool, which keeps freed blocks for the next tensors (the faster steps; a process stays "
      "resident at the pool's high-water mark, its fragments included); 'system': malloc, each "
      "block of 256 KiB or more mapped on its own and given back to the OS once freed, so "
      "resident memory follows the tensors alive (less of it, slower steps: every new block "
      "faults its pages in; docs/sharded_state.md). Set as the process starts.",
      choices=HOST_ALLOCATORS)
  fused_projections: bool = setting(  # tfpar.layers.fused; the weights are the same.
      False, "Compute each attention's Q, K, V (and a gated MLP's gate and up) as one matmul "
      "per tensor shard instead of three (two); same weights and checkpoints, same losses.")
  causal_attention: str = setting(  # tfpar.layers.attention.CAUSAL_CORES.
      "query_blocks", "How causal attention skips the masked blocks above the diagonal: "
      "'query_blocks' (each query block against the keys up to it, one softmax) or "
      "'online_softmax' (query and key blocks, FlashAttention's running softmax); same "
      "result.", choices=CAUSAL_ATTENTION)
  on_nonfinite: str = setting(  # See tfpar.training.loop.
      "stop", "A step whose loss or gradient norm is NaN or infinite: 'stop' names it and exits "
      "(status 3) without saving, so the last checkpoint is the last good state; 'skip' "
      "drops that step's update, counts it, and goes on.", choices=ON_NONFINITE)
  profile_steps: Optional[Tuple[int, int]] = setting(  # (first, last) traced with tf.profiler
      None, "FIRST,LAST: trace steps FIRST..LAST with tf.profiler into --model_dir "
      "(TensorBoard's Profile tab; scripts/dp_profile.py reads it), on the chief.")


@dataclasses.dataclass(frozen=True)
class DistConfig:
  strategy: str = setting("one_device", "tf.distribute strategy.", choices=STRATEGIES)
  num_cpu_devices: int = setting(
      1, "Split the host CPU into this many logical devices before TF starts.")
  collective: str = setting("auto", "Collective implementation for multi_worker_mirrored.",
                            choices=("auto", "ring", "nccl"))
  collective_timeout: int = setting(
      300, "Seconds a worker waits for its peers at start-up (to agree on the flags), and a "
      "parameter-server chief for a step to finish, before the job fails (1 to 86400). A peer "
      "that dies or freezes mid-step fails the step through TensorFlow's heartbeats.")
  tpu: str = setting("local", "TPU to use with --strategy=tpu: local, a name, or grpc://ADDR.")
  ps_shards: int = setting(1, "Partition large variables over this many parameter servers.")
  all_reduce_pack_mb: float = setting(  # 0: TensorFlow picks the pack size.
      0.0, "multi_worker_mirrored: pack the gradient all-reduce into chunks of this many MiB "
      "(CommunicationOptions.bytes_per_pack; 0: TensorFlow decides); stages on different "
      "workers: sum a stage's copies in buckets of blocks of this many MiB, each as soon as "
      "the backward has finished it (0: one bucket per block).")


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
  """How the data-parallel gradient all-reduce is compressed (tfpar.parallel.compression)."""
  method: str = setting(
      "none", "Compress the data-parallel gradient all-reduce: fp16/bf16 casts (half the "
      "bytes), powersgd sends a rank --powersgd_rank approximation with error feedback.",
      flag="grad_compression", choices=COMPRESSIONS)
  rank: int = setting(4, "PowerSGD rank R: (m + n) x R floats per m x n matrix.",
                      flag="powersgd_rank")
  warmup_steps: int = setting(
      0, "Uncompressed steps before PowerSGD starts (the first gradients change fastest).",
      flag="powersgd_warmup_steps")
  min_size: int = setting(  # PowerSGD sends smaller matrices uncompressed.
      1024, "PowerSGD sends matrices with fewer elements than this (and all vectors) "
      "uncompressed.", flag="powersgd_min_size")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  pipeline_stages: int = setting(1, "Pipeline stages (devices) per model replica.")
  microbatches: int = setting(1, "Micro-batches per replica batch in the pipeline.")
  stage_layers: Optional[Tuple[int, ...]] = setting(
      None, "Blocks per pipeline stage, e.g. 3,3,2 (default: balanced).")
  pipeline_schedule: str = setting(
      "gpipe", "Order of the pipeline's forwards and backwards: gpipe (every micro-batch's "
      "activations kept until the backward), 1f1b (at most K micro-batches' on stage 0) or "
      "interleaved (1F1B over --virtual_stages chunks per device: a v times smaller bubble).",
      choices=PIPELINE_SCHEDULES)
  virtual_stages: int = setting(
      1, "--pipeline_schedule=interleaved: chunks of blocks per device (v >= 2).")
  tensor_parallel: int = setting(1, "Devices each attention and MLP block is split over.")
  sequence_parallel: bool = setting(
      False, "With --tensor_parallel=T > 1: each block's LayerNorms (RMSNorms), dropouts and "
      "residual adds run on 1/T of the sequence on each tensor shard's device, the shards' "
      "sum becomes a reduce-scatter and their input an all-gather along the sequence "
      "(Korthikanti et al. 2022). Same numbers with --dropout=0; less activation memory.")
  data_parallel: Optional[int] = setting(
      None, "Model replicas for model-parallel runs (default: what the devices allow).")
  optimizer_sharding: str = setting(
      "none", "mirrored, multi_worker_mirrored and the --data_parallel copies of a pipeline/"
      "tensor plan: each of the D replicas keeps AdamW's m and v for 1/D of the parameters "
      "(per device of its plan row), zero1, and also only its 1/D of the summed gradient "
      "through the update, zero2 (the weights stay replicated); zero3 (mirrored, "
      "multi_worker_mirrored, and a mirrored pipeline plan's --data_parallel copies on one "
      "host: each stage's weights over its D copies; not tensor parallel, 1f1b/interleaved or "
      "plans across workers) also only 1/D of the weights, each block's gathered when it runs "
      "and again, recomputed, in its backward. Same numbers as none.",
      choices=OPTIMIZER_SHARDING)
  remat: str = setting(
      "none", "What each block recomputes in the backward pass: none keeps every activation, "
      "full keeps only the block's input (about 33% more compute), selective only the "
      "attention core softmax(QK^T/sqrt(d))V, its O(seq_len^2) scores and probabilities (a few % "
      "more). --remat alone means full, --noremat none.", choices=REMAT, boolean=("none", "full"))

  @property
  def model_parallel(self) -> bool:
    """True when the model itself is split (pipeline, tensor, or an explicit plan)."""
    return (self.pipeline_stages > 1 or self.tensor_parallel > 1 or self.remat != "none"
            or self.data_parallel is not None or self.microbatches > 1
            or self.pipeline_schedule != "gpipe")


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


@dataclasses.dataclass(frozen=True)
class Setting:
  """One field of one section, as the command line sees it."""
  section: str  # "model", "optim", ...: the Config field holding it.
  field: dataclasses.Field
  flag: str  # The flag's name.
  kind: type  # bool, int, float, str or tuple (a list flag).
  default: object  # The flag's default.
  help: str
  choices: Tuple[str, ...]
  boolean: Tuple[str, ...] = ()  # (off, on) where --noflag / --flag alone stand for choices.


def _kind(annotation) -> type:
  """bool, int, float, str or tuple, from a field's annotation (Optional stripped)."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  base = args[0] if typing.get_origin(annotation) is typing.Union else annotation
  return typing.get_origin(base) or base


def settings(kind=Config):
  """Every Setting of `kind` (a section class, or Config for all), in field order."""
  sections = ([(s.name, s.default.__class__) for s in dataclasses.fields(Config)]
              if kind is Config else [(None, kind)])
  out = []
  for section, cls in sections:
    for f in dataclasses.fields(cls):
      meta = f.metadata
      flag_default = meta["flag_default"]
      out.append(Setting(section, f, meta["flag"] or f.name, _kind(f.type),
                         f.default if flag_default is UNSET else flag_default,
                         meta["help"], meta["choices"], meta["boolean"]))
  return out
