"""A decoder-only transformer language model (GPT-2 shape, nanoGPT habits).

tokens [B, T] -> embed (token + learned position, or rotary in attention)
-> num_layers x Block -> final LayerNorm -> logits [B, T, V] through the tied
token embedding. The parts are public (tfpar.models.base.ParallelModel) so
that tfpar.parallel can run them on different devices; the model itself never
names a device. How its variables split: tfpar/models/gpt/rules.py.
"""

import keras
from keras import ops

from tfpar.config.schema import ModelConfig
from tfpar.layers import Block
from tfpar.layers.dropout import ReplicaDropout
from tfpar.models.base import Transformer
from tfpar.models.gpt import rules as rules_lib


class GPT(Transformer):
  """Decoder-only transformer with tied input/output embeddings.

  Args:
    config: a `tfpar.config.ModelConfig`.
    tensor_shards: split each block's attention and MLP in this many shards.
    seed: seeds dropout.

  Example:
    >>> model = GPT(ModelConfig(num_layers=2, d_model=64, num_heads=4, d_ff=256))
    >>> logits = model(tokens)  # [B, T] int32 -> [B, T, 256]
  """

  rules = rules_lib.RULES
  head_reads_embed = True  # The output projection is the token table.

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
    self.embed_dropout = ReplicaDropout(config.dropout, seed=seed, name="drop")
    self.blocks = [self.make_block(i, tensor_shards=tensor_shards, seed=seed + 2 * (i + 1))
                   for i in range(config.num_layers)]
    self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")
    self.block_shape = (None, config.seq_len, config.d_model)  # What each block is built for.

  def make_block(self, i: int, *, tensor_shards: int, seed: int) -> Block:
    """Block i (a model family with another block overrides this and `rules`)."""
    c = self.config
    return Block(d_model=c.d_model, num_heads=c.num_heads, d_ff=c.d_ff, dropout=c.dropout,
                 rotary=c.positions == "rotary", tensor_shards=tensor_shards, seed=seed,
                 gelu_approximate=True, name=f"block_{i}")  # GPT-2's GELU (hub.py).

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
