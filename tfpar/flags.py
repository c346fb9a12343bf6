"""The central place to define tfpar's flags.

Every absl flag of `python -m tfpar.train` is defined here and nowhere else.
`tfpar.config.from_flags` turns them into a frozen, validated `Config` before
TensorFlow initialises; nothing below the entry point reads `FLAGS`.
"""

from absl import flags

from tfpar import tasks


def _define(define, flag_values, *args, **kwargs):
  define(*args, flag_values=flag_values, **kwargs)

STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "tpu")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagValues:
  """Defines all training flags on `flag_values` (idempotent); returns it."""
  if "train_steps" in flag_values:
    return flag_values
  fv = flag_values
  # What is learned.
  _define(flags.DEFINE_enum, fv, "task", "lm", list(tasks.NAMES),
          "What to train: 'lm' a byte-level GPT on text; with a ViT on images, 'classify' "
          "(a class per image), 'detect' (boxes and classes) or 'segment' (a class per pixel) "
          "(the model, data, loss and metrics come from tfpar.tasks).")
  # Data.
  _define(flags.DEFINE_string, fv,
      "data", None,
      "What to train on, by --task. lm: text, as a file, a directory, a glob of text files, "
      "or TFRecord shards (*.tfrecord, a tf.train.Example with a bytes feature "
      "--tfrecord_key); default: the Python standard library's own source files, present on "
      "every machine. classify: a directory with one sub-directory of images per class "
      "(DIR/<class>/*.png|jpg); default: scikit-learn's digits. detect: a COCO instances "
      "JSON (images relative to its directory); segment: a directory with images/NAME.png|jpg "
      "and masks/NAME.png (pixel = class id); default for both: canvases of the digits. "
      "Any vision task also reads TFRecord shards (tfpar/data/image_records.py); "
      "tfpar/data/images.py describes the layouts.")
  _define(flags.DEFINE_string, fv, "tfrecord_key", "text",
          "--task=lm: the bytes feature holding the text in TFRecord examples.")
  _define(flags.DEFINE_float, fv, "eval_fraction", 0.05, "Fraction of the corpus (its tail) held out for eval.")
  _define(flags.DEFINE_enum, fv, 
      "input_sharding", "auto", ["auto", "data", "file"],
      "How workers split the input: 'data' gives each worker its slice of every global batch "
      "(step-for-step identical to one device); 'file' gives each worker its own files; "
      "'auto' picks 'file' when there are at least 4 files per worker, else 'data'.")
  _define(flags.DEFINE_integer, fv, "max_shift", 1,
          "Images: in training, shift each image by up to this many pixels (0: off).")
  _define(flags.DEFINE_bool, fv, "random_flip", False,
          "Images: in training, flip left-right at random (off: a mirrored digit is another digit).")
  # Output.
  _define(flags.DEFINE_string, fv, "model_dir", None, "Where checkpoints, summaries and metrics.jsonl go.")
  # Model.
  _define(flags.DEFINE_integer, fv, "seq_len", 128, "Tokens (bytes) per training sequence.")
  _define(flags.DEFINE_integer, fv, "num_layers", 4, "Transformer blocks.")
  _define(flags.DEFINE_integer, fv, "d_model", 128, "Width of the residual stream.")
  _define(flags.DEFINE_integer, fv, "num_heads", 4, "Attention heads; must divide d_model.")
  _define(flags.DEFINE_integer, fv, "d_ff", None, "MLP hidden width (default 4 * d_model).")
  _define(flags.DEFINE_float, fv, "dropout", 0.0, "Dropout rate (0 for pretraining-style runs, as nanoGPT).")
  _define(flags.DEFINE_enum, fv, "positions", "learned", ["learned", "rotary"], "Position encoding.")
  _define(flags.DEFINE_integer, fv, "vocab_size", 256,
          "Embedding rows (256: byte-level, what the data pipeline feeds; larger sizes "
          "model a tokenizer's vocabulary, e.g. for tfpar.plan).")
  # Vision model (--task=classify, detect, segment).
  _define(flags.DEFINE_integer, fv, "image_size", 8, "Image height and width in pixels (square).")
  _define(flags.DEFINE_integer, fv, "patch_size", 2, "ViT patch height and width; must divide --image_size.")
  _define(flags.DEFINE_integer, fv, "num_channels", 1,
          "Image channels: 1 grey, 3 RGB or 4 RGBA (PNG only); the built-in digits are grey.")
  _define(flags.DEFINE_integer, fv, "num_classes", 10, "Classes of the task's labels (ids 0..num_classes-1).")
  _define(flags.DEFINE_enum, fv, "pooling", "cls", ["cls", "mean"],
          "How the ViT pools patches for the classifier: a class token, or the mean of patches.")
  # Optimisation.
  _define(flags.DEFINE_integer, fv, "train_steps", 200, "Optimizer steps in total (a resumed run stops here too).")
  _define(flags.DEFINE_integer, fv, "global_batch_size", 16, "Sequences per step, summed over all replicas.")
  _define(flags.DEFINE_float, fv, "learning_rate", 1e-3, "Peak learning rate of the warmup + cosine schedule.")
  _define(flags.DEFINE_integer, fv, "warmup_steps", None, "Linear warmup steps (default: 5% of train_steps).")
  _define(flags.DEFINE_float, fv, "min_lr_ratio", 0.1, "Cosine decay ends at learning_rate * min_lr_ratio.")
  _define(flags.DEFINE_float, fv, "weight_decay", 0.1, "AdamW decoupled weight decay (kernels and embeddings only).")
  _define(flags.DEFINE_float, fv, "clip_norm", 1.0, "Global gradient norm clip (0 disables).")
  _define(flags.DEFINE_integer, fv, "seed", 0, "Seeds initialisation, data order and dropout.")
  # Cadence.
  _define(flags.DEFINE_integer, fv, "log_every", 10, "Steps between train records in metrics.jsonl.")
  _define(flags.DEFINE_integer, fv, "eval_every", 100, "Steps between evaluations (0: only at the end).")
  _define(flags.DEFINE_integer, fv, "eval_steps", 4, "Global batches per evaluation.")
  _define(flags.DEFINE_integer, fv, "checkpoint_every", 100, "Steps between checkpoints (one is always written at the end).")
  _define(flags.DEFINE_integer, fv, "keep_checkpoints", 3, "How many recent checkpoints to keep.")
  _define(flags.DEFINE_list, fv, "profile_steps", None,
          "FIRST,LAST: trace steps FIRST..LAST with tf.profiler into --model_dir (TensorBoard's "
          "Profile tab; scripts/dp_profile.py reads it), on the chief.")
  _define(flags.DEFINE_integer, fv, "steps_per_call", 10,
                       "Steps run inside one tf.function call (fewer Python round trips).")
  # Numerics and compilation.
  _define(flags.DEFINE_enum, fv, "precision", "float32", list(PRECISIONS), "Compute precision policy.")
  _define(flags.DEFINE_bool, fv, "jit_compile", True, "Compile the step with XLA (faster on CPU and GPU).")
  _define(flags.DEFINE_enum, fv, "on_nonfinite", "stop", ["stop", "skip"],
          "A step whose loss or gradient norm is NaN or infinite: 'stop' names it and exits "
          "(status 3) without saving, so the last checkpoint is the last good state; 'skip' "
          "drops that step's update, counts it, and goes on.")
  # Distribution.
  _define(flags.DEFINE_enum, fv, "strategy", "one_device", list(STRATEGIES), "tf.distribute strategy.")
  _define(flags.DEFINE_integer, fv, "num_cpu_devices", 1,
                       "Split the host CPU into this many logical devices before TF starts.")
  _define(flags.DEFINE_enum, fv, "collective", "auto", ["auto", "ring", "nccl"],
                    "Collective implementation for multi_worker_mirrored.")
  _define(flags.DEFINE_integer, fv, "collective_timeout", 300,
                       "Seconds a collective waits for a peer before the job fails (1 to 86400).")
  _define(flags.DEFINE_string, fv, "tpu", "local", "TPU to use with --strategy=tpu: local, a name, or grpc://ADDR.")
  _define(flags.DEFINE_float, fv, "all_reduce_pack_mb", 0.0,
          "multi_worker_mirrored: pack the gradient all-reduce into chunks of this many MiB "
          "(CommunicationOptions.bytes_per_pack; 0: TensorFlow decides).")
  # Gradient compression (tfpar.parallel.compression; docs/compression.md).
  _define(flags.DEFINE_enum, fv, "grad_compression", "none", ["none", "fp16", "bf16", "powersgd"],
          "Compress the data-parallel gradient all-reduce: fp16/bf16 casts (half the bytes), "
          "powersgd sends a rank --powersgd_rank approximation with error feedback.")
  _define(flags.DEFINE_integer, fv, "powersgd_rank", 4, "PowerSGD rank R: (m + n) x R floats per m x n matrix.")
  _define(flags.DEFINE_integer, fv, "powersgd_warmup_steps", 0,
          "Uncompressed steps before PowerSGD starts (the first gradients change fastest).")
  _define(flags.DEFINE_integer, fv, "powersgd_min_size", 1024,
          "PowerSGD sends matrices with fewer elements than this (and all vectors) uncompressed.")
  _define(flags.DEFINE_integer, fv, "ps_shards", 1, "Partition large variables over this many parameter servers.")
  # Model parallelism.
  _define(flags.DEFINE_integer, fv, "pipeline_stages", 1, "Pipeline stages (devices) per model replica.")
  _define(flags.DEFINE_integer, fv, "microbatches", 1, "Micro-batches per replica batch in the pipeline.")
  _define(flags.DEFINE_list, fv, "stage_layers", None, "Blocks per pipeline stage, e.g. 3,3,2 (default: balanced).")
  _define(flags.DEFINE_integer, fv, "tensor_parallel", 1, "Devices each attention and MLP block is split over.")
  _define(flags.DEFINE_integer, fv, "data_parallel", None,
                       "Model replicas for model-parallel runs (default: what the devices allow).")
  _define(flags.DEFINE_bool, fv, "remat", False, "Recompute each block's activations in the backward pass.")
  return fv


PLAN_FORMATS = ("text", "json")


def define_plan_flags(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagValues:
  """Defines the flags of `python -m tfpar.plan` on top of the training flags (idempotent)."""
  fv = define_flags(flag_values)
  if "cluster" in fv:
    return fv
  _define(flags.DEFINE_string, fv, "cluster", None,
          "Devices to plan for: a100-40gb:N, a100-80gb:N, h100-80gb:N, tpu-v4:N, tpu-v5p:N, "
          "cpu:N (logical CPUs of this host) or a YAML cluster file (docs/planner.md).")
  _define(flags.DEFINE_integer, fv, "top", 5, "How many plans to print.")
  _define(flags.DEFINE_string, fv, "emit_flags", None,
          "Write the best plan as a flagfile for python -m tfpar.train to this path.")
  _define(flags.DEFINE_bool, fv, "explain", False,
          "Print the cost model's formulas with the best plan's numbers substituted.")
  _define(flags.DEFINE_enum, fv, "format", "text", list(PLAN_FORMATS), "Output format.")
  _define(flags.DEFINE_enum, fv, "system", "tfpar", ["tfpar", "megatron"],
          "Layout to plan for: what tfpar runs (GPipe, embedding unsplit, a replica per worker) "
          "or Megatron-LM's (1F1B, vocabulary-parallel embedding; for comparison).")
  return fv


def parse(argv) -> flags.FlagValues:
  """Parses a list of '--name=value' strings into fresh FlagValues (tests, tools)."""
  fv = define_flags(flags.FlagValues())
  fv(['tfpar'] + list(argv))
  return fv


KINDS = ("tfjob", "jobset", "indexed-job")


def define_render_flags(flag_values: flags.FlagValues) -> flags.FlagValues:
  """Defines the flags of `python -m tfpar.k8s render` on `flag_values`; returns it."""
  fv = flag_values
  _define(flags.DEFINE_enum, fv, "kind", None, list(KINDS),
          "Workload: a Kubeflow TFJob (the operator writes TF_CONFIG), a JobSet (restarts the "
          "whole group), or an Indexed Job with a headless Service (no extra controller).")
  _define(flags.DEFINE_string, fv, "name", None,
          "Name of the job, its Service and NetworkPolicy (a DNS label: a-z, 0-9, '-').")
  _define(flags.DEFINE_integer, fv, "workers", None, "Worker pods.", lower_bound=1, upper_bound=1024)
  _define(flags.DEFINE_integer, fv, "ps", 0,
          "Parameter-server pods (--strategy=parameter_server; a chief pod is added).",
          lower_bound=0, upper_bound=256)
  _define(flags.DEFINE_string, fv, "image", None, "Container image built from the repo's Dockerfile.")
  _define(flags.DEFINE_integer, fv, "gpus_per_worker", 0, "nvidia.com/gpu limit of each worker.",
          lower_bound=0, upper_bound=16)
  _define(flags.DEFINE_string, fv, "tpu_topology", None,
          "GKE TPU slice topology, e.g. 2x4 (with --strategy=tpu and --tpu_accelerator).")
  _define(flags.DEFINE_string, fv, "tpu_accelerator", None,
          "GKE TPU accelerator node label, e.g. tpu-v5-lite-podslice.")
  _define(flags.DEFINE_string, fv, "cpu", "4", "CPU request of each pod (a Kubernetes quantity).")
  _define(flags.DEFINE_string, fv, "memory", "16Gi",
          "Memory request and limit of each pod (a Kubernetes quantity).")
  _define(flags.DEFINE_string, fv, "pvc", None,
          "A ReadWriteMany PersistentVolumeClaim mounted in every pod at --mount_path, for a "
          "local --model_dir (not needed when --model_dir is a bucket, gs://...).")
  _define(flags.DEFINE_string, fv, "mount_path", "/mnt/tfpar", "Where --pvc is mounted.")
  _define(flags.DEFINE_integer, fv, "port", 2222, "Port of TensorFlow's gRPC server in every pod.",
          lower_bound=1024, upper_bound=65535)
  _define(flags.DEFINE_integer, fv, "grace_seconds", 300,
          "terminationGracePeriodSeconds: time from SIGTERM to SIGKILL, to save a checkpoint.",
          lower_bound=30, upper_bound=3600)
  _define(flags.DEFINE_integer, fv, "max_restarts", None,
          "Whole-job restarts (JobSet failurePolicy; TFJob backoffLimit with parameter servers). "
          "Default: 3 where the kind can restart the whole job, else 0.",
          lower_bound=0, upper_bound=100)
  _define(flags.DEFINE_integer, fv, "peer_timeout", 300,
          "Seconds a pod waits for its peers' DNS names before failing (JobSet, Indexed Job).",
          lower_bound=1, upper_bound=3600)
  return fv
