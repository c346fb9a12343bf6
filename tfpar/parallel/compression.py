"""Gradient compression: the codecs behind the gradient exchange (tfpar.parallel.exchange).

Data parallelism SUMs each gradient over the R replicas: g = sum_r g_r,
where g_r is replica r's share of the mean gradient. As replicas grow, that
all-reduce becomes the bottleneck; a codec hands the collectives fewer bytes.
`make_exchange` builds the run's exchange from `CompressionConfig`:

none
  g = sum_r g_r in float32 (`exchange.AllReduce`: the serial twin, the same
  sum one device computes).

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
  strategy scope; `checkpoint_entries` puts it in the canonical checkpoint
  (tfpar.parallel.exchange_state).

Each codec is written once, over per-copy lists of gradients (this
replica's) and two reductions (tfpar.parallel.exchange): a sum and a peak,
collectives over the replicas in sync (`InReplica`) or among a stage's
workers (tfpar.parallel.p2p.Among).

Bytes handed to the collectives per codec: tfpar.parallel.traffic.

"""

from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar.config.schema import CompressionConfig, ConfigError
from tfpar.parallel import exchange_state
from tfpar.parallel.exchange import AllReduce, GradientExchange
from tfpar.parallel.traffic import matrix_shape, powersgd_compresses

FP16_TARGET = 2.0**15  # Bound on any partial sum of scaled values (float16 max is 65504).


class CastExchange(GradientExchange):
  """fp16 (scaled per tensor) or bf16: each tensor cast for the SUM and back."""

  def __init__(self, method: str, variables, **kwargs):
    self.method = method
    super().__init__(variables, **kwargs)

  def _reduce(self, per_copy, replicas, ops):
    dtype = tf.float16 if self.method == "fp16" else tf.bfloat16
    every = range(len(self.shapes))
    handed, scales = [], [None] * len(self.shapes)
    if self.method == "fp16":
      # One float32 per tensor: the largest magnitude on any replica (see the docstring).
      peaks = [[self.beside(r, i, lambda g=g: tf.reshape(tf.reduce_max(tf.abs(g)), [1]))
                for i, g in enumerate(grads)] for r, grads in zip(replicas, per_copy)]
      handed.append(peaks[0])
      scales = []
      for i, p in zip(every, ops.peak(peaks, every)):
        with ops.at(i):
          exponent = tf.clip_by_value(tf.floor(tf.math.log(
              FP16_TARGET / (self.num_replicas * p)) / np.log(2.0)), -100.0, 100.0)
          scales.append(tf.pow(2.0, exponent))
    # Cast beside each gradient: only the narrow copy crosses devices.
    cast = [[self.beside(r, i, lambda g=g, s=s: tf.cast(g if s is None else g * s, dtype))
             for i, (g, s) in enumerate(zip(grads, scales))]
            for r, grads in zip(replicas, per_copy)]
    handed.append(cast[0])
    out = []
    for i, x, s in zip(every, ops.sum(cast, every), scales):
      with ops.at(i):
        x = tf.cast(x, per_copy[0][i].dtype)
        out.append(x if s is None else x / s)
    return out, handed


class PowerSGDExchange(GradientExchange):
  """Rank-R PowerSGD with error feedback and a warm-started Q (see the module docstring).

  Args:
    compression: rank, min_size and warmup_steps.
    variables, num_replicas, state_devices, pack_by_device: as for GradientExchange.
    seed: seeds the first Q (the same on every replica).
    first_q: {variable index: its first Q}, instead of drawing them from `seed` (a stage
      worker's variables are part of the model's: `first_q` of the whole model's shapes).
  """

  method = "powersgd"
  needs_state_devices = True

  def __init__(self, compression: CompressionConfig, variables, *, seed: int = 0, first_q=None,
               **kwargs):
    super().__init__(variables, **kwargs)
    self.warmup_steps = compression.warmup_steps
    self.compressed = [powersgd_compresses(s, compression.rank, compression.min_size)
                       for s in self.shapes]
    if not any(self.compressed):
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
    q0 = first_q if first_q is not None else initial_q(self.shapes, compression, seed)
    for replica, devices in enumerate(self.state_devices):
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
    return True

  def _reduce(self, per_copy, replicas, ops):
    idx = sorted(self.q[replicas[0]])
    plain = [i for i in range(len(self.shapes)) if i not in self.q[replicas[0]]]
    m, first = [], []  # Per copy: {i: M_r = g_r + e_r (m x n)}; [every P_r, the plain tensors].
    for r, grads in zip(replicas, per_copy):
      m_r, p_r = {}, []
      for i in idx:
        with tf.device(self.state_devices[r][i]):
          m_r[i] = tf.reshape(grads[i], matrix_shape(self.shapes[i])) + self.error[r][i]
          p_r.append(tf.matmul(m_r[i], self.q[r][i]))
      m.append(m_r)
      first.append(p_r + [grads[i] for i in plain])
    # All-reduce #1: every P, and the tensors sent as they are.
    reduced = ops.sum(first, idx + plain)
    out = [None] * len(self.shapes)
    for i, g in zip(plain, reduced[len(idx):]):
      out[i] = g
    p_hat = {}
    for i, p in zip(idx, reduced[:len(idx)]):
      with ops.at(i):
        p_hat[i] = tf.linalg.qr(p).q  # m x R, orthonormal columns
    # All-reduce #2: every Q_r = M_r^T P^.
    q_local = []
    for r, m_r in zip(replicas, m):
      q_local.append([])
      for i in idx:
        with tf.device(self.state_devices[r][i]):
          q_local[-1].append(tf.matmul(m_r[i], p_hat[i], transpose_a=True))
    q_sum = ops.sum(q_local, idx)
    for i, q in zip(idx, q_sum):
      with ops.at(i):
        out[i] = tf.reshape(tf.matmul(p_hat[i], q, transpose_b=True), self.shapes[i])
    updates = []
    for r, m_r, q_r in zip(replicas, m, q_local):
      for i, q_ri, q in zip(idx, q_r, q_sum):
        with tf.device(self.state_devices[r][i]):
          updates.append(self.error[r][i].assign(
              m_r[i] - tf.matmul(p_hat[i], q_ri, transpose_b=True)))
          updates.append(self.q[r][i].assign(q))
    with tf.control_dependencies(updates):
      for i, g in enumerate(out):
        with ops.at(i):
          out[i] = tf.identity(g)
    return out, [first[0], q_local[0]]

  def checkpoint_entries(self, strategy=None) -> dict:
    return exchange_state.powersgd_entries(self.q, self.error, self.num_replicas, strategy)


def initial_q(shapes, compression: CompressionConfig, seed: int) -> Dict[int, np.ndarray]:
  """{i: the first Q of matrix i} of the tensors of `shapes` PowerSGD compresses, drawn in
  order from `seed` (the same on every replica)."""
  rng = np.random.default_rng(seed)
  return {i: rng.standard_normal((matrix_shape(s)[1], compression.rank)).astype(np.float32)
          for i, s in enumerate(shapes)
          if powersgd_compresses(s, compression.rank, compression.min_size)}


def make_exchange(compression: CompressionConfig, variables, *, num_replicas: int,
                  state_devices=None, pack_by_device: bool = False,
                  seed: int = 0, first_q=None) -> GradientExchange:
  """The run's gradient exchange: the plain all-reduce, or a codec (`compression.method`)."""
  kwargs = dict(num_replicas=num_replicas, state_devices=state_devices,
                pack_by_device=pack_by_device)
  if compression.method == "none":
    return AllReduce(variables, **kwargs)
  if compression.method in ("fp16", "bf16"):
    return CastExchange(compression.method, variables, **kwargs)
  return PowerSGDExchange(compression, variables, seed=seed, first_q=first_q, **kwargs)


GradientReducer = make_exchange  # The name callers used before the exchange was an interface.
