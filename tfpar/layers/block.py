"""A pre-LayerNorm transformer block whose attention and MLP may be split over tensor shards."""

import keras
from keras import ops

from tfpar.layers.attention import SelfAttention
from tfpar.layers.mlp import MLP
from tfpar.layers.parallel import Placement


class Block(keras.layers.Layer):
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
  """

  def __init__(self, *, d_model, num_heads, d_ff, dropout=0.0, rotary=False, causal=True,
               tensor_shards=1, seed=None, **kwargs):
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
    self.mlp = MLP(d_ff=d_ff, d_model=d_model, tensor_shards=tensor_shards, name="mlp")
    self.drop_1 = keras.layers.Dropout(dropout, seed=seed, name="drop_1")
    self.drop_2 = keras.layers.Dropout(dropout, seed=None if seed is None else seed + 1,
                                       name="drop_2")

  def place(self, placement: Placement) -> None:
    """Runs (and builds) shard t of the attention and the MLP as `placement` says."""
    self.attn.place(placement)
    self.mlp.place(placement)

  def build(self, input_shape):
    self.ln_1.build(input_shape)
    self.ln_2.build(input_shape)
    self.attn.build(input_shape)
    self.mlp.build(input_shape)
    self.attn_bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="attn_bias")
    self.mlp_bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="mlp_bias")

  def call(self, x, training=False):
    h = self.attn(self.ln_1(x)) + ops.cast(self.attn_bias, x.dtype)
    x = x + self.drop_1(h, training=training)
    h = self.mlp(self.ln_2(x)) + ops.cast(self.mlp_bias, x.dtype)
    return x + self.drop_2(h, training=training)

  def get_config(self):
    return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
            "d_ff": self.d_ff, "dropout": self.dropout_rate, "rotary": self.rotary,
            "causal": self.causal, "tensor_shards": self.tensor_shards, "seed": self.seed}
