"""Gradient compression: the one reducer every data-parallel exchange goes through.

Data parallelism (tfpar.parallel.data_parallel) SUMs each gradient over the
R replicas: g = sum_r g_r, where g_r is replica r's share of the mean
gradient. As replicas grow, that all-reduce becomes the bottleneck; a
`GradientReducer` can hand the collectives fewer bytes. Every engine calls
it for the data-parallel exchange: the DataParallelEngine's TrainStep, the
hybrid engine's replicas (packed per device) and the parameter-server step
(one replica: the identity). Built from `CompressionConfig`:

none
  g = sum_r g_r in float32, as `all_reduce_gradients` does (the serial twin:
  the same sum one device computes).

fp16
  Each tensor is cast for the all-reduce and back. float16 overflows above
  65504 and loses precision below 2^-14 (subnormal) / flushes to zero below
  2^-24, and per-token gradient shares are small (~1e-6). So every tensor t
  first gets a power-of-two scale from the largest magnitude any replica
  holds:  a_t = max_r max|g_r,t|  (one all-gather of a vector with one
  float32 per tensor, then a local max), s_t = 2^floor(log2(2^15 / (R a_t))). Every partial sum
  of R scaled values is then at most R s_t a_t <= 2^15 < 65504 in any
  reduction order (ring or tree), and the largest entries sit near 2^15,
  where float16 keeps its 11 significant bits. After the SUM, g_t =
  float32(sum_r float16(s_t g_r,t)) / s_t; powers of two scale exactly.
  Non-finite gradients (a loss-scale overflow under mixed_float16) stay
  non-finite, so the LossScaleOptimizer still skips that step.

bf16
  Cast to bfloat16 and back. bfloat16 has float32's exponent range, so no
  scaling is needed (nor done); it keeps 8 significant bits.

powersgd (Vogels, Karimireddy and Jaggi, NeurIPS 2019)
  For each matrix gradient (kernels and embeddings; a higher-rank kernel is
  viewed as [shape[0], prod(shape[1:])]) with at least `min_size` elements
  and (m + n) R < m n, replica r keeps an error-feedback residual e_r
  (m x n) and a warm-started Q (n x R, the same on every replica):

      M_r = g_r + e_r                          # the update plus what was not sent
      P   = sum_r M_r Q                        # all-reduce #1 (m x R per matrix)
      P^  = orthonormal basis of P (QR)
      Q_r = M_r^T P^ ;  Q = sum_r Q_r          # all-reduce #2 (n x R per matrix)
      g   = P^ Q^T  = sum_r P^ P^^T M_r        # what every replica applies
      e_r <- M_r - P^ Q_r^T                    # what replica r did not send
      Q stays for the next step (warm start: one power iteration per step)

  so sum over steps of g + sum_r e_r = sum over steps and replicas of g_r
  exactly (error feedback: nothing is lost, only delayed), and a gradient
  sum of rank <= R is reproduced exactly. Vectors (biases, LayerNorm) and
  matrices below `min_size` are summed uncompressed, in all-reduce #1.
  The first `warmup_steps` steps are uncompressed (no residual builds up).
  The per-replica state (e_r, Q) lives on the replica's device, outside any
  strategy scope; `checkpoint_entries` puts it in the canonical checkpoint:
  every replica's residuals (gathered across workers at save), Q once.

Bytes (per replica per step, those handed to the collectives, counted at
trace time from the tensors actually passed to them; a ring all-reduce puts
2 (R-1)/R times that on each link):

    none:     sum_t 4 |t|
    bf16:     sum_t 2 |t|
    fp16:     sum_t 2 |t| + 4 T                (T tensors: the MAX of the scales)
    powersgd: sum_{compressed m x n} 4 (m + n) R + sum_{others} 4 |t|

Packing: with `devices` (the hybrid engine), each all-reduce concatenates
the tensors that live on one device into one vector there, so a replica
spanning K x T devices runs K x T all-reduces per round rather than one per
tensor; otherwise the strategy packs (--all_reduce_pack_mb for
multi_worker_mirrored).
"""

import collections
import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpar.config import CompressionConfig, ConfigError

FP16_TARGET = 2.0**15  # Bound on any partial sum of scaled values (float16 max is 65504).


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes one replica hands to the collectives in one step."""
  bytes: int
  uncompressed: int


def matrix_shape(shape) -> Optional[tuple]:
  """The 2-D view PowerSGD compresses: [shape[0], prod(shape[1:])], or None for vectors."""
  shape = [int(d) for d in shape]
  if len(shape) < 2:
    return None
  return shape[0], int(np.prod(shape[1:]))


def powersgd_compresses(shape, rank: int, min_size: int) -> bool:
  """Whether PowerSGD sends this tensor as P, Q (it must be a matrix, big enough, and shrink)."""
  mn = matrix_shape(shape)
  if mn is None:
    return False
  m, n = mn
  return m * n >= min_size and (m + n) * rank < m * n


def expected_bytes(shapes: Sequence, compression: CompressionConfig) -> int:
  """The bytes formula of the module docstring, for float32 gradients of these shapes."""
  sizes = [int(np.prod(s)) for s in shapes]
  method = compression.method
  if method == "none":
    return 4 * sum(sizes)
  if method == "bf16":
    return 2 * sum(sizes)
  if method == "fp16":
    return 2 * sum(sizes) + 4 * len(sizes)
  total = 0
  for shape, size in zip(shapes, sizes):
    if powersgd_compresses(shape, compression.rank, compression.min_size):
      m, n = matrix_shape(shape)
      total += 4 * (m + n) * compression.rank
    else:
      total += 4 * size
  return total


def _nbytes(tensors) -> int:
  return sum(int(np.prod(t.shape)) * t.dtype.size for t in tensors)


def all_max(scalars: List[tf.Tensor], devices: Optional[List[str]] = None) -> List[tf.Tensor]:
  """The largest value over the replicas of each [1]-shaped tensor.

  An all-gather and a local max: MirroredStrategy's reduction to one device
  knows only SUM and MEAN.
  """
  ctx = tf.distribute.get_replica_context()
  if devices is None:
    devices = [None] * len(scalars)
  by_device = collections.defaultdict(list)
  for i, device in enumerate(devices):
    by_device[device].append(i)
  out = [None] * len(scalars)
  for device, indices in by_device.items():
    with tf.device(device):
      packed = tf.concat([scalars[i] for i in indices], axis=0)[None]  # [1, n]
      peaks = tf.reduce_max(ctx.all_gather(packed, axis=0), axis=0)  # [n]
      for j, i in enumerate(indices):
        out[i] = peaks[j]
  return out


def all_reduce(op, tensors: List[tf.Tensor], devices: Optional[List[str]] = None) -> List[tf.Tensor]:
  """Reduces each tensor over the replicas in sync (identity with one replica).

  Args:
    op: a tf.distribute.ReduceOp.
    tensors: this replica's tensors.
    devices: if given, the device of each tensor: the tensors of one device
      are concatenated into one vector there and reduced as one.
  """
  ctx = tf.distribute.get_replica_context()
  if ctx is None or ctx.num_replicas_in_sync == 1 or not tensors:
    return list(tensors)
  if devices is None:
    return ctx.all_reduce(op, list(tensors))
  by_device = collections.defaultdict(list)
  for i, device in enumerate(devices):
    by_device[device].append(i)
  packed = []
  for device, indices in by_device.items():
    with tf.device(device):
      packed.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], axis=0))
  reduced = ctx.all_reduce(op, packed)
  out = [None] * len(tensors)
  for (device, indices), flat in zip(by_device.items(), reduced):
    with tf.device(device):
      parts = tf.split(flat, [int(np.prod(tensors[i].shape)) for i in indices])
      for i, part in zip(indices, parts):
        out[i] = tf.reshape(part, tensors[i].shape)
  return out


class GradientReducer:
  """SUMs gradients over the data-parallel replicas, compressed as configured.

  Args:
    compression: the method and its settings.
    variables: one replica's trainable variables (their shapes and devices).
    num_replicas: replicas in sync (all workers).
    state_devices: for each replica in this process, the device of each
      variable's gradient there: where its PowerSGD state lives and, with
      `pack_by_device`, which pack it joins (default: one replica, each
      variable's own device).
    pack_by_device: concatenate the tensors of each device before reducing
      (see the module docstring).
    seed: seeds the first Q (the same on every replica).
  """

  def __init__(self, compression: CompressionConfig, variables, *, num_replicas: int,
               state_devices: Optional[List[List[str]]] = None, pack_by_device: bool = False,
               seed: int = 0):
    self.compression = compression
    self.method = compression.method
    self.num_replicas = num_replicas
    self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
    if state_devices is None and (pack_by_device or self.method == "powersgd"):
      state_devices = [[_device(v) for v in variables]]
    self.state_devices = state_devices
    self.pack_by_device = pack_by_device
    self.traffic: Dict[bool, Traffic] = {}  # compressed? -> bytes per step, set when traced.
    self.compressed = [powersgd_compresses(s, compression.rank, compression.min_size)
                       if self.method == "powersgd" else False for s in self.shapes]
    if self.method == "powersgd" and not any(self.compressed):
      matrices = [matrix_shape(s) for s in self.shapes if len(s) >= 2]
      if not matrices:
        raise ConfigError("--grad_compression=powersgd: the model has no weight matrix to compress")
      m, n = max(matrices, key=lambda mn: mn[0] * mn[1])
      raise ConfigError(
          f"--grad_compression=powersgd with --powersgd_rank={compression.rank} and "
          f"--powersgd_min_size={compression.min_size} compresses none of the model's weights "
          f"(the largest is {m}x{n} = {m * n} elements; a matrix m x n is compressed when "
          "m*n >= min_size and (m+n)*rank < m*n): lower them, or use --grad_compression=bf16")
    self.q: List[Dict[int, tf.Variable]] = []  # Per local replica: variable index -> Q.
    self.error: List[Dict[int, tf.Variable]] = []  # Per local replica: index -> residual.
    if self.method == "powersgd":
      rng = np.random.default_rng(seed)
      q0 = {i: rng.standard_normal((matrix_shape(s)[1], compression.rank)).astype(np.float32)
            for i, s in enumerate(self.shapes) if self.compressed[i]}
      for replica, devices in enumerate(state_devices):
        q, error = {}, {}
        for i in q0:
          with tf.device(devices[i]):
            q[i] = tf.Variable(q0[i], trainable=False, name=f"powersgd_q_{replica}_{i}")
            error[i] = tf.Variable(tf.zeros(matrix_shape(self.shapes[i])), trainable=False,
                                   name=f"powersgd_error_{replica}_{i}")
        self.q.append(q)
        self.error.append(error)

  @property
  def stateful(self) -> bool:
    return bool(self.q)

  def compresses_at(self, step: int) -> bool:
    """Whether the step that starts at optimizer step `step` (0-based) is compressed."""
    return self.method != "none" and step >= (
        self.compression.warmup_steps if self.method == "powersgd" else 0)

  def phases(self, step: int, num_steps: int):
    """[(steps, compressed)] for `num_steps` steps from `step`: warmup first, then compressed."""
    if self.compresses_at(step) or self.method == "none":
      return [(num_steps, self.compresses_at(step))]
    warm = min(num_steps, self.compression.warmup_steps - step)
    return [(warm, False)] + ([(num_steps - warm, True)] if num_steps > warm else [])

  # --- the reduction (replica context) -------------------------------------------
  def reduce(self, grads: List[tf.Tensor], replica: int = 0,
             compressed: bool = True) -> List[tf.Tensor]:
    """Returns sum_r grads (or its compressed estimate); runs on each replica.

    Args:
      grads: this replica's dense gradients, one per variable.
      replica: which local replica this is (picks the PowerSGD state).
      compressed: False during the warmup steps (plain float32 SUM).
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:  # Nothing to exchange.
      self.traffic[compressed] = Traffic(0, 0)
      return list(grads)
    # Static shapes (a traced gradient's may be unknown): the bytes are counted from them.
    grads = [tf.ensure_shape(g, s) for g, s in zip(grads, self.shapes)]
    devices = self.state_devices[replica] if self.pack_by_device else None
    uncompressed = _nbytes(grads)
    method = self.method if compressed else "none"
    with tf.name_scope("grad_exchange"):  # What a profile (scripts/dp_profile.py) counts.
      if method == "none":
        handed = [grads]
        out = all_reduce(tf.distribute.ReduceOp.SUM, grads, devices)
      elif method in ("fp16", "bf16"):
        out, handed = self._reduce_cast(grads, devices)
      else:
        out, handed = self._reduce_powersgd(grads, replica, devices)
    self.traffic[compressed] = Traffic(sum(_nbytes(h) for h in handed), uncompressed)
    return out

  def _reduce_cast(self, grads, devices):
    dtype = tf.float16 if self.method == "fp16" else tf.bfloat16
    handed = []
    if self.method == "fp16":
      # One float32 per tensor: the largest magnitude on any replica (see the docstring).
      peaks = [tf.reshape(tf.reduce_max(tf.abs(g)), [1]) for g in grads]
      handed.append(peaks)
      peaks = all_max(peaks, devices)
      exponents = [tf.clip_by_value(tf.floor(tf.math.log(
          FP16_TARGET / (self.num_replicas * p)) / np.log(2.0)), -100.0, 100.0)
          for p in peaks]
      scales = [tf.pow(2.0, e) for e in exponents]
    else:
      scales = [None] * len(grads)
    cast = [tf.cast(g if s is None else g * s, dtype) for g, s in zip(grads, scales)]
    handed.append(cast)
    summed = all_reduce(tf.distribute.ReduceOp.SUM, cast, devices)
    out = [tf.cast(x, g.dtype) if s is None else tf.cast(x, g.dtype) / s
           for x, g, s in zip(summed, grads, scales)]
    return out, handed

  def _reduce_powersgd(self, grads, replica, devices):
    q_vars, e_vars = self.q[replica], self.error[replica]
    idx = sorted(q_vars)
    m = {}  # i -> M_r = g_r + e_r (m x n)
    for i in idx:
      with tf.device(self.state_devices[replica][i]):
        m[i] = tf.reshape(grads[i], matrix_shape(self.shapes[i])) + e_vars[i]
    plain = [i for i in range(len(grads)) if i not in m]
    # All-reduce #1: every P, and the tensors sent as they are.
    first = [tf.matmul(m[i], q_vars[i]) for i in idx] + [grads[i] for i in plain]
    first_devices = None if devices is None else [devices[i] for i in idx + plain]
    reduced = all_reduce(tf.distribute.ReduceOp.SUM, first, first_devices)
    out = [None] * len(grads)
    for i, g in zip(plain, reduced[len(idx):]):
      out[i] = g
    p_hat = {}
    for i, p in zip(idx, reduced[:len(idx)]):
      p_hat[i] = tf.linalg.qr(p).q  # m x R, orthonormal columns
    # All-reduce #2: every Q_r = M_r^T P^.
    q_local = [tf.matmul(m[i], p_hat[i], transpose_a=True) for i in idx]
    second_devices = None if devices is None else [devices[i] for i in idx]
    q_sum = all_reduce(tf.distribute.ReduceOp.SUM, q_local, second_devices)
    updates = []
    for i, q_r, q in zip(idx, q_local, q_sum):
      with tf.device(self.state_devices[replica][i]):
        out[i] = tf.reshape(tf.matmul(p_hat[i], q, transpose_b=True), self.shapes[i])
        updates.append(e_vars[i].assign(m[i] - tf.matmul(p_hat[i], q_r, transpose_b=True)))
        updates.append(q_vars[i].assign(q))
    with tf.control_dependencies(updates):
      out = [tf.identity(g) for g in out]
    return out, [first, q_local]

  # --- checkpointing -------------------------------------------------------------
  def checkpoint_entries(self, strategy=None) -> dict:
    """Layout entries (tfpar.training.checkpoint) for the PowerSGD state of every replica.

    `compression/powersgd@error` holds every residual of every replica,
    flattened and concatenated in variable order, stacked in replica order
    ([R, sum m n]: one all-gather across workers at save);
    `compression/powersgd@q` holds every Q once (the same on every replica).
    """
    if not self.stateful:
      return {}
    ids = _replica_ids(strategy, len(self.q))
    order = sorted(self.q[0])
    return {
        "compression/powersgd@q": (None, [_Flat([[q[i] for i in order] for q in self.q])]),
        "compression/powersgd@error": (None, [_Flat([[e[i] for i in order] for e in self.error],
                                                    ids, self.num_replicas, strategy)]),
    }


class _Flat:
  """A checkpoint entry: per-replica lists of variables, each list flattened into one vector.

  Without `replica_ids` the lists hold the same values (read the first, set
  all): shape [n]. With them, every replica's vector, in replica order: [R, n].
  """

  def __init__(self, per_replica, replica_ids=None, num_replicas=None, strategy=None):
    self.per_replica, self.ids, self.strategy = per_replica, replica_ids, strategy
    self.sizes = [int(np.prod(v.shape)) for v in per_replica[0]]
    self.dtype = per_replica[0][0].dtype
    n = sum(self.sizes)
    self.shape = tf.TensorShape([n] if replica_ids is None else [num_replicas, n])

  def _vector(self, variables):
    return tf.concat([tf.reshape(v.read_value(), [-1]) for v in variables], axis=0)

  @property
  def value(self):
    if self.ids is None:
      return self._vector(self.per_replica[0])
    if len(self.per_replica) == self.shape[0]:  # Every replica is in this process.
      with tf.device("/cpu:0"):
        return tf.stack([self._vector(self.per_replica[j]) for j in np.argsort(self.ids)])
    local = dict(zip(self.ids, self.per_replica))
    values = self.strategy.experimental_distribute_values_from_function(
        lambda ctx: self._vector(local[ctx.replica_id_in_sync_group])[None])
    return self.strategy.gather(values, axis=0)  # A collective: every worker saves.

  def _assign(self, variables, vector):
    for v, part in zip(variables, np.split(np.asarray(vector), np.cumsum(self.sizes)[:-1])):
      v.assign(part.reshape(v.shape))

  def assign(self, value):
    if self.ids is None:
      for variables in self.per_replica:
        self._assign(variables, value)
    else:
      for r, variables in zip(self.ids, self.per_replica):
        self._assign(variables, value[r])


def _replica_ids(strategy, local: int) -> List[int]:
  """The global replica id of each local replica, in local order."""
  if strategy is None or strategy.num_replicas_in_sync == local:
    return list(range(local))
  ids = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.constant(ctx.replica_id_in_sync_group))
  return [int(x) for x in strategy.experimental_local_results(ids)]


def _device(variable) -> str:
  return getattr(variable, "value", variable).device
