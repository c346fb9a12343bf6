"""A Llama-family decoder-only language model (Touvron et al. 2023), as keras-hub's LlamaBackbone.

tokens [B, T] -> token embedding -> num_layers x LlamaBlock (RMSNorm, rotary
grouped-query attention, SwiGLU MLP, no biases) -> final RMSNorm -> logits
[B, T, V] through an untied output projection `lm_head` [d_model, V].

The numerics are keras-hub 0.32's LlamaBackbone + LlamaCausalLM (RMSNorm
epsilon 1e-6, rotary over halves of each head with max wavelength 10000,
K/V heads repeated in order), so weights map one to one (tfpar.hub). The
parts are public (tfpar.models.base.ParallelModel) for tfpar.parallel; how
the variables split: tfpar/models/llama/rules.py.
"""

import keras
from keras import ops

from tfpar.config.schema import ModelConfig
from tfpar.layers import LlamaBlock
from tfpar.layers.dropout import ReplicaDropout
from tfpar.models.base import Transformer
from tfpar.models.llama import rules as rules_lib


class Llama(Transformer):
  """Llama-style decoder with an untied output projection.

  Args:
    config: a `tfpar.config.ModelConfig` (num_kv_heads for grouped-query attention).
    tensor_shards: split each block's heads, key/value heads and MLP in this many shards.
    seed: seeds dropout.

  Example:
    >>> model = Llama(ModelConfig(architecture="llama", positions="rotary", num_kv_heads=2))
    >>> logits = model(tokens)  # [B, T] int32 -> [B, T, vocab_size]
  """

  rules = rules_lib.RULES

  def __init__(self, config: ModelConfig, *, tensor_shards: int = 1, seed: int = 0, **kwargs):
    kwargs.setdefault("name", "llama")
    super().__init__(**kwargs)
    self.config = config
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.token_embedding = keras.layers.Embedding(config.vocab_size, config.d_model,
                                                  embeddings_initializer=init, name="wte")
    self.embed_dropout = ReplicaDropout(config.dropout, seed=seed, name="drop")
    self.blocks = [
        LlamaBlock(d_model=config.d_model, num_heads=config.num_heads,
                   num_kv_heads=config.kv_heads, d_ff=config.d_ff, dropout=config.dropout,
                   tensor_shards=tensor_shards, seed=seed + 2 * (i + 1), name=f"block_{i}")
        for i in range(config.num_layers)]
    self.ln_f = keras.layers.RMSNormalization(epsilon=LlamaBlock.EPSILON, name="ln_f")
    self.lm_head = keras.layers.Dense(config.vocab_size, use_bias=False, kernel_initializer=init,
                                      name="lm_head")
    self.block_shape = (None, config.seq_len, config.d_model)  # What each block is built for.

  def build_embed(self):
    self.token_embedding.build((None, None))

  def build_head(self):
    self.ln_f.build((None, None, self.config.d_model))
    self.lm_head.build((None, None, self.config.d_model))

  def embed(self, tokens, training=False):
    """tokens [B, T] int -> hidden [B, T, d_model] in the compute dtype."""
    return self.embed_dropout(self.token_embedding(tokens), training=training)

  def head(self, h):
    """hidden [B, T, d_model] -> logits [B, T, vocab] in float32 (for a stable loss)."""
    return ops.cast(self.lm_head(self.ln_f(h)), "float32")
