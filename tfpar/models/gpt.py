"""A decoder-only transformer language model (GPT-2 shape, nanoGPT habits).

tokens [B, T] -> embed (token + learned position, or rotary in attention)
-> num_layers x Block -> final LayerNorm -> logits [B, T, V] through the tied
token embedding. The parts are public (`embed`, `blocks`, `head`) so that
`tfpar.parallel.pipeline` can run them on different devices; the model itself
never names a device.
"""

import keras
from keras import ops

from tfpar.config import ModelConfig
from tfpar.layers import Block


class GPT(keras.Model):
  """Decoder-only transformer with tied input/output embeddings.

  Args:
    config: a `tfpar.config.ModelConfig`.
    tensor_shards: split each block's attention and MLP in this many shards.
    seed: seeds dropout.

  Example:
    >>> model = GPT(ModelConfig(num_layers=2, d_model=64, num_heads=4, d_ff=256))
    >>> logits = model(tokens)  # [B, T] int32 -> [B, T, 256]
  """

  def __init__(self, config: ModelConfig, *, tensor_shards: int = 1, seed: int = 0, **kwargs):
    kwargs.setdefault("name", "gpt")
    super().__init__(**kwargs)
    self.config = config
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.token_embedding = keras.layers.Embedding(config.vocab_size, config.d_model,
                                                  embeddings_initializer=init, name="wte")
    self.position_embedding = None
    if config.positions == "learned":
      self.position_embedding = keras.layers.Embedding(config.seq_len, config.d_model,
                                                       embeddings_initializer=init, name="wpe")
    self.embed_dropout = keras.layers.Dropout(config.dropout, seed=seed, name="drop")
    self.blocks = [
        Block(d_model=config.d_model, num_heads=config.num_heads, d_ff=config.d_ff,
              dropout=config.dropout, rotary=config.positions == "rotary",
              tensor_shards=tensor_shards, seed=seed + 2 * (i + 1), name=f"block_{i}")
        for i in range(config.num_layers)]
    self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")
    self.block_shape = (None, config.seq_len, config.d_model)  # What each block is built for.

  def build_all(self):
    """Creates every weight now (under whatever device scope the caller holds)."""
    self.build_embed()
    for block in self.blocks:
      block.build(self.block_shape)
    self.build_head()
    self.built = True

  def build_embed(self):
    self.token_embedding.build((None, None))
    if self.position_embedding is not None:
      self.position_embedding.build((None, None))

  def build_head(self):
    self.ln_f.build((None, None, self.config.d_model))

  def embed(self, tokens, training=False):
    """tokens [B, T] int -> hidden [B, T, d_model] in the compute dtype."""
    h = self.token_embedding(tokens)
    if self.position_embedding is not None:
      t = ops.shape(tokens)[1]
      h = h + self.position_embedding(ops.arange(t))[None]  # [1, T, d]
    return self.embed_dropout(h, training=training)

  def head(self, h):
    """hidden [B, T, d_model] -> logits [B, T, vocab] in float32 (for a stable loss)."""
    h = self.ln_f(h)
    table = ops.cast(self.token_embedding.embeddings, h.dtype)  # Tied: the input table.
    return ops.cast(ops.einsum("btd,vd->btv", h, table), "float32")

  def call(self, tokens, training=False):
    h = self.embed(tokens, training=training)
    for block in self.blocks:
      h = block(h, training=training)
    return self.head(h)
