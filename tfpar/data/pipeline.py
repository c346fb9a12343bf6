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

Streaming: a prepared set (tfpar.data.prepared) is not read into memory. Its
stream is a TokenStream, and window i is read where it lies: from local files
one `os.pread` per shard it touches, a batch's windows in one call
(TokenStream.windows, in tf.data's parallel map); from a remote store (gs://),
or in a dataset that runs from its graph elsewhere (a parameter server's
workers), one ranged read per shard it touches (tf.data.FixedLengthRecordDataset
with the window's offset as header and the rest of the shard as footer), in
parallel and in order. The windows are those of the same tokens in memory, chosen by the same
positions, so a streamed run and an in-memory run see the same batches, and
each pipeline reads only its own replicas' windows.
"""

import dataclasses
from typing import Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from tfpar.console import count
from tfpar.data import corpus
from tfpar.data import prepared

HEAD_TOKENS = 1 << 20  # Of the held-out stream, what bytes per token is measured on.


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


def head(tokens, n: int = HEAD_TOKENS) -> np.ndarray:
  """The first n tokens of an array or a TokenStream, as an array."""
  return tokens.read(0, n) if isinstance(tokens, prepared.TokenStream) else tokens[:n]


def _read_windows(stream: prepared.TokenStream, seq_len: int):
  """A function: window index -> a dataset of its L+1 tokens' bytes, one scalar string."""
  ends = np.cumsum(stream.sizes)
  files = tf.constant(stream.paths)
  starts, ends = tf.constant(ends - np.asarray(stream.sizes), tf.int64), tf.constant(ends, tf.int64)
  width = stream.itemsize

  def read(index):
    begin = stream.start + index * seq_len
    end = begin + seq_len + 1
    first = tf.searchsorted(ends, begin[tf.newaxis], side="right")[0]
    last = tf.searchsorted(ends, (end - 1)[tf.newaxis], side="right")[0]
    shards = tf.range(first, last + 1)  # Those the window touches, in order.
    shard_start, shard_end = tf.gather(starts, shards), tf.gather(ends, shards)
    lo, hi = tf.maximum(shard_start, begin), tf.minimum(shard_end, end)
    header, size = (lo - shard_start) * width, (hi - lo) * width
    footer = (shard_end - shard_start) * width - header - size
    pieces = tf.data.Dataset.from_tensor_slices((tf.gather(files, shards), header, size, footer))
    return pieces.flat_map(lambda f, h, n, t: tf.data.FixedLengthRecordDataset(
        f, n, header_bytes=h, footer_bytes=t, buffer_size=0)).batch(1 << 16).map(
            tf.strings.reduce_join)

  return read


def window_dataset(tokens, seq_len: int, shard: Shard, *, seed: int, start_step: int = 0,
                   shuffle: bool = True, host_reads: bool = True) -> tf.data.Dataset:
  """Per-replica batches (inputs, targets), int32 [B, seq_len] each, endless.

  `tokens`: an array in memory, or a prepared set's TokenStream (streamed: a local set's
  windows read by `TokenStream.windows` in this process, one call per batch, unless
  `host_reads` is False (a dataset a parameter server's workers run from its graph); a
  remote set's, and those, by one tf.data ranged read per window and shard).
  """
  n = num_windows(tokens, seq_len)
  if n < 1:
    raise corpus.DataError(f"fewer than {seq_len + 1} tokens: give more text or a shorter --seq_len")

  def split(windows):  # [B, L+1]
    windows = tf.cast(windows, tf.int32)
    return windows[:, :-1], windows[:, 1:]

  ds = sample_indices(n, shard, seed=seed, start_step=start_step, shuffle=shuffle)
  if isinstance(tokens, prepared.TokenStream) and tokens.local and host_reads:
    dtype, rows = tf.as_dtype(tokens.dtype), shard.per_replica_batch

    def read(idx):  # [B] -> [B, L+1]: one call per batch (TokenStream.windows).
      windows = tf.numpy_function(lambda i: tokens.windows(i, seq_len), [idx], dtype,
                                  stateful=False)
      return split(tf.ensure_shape(windows, [rows, seq_len + 1]))

    ds = ds.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  elif isinstance(tokens, prepared.TokenStream):
    dtype = tf.as_dtype(tokens.dtype)
    ds = ds.unbatch().interleave(_read_windows(tokens, seq_len), cycle_length=8,
                                 num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # drop_remainder: the stream is endless, and a static batch size is what a pipeline's
    # micro-batch split and its stages' transfers are shaped by.
    ds = ds.batch(shard.per_replica_batch, drop_remainder=True).map(
        lambda raw: split(tf.io.decode_raw(raw, dtype, little_endian=True)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  else:
    stream = tf.constant(tokens)
    offsets = tf.range(seq_len + 1, dtype=tf.int64)[tf.newaxis, :]
    ds = ds.map(lambda idx: split(tf.gather(stream, idx[:, tf.newaxis] * seq_len + offsets)),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  options = tf.data.Options()
  options.deterministic = True
  # We shard by construction (see module docstring): tell tf.distribute not to.
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


@dataclasses.dataclass
class Corpus:
  """The train and held-out token streams one input pipeline reads (arrays, or views of a
  prepared set's TokenStream), and the files they come from."""
  train: Union[np.ndarray, prepared.TokenStream]
  eval: Union[np.ndarray, prepared.TokenStream]
  files: Tuple[str, ...]


def choose_sharding(policy: str, num_files: int, num_workers: int, *,
                    streamed: bool = False) -> str:
  """'auto' reads per-worker files when every worker gets at least four of them; a prepared
  set (`streamed`) is read by windows ('data')."""
  if policy != "auto":
    return policy
  return "file" if num_workers > 1 and num_files >= 4 * num_workers and not streamed else "data"


def load_corpus(data: Optional[str], *, seq_len: int, eval_fraction: float,
                tfrecord_key: str = "text", worker_index: int = 0, num_workers: int = 1,
                sharding: str = "data", tokenizer=None,
                max_text_bytes: int = corpus.MAX_TEXT_BYTES) -> Corpus:
  """Reads the text this worker needs: everything ('data') or its own files ('file'), as
  `tokenizer`'s ids (default: bytes). The held-out split is the tail of the id stream.

  A prepared set (tfpar.data.prepared) is checked against `tokenizer` and
  streamed, not read: its train and held-out streams are views of its shards.
  Text past `max_text_bytes` is refused with the line that says to prepare it.
  """
  directory = prepared.locate(data)
  if directory is not None:
    if sharding == "file":
      raise corpus.DataError(f"--data={data} is a prepared set, which every worker streams by "
                             "windows: --input_sharding=file does not apply; use auto or data")
    stream = prepared.open_set(directory, tokenizer or _bytes_tokenizer())
    train, held_out = split_tokens(stream, seq_len, eval_fraction)
    return Corpus(train=train, eval=held_out, files=stream.paths)
  files = corpus.list_files(data)
  if sharding == "file":
    if len(files) < num_workers:
      raise corpus.DataError(f"--input_sharding=file needs at least one file per worker "
                             f"({count(len(files), 'file')}, {num_workers} workers): use "
                             "--input_sharding=data")
    files = files[worker_index::num_workers]
  corpus.check_in_memory(files, max_text_bytes)
  tokens = corpus.read_tokens(files, tfrecord_key, tokenizer)
  train, held_out = split_tokens(tokens, seq_len, eval_fraction)
  return Corpus(train=train, eval=held_out, files=tuple(files))


def _bytes_tokenizer():
  from tfpar import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  return tokenizer_lib.load("bytes")
