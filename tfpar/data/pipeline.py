"""tf.data pipelines: packed fixed-length windows, a held-out split, per-replica shards.

Packing: the token stream (all documents joined) is cut into non-overlapping
windows of `seq_len + 1` tokens, stride `seq_len`; a window gives inputs
`w[:-1]` and targets `w[1:]`.

Order: sample position p (0, 1, 2, ... over endless epochs) reads window
`index_shuffle(p mod N, seed=(seed, p div N))`, a stateless permutation per
epoch. The order is a pure function of (seed, position), so a resumed run
starts at position `step * global_batch` with nothing to replay or store, and
every worker agrees on it without talking.

Sharding: global batch t holds positions [t*G, (t+1)*G). Replica g of R takes
positions t*G + g*B + [0, B) with B = G / R, so the R replicas together see
exactly the global batch one device would see (step-for-step identical loss),
and within an epoch no replica sees a window twice or another replica's window.
"""

import dataclasses
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tfpar.console import count
from tfpar.data import corpus


@dataclasses.dataclass(frozen=True)
class Shard:
  """Which slice of the global batch one input pipeline produces.

  Attributes:
    global_batch_size: G, sequences per step over all replicas.
    num_replicas: R, replicas in sync over the whole job.
    first_replica: global index of this pipeline's first replica.
    local_replicas: replicas this pipeline feeds (consecutive elements go to
      consecutive local replicas, as tf.distribute expects).
  """
  global_batch_size: int
  num_replicas: int = 1
  first_replica: int = 0
  local_replicas: int = 1

  @property
  def per_replica_batch(self) -> int:
    return self.global_batch_size // self.num_replicas


def shard_for_pipeline(ctx, global_batch_size: int, *, file_level: bool = False) -> Shard:
  """The Shard one tf.distribute input pipeline reads (see the module docstring).

  Args:
    ctx: the tf.distribute.InputContext handed to a dataset function.
    global_batch_size: G.
    file_level: the pipeline reads its own files ('file' sharding): its
      replicas take consecutive slices of its own G / num_pipelines batch.
  """
  local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
  if file_level:
    return Shard(global_batch_size // ctx.num_input_pipelines, local, 0, local)
  return Shard(global_batch_size, ctx.num_replicas_in_sync, ctx.input_pipeline_id * local, local)


def split_tokens(tokens: np.ndarray, seq_len: int, eval_fraction: float
                 ) -> Tuple[np.ndarray, np.ndarray]:
  """Holds out the tail of the stream for evaluation; both parts hold whole windows."""
  n_eval = max(int(len(tokens) * eval_fraction), seq_len + 1)
  if len(tokens) - n_eval < 2 * (seq_len + 1):
    raise corpus.DataError(
        f"the data has {count(len(tokens), 'token')}, too few for --seq_len={seq_len} with a "
        "held-out split: give more text or a shorter --seq_len")
  return tokens[:-n_eval], tokens[-n_eval:]


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
  return (len(tokens) - 1) // seq_len


def sample_positions(shard: Shard, *, start_step: int = 0) -> tf.data.Dataset:
  """Endless dataset of per-replica batches of global sample positions p, int64 [B]."""
  b, g = shard.per_replica_batch, shard.global_batch_size

  def positions(k):
    step = start_step + k // shard.local_replicas
    replica = shard.first_replica + k % shard.local_replicas
    return step * g + replica * b + tf.range(b, dtype=tf.int64)  # [B]

  return tf.data.Dataset.range(2**62).map(positions, num_parallel_calls=tf.data.AUTOTUNE,
                                          deterministic=True)


def index_at(positions, num_samples: int, *, seed: int, shuffle: bool = True):
  """The sample each position p reads: index_shuffle(p mod N, seed=(seed, p div N)), int64."""
  epoch, within = positions // num_samples, positions % num_samples
  if not shuffle:
    return within
  n = tf.shape(positions, out_type=tf.int64)
  seeds = tf.stack([tf.fill(n, tf.constant(seed, tf.int64)), epoch,
                    tf.zeros(n, tf.int64)], axis=-1)  # [..., 3]: one permutation per epoch
  # The raw op: tf.random.experimental.index_shuffle mis-pads a batch of seeds.
  return tf.raw_ops.RandomIndexShuffle(
      index=within, seed=seeds, max_index=tf.fill(n, tf.cast(num_samples - 1, tf.int64)))


def sample_indices(num_samples: int, shard: Shard, *, seed: int, start_step: int = 0,
                   shuffle: bool = True) -> tf.data.Dataset:
  """Endless dataset of per-replica batches of sample (window) indices, int64 [B]."""
  return sample_positions(shard, start_step=start_step).map(
      lambda p: index_at(p, num_samples, seed=seed, shuffle=shuffle),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def window_dataset(tokens: np.ndarray, seq_len: int, shard: Shard, *, seed: int,
                   start_step: int = 0, shuffle: bool = True) -> tf.data.Dataset:
  """Per-replica batches (inputs, targets), int32 [B, seq_len] each, endless."""
  n = num_windows(tokens, seq_len)
  if n < 1:
    raise corpus.DataError(f"fewer than {seq_len + 1} tokens: give more text or a shorter --seq_len")
  stream = tf.constant(tokens)
  offsets = tf.range(seq_len + 1, dtype=tf.int64)[tf.newaxis, :]

  def gather(idx):
    windows = tf.gather(stream, idx[:, tf.newaxis] * seq_len + offsets)  # [B, L+1]
    windows = tf.cast(windows, tf.int32)
    return windows[:, :-1], windows[:, 1:]

  ds = sample_indices(n, shard, seed=seed, start_step=start_step, shuffle=shuffle)
  ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  options = tf.data.Options()
  options.deterministic = True
  # We shard by construction (see module docstring): tell tf.distribute not to.
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


@dataclasses.dataclass
class Corpus:
  """The train and held-out token streams one input pipeline reads."""
  train: np.ndarray
  eval: np.ndarray
  files: Tuple[str, ...]


def choose_sharding(policy: str, num_files: int, num_workers: int) -> str:
  """'auto' reads per-worker files when every worker gets at least four of them."""
  if policy != "auto":
    return policy
  return "file" if num_workers > 1 and num_files >= 4 * num_workers else "data"


def load_corpus(data: Optional[str], *, seq_len: int, eval_fraction: float,
                tfrecord_key: str = "text", worker_index: int = 0, num_workers: int = 1,
                sharding: str = "data", tokenizer=None) -> Corpus:
  """Reads the text this worker needs: everything ('data') or its own files ('file'), as
  `tokenizer`'s ids (default: bytes). The held-out split is the tail of the id stream."""
  files = corpus.list_files(data)
  if sharding == "file":
    if len(files) < num_workers:
      raise corpus.DataError(f"--input_sharding=file needs at least one file per worker "
                             f"({count(len(files), 'file')}, {num_workers} workers): use "
                             "--input_sharding=data")
    files = files[worker_index::num_workers]
  tokens = corpus.read_tokens(files, tfrecord_key, tokenizer)
  train, held_out = split_tokens(tokens, seq_len, eval_fraction)
  return Corpus(train=train, eval=held_out, files=tuple(files))
