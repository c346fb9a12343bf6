"""A pre-LayerNorm transformer block whose attention and MLP may be split in shards."""

import contextlib

import keras
from keras import ops

from tfpar.layers.attention import SelfAttention
from tfpar.layers.mlp import MLP


class Block(keras.layers.Layer):
  """x + Attn(LN(x)), then x + MLP(LN(x)) (GPT-2 / nanoGPT order).

  With `tensor_shards=T` the attention holds T `SelfAttention` shards of
  num_heads / T heads and the MLP T shards of d_ff / T columns; their partial
  outputs are summed, then the single output bias is added (see those layers
  for why the sum is exact). T=1 is the ordinary block. Where and how each
  shard runs is not this layer's business: `tfpar.parallel.tensor` hands it a
  `shard_scope(t)` that returns a context (a device scope) for shard t, and a
  `shard_fn(layer)` that returns the callable running that shard (an
  XLA-compiled one under --jit_compile).

  Args:
    d_model: residual width.
    num_heads: attention heads in total.
    d_ff: MLP hidden width in total.
    dropout: residual dropout rate.
    rotary: rotary position embedding in attention.
    causal: causal attention (GPT); False for image patches (ViT).
    tensor_shards: T, how many shards attention and MLP are split into.
    seed: dropout seed.
  """

  def __init__(self, *, d_model, num_heads, d_ff, dropout=0.0, rotary=False, causal=True,
               tensor_shards=1, seed=None, **kwargs):
    super().__init__(**kwargs)
    self.d_model, self.num_heads, self.d_ff = d_model, num_heads, d_ff
    self.dropout_rate, self.rotary, self.tensor_shards = dropout, rotary, tensor_shards
    self.causal = causal
    self.seed = seed
    self.shard_scope = lambda t: contextlib.nullcontext()
    self.shard_fn = lambda layer: layer
    self.ln_1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_1")
    self.ln_2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_2")
    self.attn = [SelfAttention(num_heads=num_heads // tensor_shards,
                               head_dim=d_model // num_heads, d_model=d_model,
                               rotary=rotary, causal=causal, name=f"attn_shard_{t}")
                 for t in range(tensor_shards)]
    self.mlp = [MLP(d_ff=d_ff // tensor_shards, d_model=d_model, name=f"mlp_shard_{t}")
                for t in range(tensor_shards)]
    self.drop_1 = keras.layers.Dropout(dropout, seed=seed, name="drop_1")
    self.drop_2 = keras.layers.Dropout(dropout, seed=None if seed is None else seed + 1,
                                       name="drop_2")

  def build(self, input_shape):
    self.ln_1.build(input_shape)
    self.ln_2.build(input_shape)
    for t in range(self.tensor_shards):
      with self.shard_scope(t):  # Each shard's weights are created where it will run.
        self.attn[t].build(input_shape)
        self.mlp[t].build(input_shape)
    self.attn_bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="attn_bias")
    self.mlp_bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="mlp_bias")

  def _sharded(self, shards, h):
    partials = []
    for t, shard in enumerate(shards):
      with self.shard_scope(t):
        partials.append(self.shard_fn(shard)(h))
    # The one reduction per sub-block: a sum of T partial outputs.
    return partials[0] if len(partials) == 1 else ops.sum(ops.stack(partials), axis=0)

  def call(self, x, training=False):
    h = self._sharded(self.attn, self.ln_1(x)) + ops.cast(self.attn_bias, x.dtype)
    x = x + self.drop_1(h, training=training)
    h = self._sharded(self.mlp, self.ln_2(x)) + ops.cast(self.mlp_bias, x.dtype)
    return x + self.drop_2(h, training=training)

  def get_config(self):
    return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
            "d_ff": self.d_ff, "dropout": self.dropout_rate, "rotary": self.rotary,
            "causal": self.causal, "tensor_shards": self.tensor_shards, "seed": self.seed}
