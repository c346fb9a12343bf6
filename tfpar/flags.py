"""The central place to define tfpar's flags.

Every absl flag of `python -m tfpar.train` is defined here and nowhere else.
`tfpar.config.from_flags` turns them into a frozen, validated `Config` before
TensorFlow initialises; nothing below the entry point reads `FLAGS`.
"""

from absl import flags

STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "tpu")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def define_flags():
  """Defines all training flags (idempotent, so tests may import twice)."""
  if "train_steps" in flags.FLAGS:
    return
  # Data.
  flags.DEFINE_string(
      "data", None,
      "Text to train on: a file, a directory, a glob of text files, or TFRecord shards "
      "(*.tfrecord, a tf.train.Example with a bytes feature --tfrecord_key). "
      "Default: the Python standard library's own source files, present on every machine.")
  flags.DEFINE_string("tfrecord_key", "text", "Feature holding the text in TFRecord examples.")
  flags.DEFINE_float("eval_fraction", 0.05, "Fraction of the corpus (its tail) held out for eval.")
  flags.DEFINE_enum(
      "input_sharding", "auto", ["auto", "data", "file"],
      "How workers split the input: 'data' gives each worker its slice of every global batch "
      "(step-for-step identical to one device); 'file' gives each worker its own files; "
      "'auto' picks 'file' when there are at least 4 files per worker, else 'data'.")
  # Output.
  flags.DEFINE_string("model_dir", None, "Where checkpoints, summaries and metrics.jsonl go.")
  # Model.
  flags.DEFINE_integer("seq_len", 128, "Tokens (bytes) per training sequence.")
  flags.DEFINE_integer("num_layers", 4, "Transformer blocks.")
  flags.DEFINE_integer("d_model", 128, "Width of the residual stream.")
  flags.DEFINE_integer("num_heads", 4, "Attention heads; must divide d_model.")
  flags.DEFINE_integer("d_ff", None, "MLP hidden width (default 4 * d_model).")
  flags.DEFINE_float("dropout", 0.0, "Dropout rate (0 for pretraining-style runs, as nanoGPT).")
  flags.DEFINE_enum("positions", "learned", ["learned", "rotary"], "Position encoding.")
  # Optimisation.
  flags.DEFINE_integer("train_steps", 200, "Optimizer steps in total (a resumed run stops here too).")
  flags.DEFINE_integer("global_batch_size", 16, "Sequences per step, summed over all replicas.")
  flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate of the warmup + cosine schedule.")
  flags.DEFINE_integer("warmup_steps", None, "Linear warmup steps (default: 5% of train_steps).")
  flags.DEFINE_float("min_lr_ratio", 0.1, "Cosine decay ends at learning_rate * min_lr_ratio.")
  flags.DEFINE_float("weight_decay", 0.1, "AdamW decoupled weight decay (kernels and embeddings only).")
  flags.DEFINE_float("clip_norm", 1.0, "Global gradient norm clip (0 disables).")
  flags.DEFINE_integer("seed", 0, "Seeds initialisation, data order and dropout.")
  # Cadence.
  flags.DEFINE_integer("log_every", 10, "Steps between train records in metrics.jsonl.")
  flags.DEFINE_integer("eval_every", 100, "Steps between evaluations (0: only at the end).")
  flags.DEFINE_integer("eval_steps", 4, "Global batches per evaluation.")
  flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints (one is always written at the end).")
  flags.DEFINE_integer("keep_checkpoints", 3, "How many recent checkpoints to keep.")
  flags.DEFINE_integer("steps_per_call", 10,
                       "Steps run inside one tf.function call (fewer Python round trips).")
  # Numerics and compilation.
  flags.DEFINE_enum("precision", "float32", list(PRECISIONS), "Compute precision policy.")
  flags.DEFINE_bool("jit_compile", True, "Compile the step with XLA (faster on CPU and GPU).")
  # Distribution.
  flags.DEFINE_enum("strategy", "one_device", list(STRATEGIES), "tf.distribute strategy.")
  flags.DEFINE_integer("num_cpu_devices", 1,
                       "Split the host CPU into this many logical devices before TF starts.")
  flags.DEFINE_enum("collective", "auto", ["auto", "ring", "nccl"],
                    "Collective implementation for multi_worker_mirrored.")
  flags.DEFINE_integer("collective_timeout", 300,
                       "Seconds a collective waits for a peer before the job fails (0: forever).")
  flags.DEFINE_string("tpu", "local", "TPU to use with --strategy=tpu: local, a name, or grpc://ADDR.")
  flags.DEFINE_integer("ps_shards", 1, "Partition large variables over this many parameter servers.")
  # Model parallelism.
  flags.DEFINE_integer("pipeline_stages", 1, "Pipeline stages (devices) per model replica.")
  flags.DEFINE_integer("microbatches", 1, "Micro-batches per replica batch in the pipeline.")
  flags.DEFINE_list("stage_layers", None, "Blocks per pipeline stage, e.g. 3,3,2 (default: balanced).")
  flags.DEFINE_integer("tensor_parallel", 1, "Devices each attention and MLP block is split over.")
  flags.DEFINE_integer("data_parallel", None,
                       "Model replicas for model-parallel runs (default: what the devices allow).")
  flags.DEFINE_bool("remat", False, "Recompute each block's activations in the backward pass.")
