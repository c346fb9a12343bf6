"""A pre-LayerNorm transformer block whose attention and MLP may be split over tensor shards."""

import keras
from keras import ops

from tfpar.layers.attention import CAUSAL_CORES, SelfAttention
from tfpar.layers.dropout import ReplicaDropout
from tfpar.layers.mlp import MLP, GatedMLP
from tfpar.layers.parallel import HERE, Placement


class PreNormBlock(keras.layers.Layer):
  """What every block here shares: `attn` and `mlp` sub-layers split over tensor
  shards, run where `place` says, and the two residual dropouts (`drop_2`
  seeded one past `drop_1`, so their masks differ).

  The block is x + drop(attn(norm_1(x)) [+ bias]), then the same with the MLP
  (`residual`). Under a sequence-parallel placement the block takes and
  returns its sequence as T slices [B, S/T, d] (slice t on shard t; a whole
  [B, S, d] input is cut here first): each norm, bias, dropout and residual add
  runs on its shard's slice, and attn and mlp gather the sequence and
  reduce-scatter their sum (tfpar.layers.parallel). Dropout then draws one
  mask per slice: other masks than the unsplit block's, at the same rate.
  """

  placement: Placement = HERE

  def _residual_dropouts(self, dropout, seed) -> None:
    self.drop_1 = ReplicaDropout(dropout, seed=seed, name="drop_1")
    self.drop_2 = ReplicaDropout(dropout, seed=None if seed is None else seed + 1,
                                       name="drop_2")

  def place(self, placement: Placement) -> None:
    """Runs (and builds) shard t of the attention and the MLP as `placement` says."""
    self.placement = placement
    self.attn.place(placement)
    self.mlp.place(placement)

  def residual(self, x, sublayers, training):
    """x + drop(layer(norm(x)) + bias) for each (norm, layer, bias or None, drop) in turn."""
    if not self.placement.sequence_parallel:
      for norm, layer, bias, drop in sublayers:
        h = layer(norm(x))
        if bias is not None:
          h = h + ops.cast(bias, x.dtype)
        x = x + drop(h, training=training)
      return x
    xs = list(x) if isinstance(x, (list, tuple)) else ops.split(x, self.tensor_shards, axis=1)
    for norm, layer, bias, drop in sublayers:
      normed = []
      for t, x_t in enumerate(xs):
        with self.placement.scope(t):
          normed.append(norm(x_t))  # [B, S/T, d] on shard t
      hs = layer.scattered_sum_of_shards(normed)
      for t, h in enumerate(hs):
        with self.placement.scope(t):
          if bias is not None:
            h = h + ops.cast(bias, h.dtype)
          xs[t] = xs[t] + drop(h, training=training)
    return xs


class Block(PreNormBlock):
  """x + Attn(LN(x)), then x + MLP(LN(x)) (GPT-2 / nanoGPT order).

  With `tensor_shards=T` the attention's heads and the MLP's hidden width are
  split in T shards (column- then row-parallel, tfpar.layers.parallel); each
  sums its T partial outputs, then the block adds the single output bias.
  T=1 is the ordinary block. Where and how each shard runs is not this
  layer's business: `place(placement)` hands it a tfpar.layers.parallel.Placement
  (tfpar.parallel.tensor gives one of devices), used while building and calling.

  Args:
    d_model: residual width.
    num_heads: attention heads in total.
    d_ff: MLP hidden width in total.
    dropout: residual dropout rate.
    rotary: rotary position embedding in attention.
    causal: causal attention (GPT); False for image patches (ViT).
    tensor_shards: T, how many shards attention and MLP are split into.
    seed: dropout seed.
    gelu_approximate: the MLP's GELU in GPT-2's tanh form (tfpar.layers.mlp.MLP).
  """

  def __init__(self, *, d_model, num_heads, d_ff, dropout=0.0, rotary=False, causal=True,
               tensor_shards=1, seed=None, gelu_approximate=False, **kwargs):
    super().__init__(**kwargs)
    self.d_model, self.num_heads, self.d_ff = d_model, num_heads, d_ff
    self.dropout_rate, self.rotary, self.tensor_shards = dropout, rotary, tensor_shards
    self.causal = causal
    self.seed = seed
    self.ln_1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_1")
    self.ln_2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_2")
    self.attn = SelfAttention(num_heads=num_heads, head_dim=d_model // num_heads,
                              d_model=d_model, rotary=rotary, causal=causal,
                              tensor_shards=tensor_shards, name="attn")
    self.mlp = MLP(d_ff=d_ff, d_model=d_model, tensor_shards=tensor_shards,
                   gelu_approximate=gelu_approximate, name="mlp")
    self._residual_dropouts(dropout, seed)

  def build(self, input_shape):
    self.ln_1.build(input_shape)
    self.ln_2.build(input_shape)
    self.attn.build(input_shape)
    self.mlp.build(input_shape)
    self.attn_bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="attn_bias")
    self.mlp_bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="mlp_bias")

  def call(self, x, training=False):
    return self.residual(x, [(self.ln_1, self.attn, self.attn_bias, self.drop_1),
                             (self.ln_2, self.mlp, self.mlp_bias, self.drop_2)], training)

  def get_config(self):
    return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
            "d_ff": self.d_ff, "dropout": self.dropout_rate, "rotary": self.rotary,
            "causal": self.causal, "tensor_shards": self.tensor_shards, "seed": self.seed}


class LlamaBlock(PreNormBlock):
  """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)): Llama's block, no biases.

  RMSNorm (Zhang & Sennrich 2019) is x / sqrt(mean(x^2) + eps) * scale, eps
  1e-6 as keras-hub's LlamaBackbone; attention has rotary positions and
  `num_kv_heads` key/value heads (grouped-query), split over tensor shards
  as `Block`'s (tfpar.layers.attention.SelfAttention, tfpar.layers.mlp.GatedMLP).

  Args:
    d_model: residual width.
    num_heads: query heads in total.
    num_kv_heads: key/value heads in total (divides num_heads).
    d_ff: SwiGLU hidden width in total.
    dropout: residual dropout rate.
    tensor_shards: T.
    seed: dropout seed.
  """

  EPSILON = 1e-6  # keras-hub's LlamaBackbone default (layer_norm_epsilon).

  def __init__(self, *, d_model, num_heads, num_kv_heads, d_ff, dropout=0.0, tensor_shards=1,
               seed=None, **kwargs):
    super().__init__(**kwargs)
    self.d_model, self.num_heads, self.num_kv_heads, self.d_ff = (d_model, num_heads,
                                                                  num_kv_heads, d_ff)
    self.dropout_rate, self.tensor_shards, self.seed = dropout, tensor_shards, seed
    self.ln_1 = keras.layers.RMSNormalization(epsilon=self.EPSILON, name="ln_1")
    self.ln_2 = keras.layers.RMSNormalization(epsilon=self.EPSILON, name="ln_2")
    self.attn = SelfAttention(num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=d_model // num_heads, d_model=d_model, rotary=True,
                              use_bias=False, tensor_shards=tensor_shards, name="attn")
    self.mlp = GatedMLP(d_ff=d_ff, d_model=d_model, tensor_shards=tensor_shards, name="mlp")
    self._residual_dropouts(dropout, seed)

  def build(self, input_shape):
    for layer in (self.ln_1, self.ln_2, self.attn, self.mlp):
      layer.build(input_shape)

  def call(self, x, training=False):
    return self.residual(x, [(self.ln_1, self.attn, None, self.drop_1),
                             (self.ln_2, self.mlp, None, self.drop_2)], training)

  def get_config(self):
    return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "d_ff": self.d_ff, "dropout": self.dropout_rate,
            "tensor_shards": self.tensor_shards, "seed": self.seed}


def set_compute(model, *, fused_projections: bool = False,
                causal_attention: str = "query_blocks") -> None:
  """Sets how every attention and gated MLP inside `model` computes; the weights are the same.

  Found by walking the model's layers, whatever its blocks name them.

  Args:
    fused_projections: each shard's Q, K, V (and a gated MLP's gate, up) as one
      matmul (tfpar.layers.fused).
    causal_attention: a causal attention's core, a key of
      tfpar.layers.attention.CAUSAL_CORES.
  """
  if causal_attention not in CAUSAL_CORES:
    raise ValueError(f"causal_attention={causal_attention!r} is not one of {sorted(CAUSAL_CORES)}")
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if isinstance(layer, (SelfAttention, GatedMLP)):
      layer.fused_projections = fused_projections
    if isinstance(layer, SelfAttention):
      layer.causal_attention = causal_attention
