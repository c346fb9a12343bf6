"""Multi-head self-attention, causal (GPT) or not (ViT), its heads split over tensor shards."""

import keras
import tensorflow as tf
from keras import ops

from tfpar.layers.fused import fused_columns
from tfpar.layers.parallel import ColumnParallelDense, RowParallelDense, TensorParallel


def rotary(x, positions_first: int = 0):
  """Applies rotary position embedding (RoFormer, Su et al. 2021) to x [B, T, H, D]."""
  t, d = ops.shape(x)[1], ops.shape(x)[-1]
  inv_freq = 1.0 / (10000.0 ** (ops.arange(0, d, 2, dtype="float32") / d))  # [D/2]
  pos = ops.arange(positions_first, positions_first + t, dtype="float32")  # [T]
  angles = ops.einsum("t,f->tf", pos, inv_freq)  # [T, D/2]
  cos = ops.cast(ops.cos(angles), x.dtype)[None, :, None, :]  # [1, T, 1, D/2]
  sin = ops.cast(ops.sin(angles), x.dtype)[None, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return ops.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


# Causal attention computed in query blocks: block i (queries [i*S, (i+1)*S))
# only needs keys [0, (i+1)*S), so the fully masked upper-right blocks of the
# [T, T] scores are never computed. The result is the same softmax: a masked
# score contributes exp(-1e9 - max) = 0 exactly. With 4 blocks the scores,
# softmax and their gradients shrink to 10/16 of the full square; on CPU that
# is a quarter less time in attention at T=256. Blocks of fewer than
# MIN_QUERY_BLOCK queries cost more in small ops than they save.
MIN_QUERY_BLOCK = 64
MAX_QUERY_BLOCKS = 8


def query_blocks(t) -> int:
  """How many query blocks `causal_attention` splits a static length t into (1: none)."""
  if t is None:
    return 1
  n = min(MAX_QUERY_BLOCKS, t // MIN_QUERY_BLOCK)
  while n > 1 and t % n:
    n -= 1
  return max(n, 1)


def causal_attention(q, k, v, num_blocks: int = 1):
  """softmax(q k^T / sqrt(D) + causal mask) v over q, k, v [B, T, H, D] -> [B, T, H, D]."""
  t = ops.shape(q)[1]
  scale = ops.sqrt(ops.cast(ops.shape(q)[-1], q.dtype))
  outputs = []
  for i in range(num_blocks):
    # Queries [lo, hi) attend to keys [0, hi); one block is the whole square.
    lo, hi = (i * t // num_blocks, (i + 1) * t // num_blocks) if num_blocks > 1 else (0, t)
    scores = ops.einsum("bqhd,bkhd->bhqk", q[:, lo:hi], k[:, :hi]) / scale  # [B, H, hi-lo, hi]
    causal = ops.arange(hi)[None, :] <= ops.arange(lo, hi)[:, None]  # True where key <= query
    # Softmax in float32: bfloat16/float16 logits lose the small probabilities.
    scores = ops.where(causal[None, None], ops.cast(scores, "float32"), -1e9)
    probs = ops.cast(ops.softmax(scores, axis=-1), v.dtype)
    outputs.append(ops.einsum("bhqk,bkhd->bqhd", probs, v[:, :hi]))  # [B, hi-lo, H, D]
  return outputs[0] if num_blocks == 1 else ops.concatenate(outputs, axis=1)


def causal_fraction(t) -> float:
  """The share of the [T, T] score square that causal attention computes at a static length t.

  Query block i of n reads i + 1 key blocks: n(n + 1)/2 of the n^2 blocks,
  (n + 1)/(2n) (10/16 at T = 256); 1 where there is one block. The same for
  both cores of CAUSAL_CORES: what MFU's executed FLOPs count.
  """
  n = query_blocks(t)
  return (n + 1) / (2 * n)


def _rows(x):
  """[B, H, S] per-query statistics -> [B, S, H, 1], to scale outputs [B, S, H, D]."""
  return ops.transpose(x, (0, 2, 1))[..., None]


def online_softmax_attention(q, k, v, num_blocks: int = 1):
  """`causal_attention`'s result, computed in query AND key blocks with an online softmax.

  FlashAttention's formulation (Dao et al. 2022; Milakov & Gimelshein 2018):
  query block i visits key blocks j <= i (the blocks above the diagonal are
  never computed, as in causal_attention) keeping, per query, the running
  maximum m, the running sum l of exp(score - m) and the running output
  acc = sum exp(score - m) v; a new block with maximum m' rescales l and acc
  by exp(m - m'). The output is acc / l: the same softmax, summed in another
  order. No [S, T] row of scores is ever whole: each step holds one [S, S]
  block, which is what lets a GPU or TPU kernel keep it in on-chip memory.
  Here it is plain ops that XLA compiles (the loops unroll over static
  blocks); its backward is the autodiff of these ops, not FlashAttention's
  recomputing one. --causal_attention=online_softmax; docs/benchmarks.md says
  what it costs on CPU.

  Args:
    q, k, v: [B, T, H, D].
    num_blocks: n, query and key blocks of T/n (query_blocks(T) in SelfAttention).

  Returns:
    [B, T, H, D].
  """
  t = ops.shape(q)[1]
  scale = ops.sqrt(ops.cast(ops.shape(q)[-1], q.dtype))
  bounds = [(i * t // num_blocks, (i + 1) * t // num_blocks) if num_blocks > 1 else (0, t)
            for i in range(num_blocks)]
  outputs = []
  for i, (lo, hi) in enumerate(bounds):
    m = total = acc = None  # [B, H, S], [B, H, S], [B, S, H, D] float32, over key blocks so far.
    for j, (klo, khi) in enumerate(bounds[:i + 1]):
      scores = ops.cast(ops.einsum("bqhd,bkhd->bhqk", q[:, lo:hi], k[:, klo:khi]) / scale,
                        "float32")  # [B, H, S, S]
      if j == i:  # The diagonal block: key <= query; every row keeps its diagonal.
        causal = ops.arange(klo, khi)[None, :] <= ops.arange(lo, hi)[:, None]
        scores = ops.where(causal[None, None], scores, -1e9)
      m_new = ops.max(scores, axis=-1) if m is None else ops.maximum(m, ops.max(scores, axis=-1))
      p = ops.exp(scores - m_new[..., None])  # [B, H, S, S], unnormalised
      pv = ops.cast(ops.einsum("bhqk,bkhd->bqhd", ops.cast(p, v.dtype), v[:, klo:khi]),
                    "float32")  # [B, S, H, D]
      if m is None:
        total, acc = ops.sum(p, axis=-1), pv
      else:
        correction = ops.exp(m - m_new)  # <= 1: the old terms under the new maximum.
        total = total * correction + ops.sum(p, axis=-1)
        acc = acc * _rows(correction) + pv
      m = m_new
    outputs.append(ops.cast(acc / _rows(total), v.dtype))
  return outputs[0] if num_blocks == 1 else ops.concatenate(outputs, axis=1)


# --causal_attention: how a causal SelfAttention computes its core (the same numbers).
CAUSAL_CORES = {"query_blocks": causal_attention, "online_softmax": online_softmax_attention}


def full_attention(q, k, v):
  """softmax(q k^T / sqrt(D)) v over q, k, v [B, T, H, D] -> [B, T, H, D]: no mask."""
  scale = ops.sqrt(ops.cast(ops.shape(q)[-1], q.dtype))
  scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / scale  # [B, H, T, T]
  probs = ops.cast(ops.softmax(ops.cast(scores, "float32"), axis=-1), v.dtype)
  return ops.einsum("bhqk,bkhd->bqhd", probs, v)


class SelfAttention(TensorParallel, keras.layers.Layer):
  """Self-attention over `num_heads` heads split in `tensor_shards` shards, without the output bias.

  Q, K, V are column-parallel (shard t holds heads [t H/T, (t+1) H/T)) and
  the output projection row-parallel (tfpar.layers.parallel), so shard t's
  partial is softmax(Q_t K_t^T / sqrt(d) [+ mask]) V_t W_o[t] and the layer's
  output is their sum; the output bias lives in `Block`, added once after it.

  Grouped-query attention (Ainslie et al. 2023): with `num_kv_heads` G < H
  key/value heads, query head h reads key/value head floor(h G / H) (each K, V
  head repeated H/G times, keras-hub's Llama order), so shard t's query heads
  [t H/T, (t+1) H/T) need exactly its key/value heads [t G/T, (t+1) G/T): T
  must divide G too. G = 1 is multi-query attention.

  Args:
    num_heads: heads in total.
    head_dim: width of each head.
    d_model: width of the input and output.
    rotary: apply rotary position embedding to queries and keys.
    causal: position i attends only to positions <= i (a language model);
      False lets every position see every other (image patches).
    tensor_shards: T, how many shards the heads are split into.
    num_kv_heads: G, key/value heads in total (default num_heads).
    use_bias: Q, K, V biases (GPT-2 has them, Llama not).

  Attributes:
    recompute_core: wrap the attention core (scores, softmax, mixing of each
      shard's heads) in `tf.recompute_grad`: the backward keeps only q, k, v
      and recomputes the O(T^2) scores and probabilities (--remat=selective;
      set by tfpar.parallel.pipeline). Without a gradient tape it is the
      plain forward.
    fused_projections: compute each shard's Q, K, V as one matmul by its
      kernels side by side (tfpar.layers.fused; --fused_projections, set by
      `tfpar.layers.block.set_compute`); the variables are the same.
    causal_attention: the causal core, a key of CAUSAL_CORES ("query_blocks"
      or "online_softmax": the same result; --causal_attention).

  Call args:
    x: [B, T, d_model]. Returns [B, T, d_model].

  Reference: Vaswani et al. 2017, "Attention Is All You Need".
  """

  def __init__(self, *, num_heads, head_dim, d_model, rotary=False, causal=True,
               tensor_shards=1, num_kv_heads=None, use_bias=True, **kwargs):
    super().__init__(**kwargs)
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % tensor_shards or num_kv_heads % tensor_shards or num_heads % num_kv_heads:
      raise ValueError(f"{num_heads} heads and {num_kv_heads} key/value heads do not split "
                       f"over {tensor_shards} shards")
    self.num_heads, self.num_kv_heads, self.use_bias = num_heads, num_kv_heads, use_bias
    self.head_dim = head_dim
    self.d_model = d_model
    self.rotary = rotary
    self.causal = causal
    self.tensor_shards = tensor_shards
    self.recompute_core = False
    self.fused_projections = False
    self.causal_attention = "query_blocks"
    init = keras.initializers.RandomNormal(stddev=0.02)
    column = lambda heads, name: ColumnParallelDense(heads * head_dim, shards=tensor_shards,
                                                     use_bias=use_bias, kernel_initializer=init,
                                                     name=name)
    self.query = column(num_heads, "query")
    self.key, self.value = column(num_kv_heads, "key"), column(num_kv_heads, "value")
    self.output_dense = RowParallelDense(d_model, shards=tensor_shards, kernel_initializer=init,
                                         name="output")

  def build(self, input_shape):
    for dense in (self.query, self.key, self.value):
      dense.build(input_shape)
    self.output_dense.build(tuple(input_shape[:-1]) + (self.num_heads * self.head_dim,))

  def partial(self, x, t):
    b, n, heads = ops.shape(x)[0], ops.shape(x)[1], self.num_heads // self.tensor_shards
    kv_heads = self.num_kv_heads // self.tensor_shards
    denses = (self.query, self.key, self.value)
    q, k, v = (fused_columns(x, denses, t) if self.fused_projections
               else [dense(x, shard=t) for dense in denses])
    q = ops.reshape(q, (b, n, heads, self.head_dim))  # [B, T, H/T, D]
    k, v = (ops.reshape(y, (b, n, kv_heads, self.head_dim)) for y in (k, v))  # [B, T, G/T, D]
    if self.rotary:
      q, k = rotary(q), rotary(k)
    if kv_heads != heads:  # Each K, V head serves H/G query heads in a row.
      k, v = (ops.repeat(y, heads // kv_heads, axis=2) for y in (k, v))  # [B, T, H/T, D]
    if self.causal:
      blocks, blocked = query_blocks(x.shape[1]), CAUSAL_CORES[self.causal_attention]
      core = lambda q, k, v: blocked(q, k, v, blocks)  # [B, T, H/T, D]
    else:
      core = full_attention
    y = (tf.recompute_grad(core) if self.recompute_core else core)(q, k, v)
    return self.output_dense(ops.reshape(y, (b, n, heads * self.head_dim)), shard=t)

  def call(self, x):
    return self.sum_of_shards(x)

  def get_config(self):
    return {**super().get_config(), "num_heads": self.num_heads, "head_dim": self.head_dim,
            "d_model": self.d_model, "rotary": self.rotary, "causal": self.causal,
            "tensor_shards": self.tensor_shards, "num_kv_heads": self.num_kv_heads,
            "use_bias": self.use_bias}


def recompute_cores(model, on: bool) -> int:
  """Sets `recompute_core` (--remat=selective) on every SelfAttention inside `model`.

  Found by walking the model's layers, so any block that holds a SelfAttention,
  whatever it names it, gets it. Returns how many there are.
  """
  cores = [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
           if isinstance(layer, SelfAttention)]
  for core in cores:
    core.recompute_core = on
  return len(cores)

