"""A model of your own, trained by tfpar: a parallel-residual transformer with ALiBi.

Each block is GPT-J's / PaLM's parallel residual, one LayerNorm feeding both
branches,

    x + Attn(LN(x)) + MLP(LN(x)),

and attention has no position embedding: ALiBi (Press et al. 2022) adds
-m_h (i - j) to the score of query i and key j, with head h's slope
m_h = 2^(-8 (h + 1) / H). Heads split over tensor shards as Megatron splits
them (Q, K, V by columns, the output projection by rows); shard t's heads
[t H/T, (t+1) H/T) take their own slopes, so each shard's partial is exact and
the T partials sum to the block's attention.

Everything here is tfpar's public API (tfpar.__all__): the layers, the
partitioning rules as data, the family's registration, the config and the
Trainer. Run it from the repository (or anywhere once `pip install -e .` has
installed tfpar), on 4 logical CPU devices: 2 pipeline stages x 2 tensor shards:

    python examples/alibi_lm.py --model_dir=runs/alibi

tests/test_api.py trains it under that plan and under ZeRO-1 over 2 replicas,
against one device.
"""

import argparse
import math

import keras
from keras import ops

import tfpar


class AlibiAttention(tfpar.TensorParallel, keras.layers.Layer):
  """Causal multi-head attention with ALiBi biases, heads split over `tensor_shards`."""

  def __init__(self, *, d_model, num_heads, tensor_shards=1, **kwargs):
    super().__init__(**kwargs)
    self.d_model, self.num_heads, self.tensor_shards = d_model, num_heads, tensor_shards
    self.head_dim = d_model // num_heads
    init = keras.initializers.RandomNormal(stddev=0.02)
    column = lambda name: tfpar.ColumnParallelDense(d_model, shards=tensor_shards, use_bias=False,
                                                    kernel_initializer=init, name=name)
    self.query, self.key, self.value = column("query"), column("key"), column("value")
    self.output_dense = tfpar.RowParallelDense(d_model, shards=tensor_shards,
                                               kernel_initializer=init, name="output")
    # Head h's slope, 2^(-8 (h+1) / H): a geometric sequence, as the paper's for H a power of 2.
    self.slopes = [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]

  def build(self, input_shape):
    for dense in (self.query, self.key, self.value):
      dense.build(input_shape)
    self.output_dense.build(input_shape)

  def partial(self, x, t):
    b, n = ops.shape(x)[0], ops.shape(x)[1]
    heads = self.num_heads // self.tensor_shards
    q, k, v = (ops.reshape(dense(x, shard=t), (b, n, heads, self.head_dim))  # [B, N, H/T, D]
               for dense in (self.query, self.key, self.value))
    scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)  # [B, H/T, N, N]
    i = ops.arange(n)[:, None]
    j = ops.arange(n)[None, :]
    distance = ops.cast(i - j, scores.dtype)  # [N, N]: how far back key j is from query i.
    slopes = ops.convert_to_tensor(self.slopes[t * heads:(t + 1) * heads], scores.dtype)
    scores = scores - slopes[:, None, None] * distance[None]  # ALiBi: [H/T, N, N].
    scores = ops.where((j <= i)[None, None], scores, ops.full_like(scores, -1e9))  # Causal.
    mixed = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), v)  # [B, N, H/T, D]
    return self.output_dense(ops.reshape(mixed, (b, n, heads * self.head_dim)), shard=t)

  def call(self, x):
    return self.sum_of_shards(x)


class ParallelResidualBlock(keras.layers.Layer):
  """x + Attn(LN(x)) + MLP(LN(x)) + b: both branches read one norm; b, the output biases of
  both, is added once after the tensor shards' sums."""

  def __init__(self, *, d_model, num_heads, d_ff, tensor_shards=1, **kwargs):
    super().__init__(**kwargs)
    self.d_model, self.tensor_shards = d_model, tensor_shards
    self.ln = keras.layers.LayerNormalization(epsilon=1e-5, name="ln")
    self.attn = AlibiAttention(d_model=d_model, num_heads=num_heads,
                               tensor_shards=tensor_shards, name="attn")
    self.mlp = tfpar.MLP(d_ff=d_ff, d_model=d_model, tensor_shards=tensor_shards, name="mlp")

  def place(self, placement):
    """Where each tensor shard runs (tfpar's engines call this before building)."""
    self.attn.place(placement)
    self.mlp.place(placement)

  def build(self, input_shape):
    for layer in (self.ln, self.attn, self.mlp):
      layer.build(input_shape)
    self.bias = self.add_weight(shape=(self.d_model,), initializer="zeros", name="bias")

  def call(self, x, training=False):
    h = self.ln(x)
    return x + self.attn(h) + self.mlp(h) + ops.cast(self.bias, x.dtype)


class AlibiLM(tfpar.Transformer):
  """tokens [B, N] -> token table -> blocks -> LayerNorm -> untied projection -> logits [B, N, V].

  tfpar's engines run the parts on different devices (tfpar.ParallelModel):
  `embed` on the first pipeline stage, `blocks` split over the stages, `head`
  on the last; the model itself never names a device.
  """

  def __init__(self, config, *, tensor_shards=1, seed=0, **kwargs):
    kwargs.setdefault("name", "alibi_lm")
    super().__init__(**kwargs)
    del seed  # No dropout here.
    self.config = config
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.token_embedding = keras.layers.Embedding(config.vocab_size, config.d_model,
                                                  embeddings_initializer=init, name="wte")
    self.blocks = [ParallelResidualBlock(d_model=config.d_model, num_heads=config.num_heads,
                                         d_ff=config.d_ff, tensor_shards=tensor_shards,
                                         name=f"block_{i}") for i in range(config.num_layers)]
    self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")
    self.lm_head = keras.layers.Dense(config.vocab_size, use_bias=False, kernel_initializer=init,
                                      name="lm_head")
    self.block_shape = (None, config.seq_len, config.d_model)

  def build_embed(self):
    self.token_embedding.build((None, None))

  def build_head(self):
    self.ln_f.build((None, None, self.config.d_model))
    self.lm_head.build((None, None, self.config.d_model))

  def embed(self, tokens, training=False):
    return self.token_embedding(tokens)  # [B, N, d]: no positions, ALiBi is in attention.

  def head(self, h):
    return ops.cast(self.lm_head(self.ln_f(h)), "float32")  # Logits in float32 for the loss.


# --- its partitioning rules, as data: how each variable splits over tensor shards -----------

def block_shapes(m):
  """One block's variables at full shape (names inside the block), from the model settings."""
  d, f = m.d_model, m.d_ff
  return {"ln/gamma": (d,), "ln/beta": (d,), "attn/query/kernel": (d, d),
          "attn/key/kernel": (d, d), "attn/value/kernel": (d, d), "attn/output/kernel": (d, d),
          "mlp/fc_in/kernel": (d, f), "mlp/fc_in/bias": (f,), "mlp/fc_out/kernel": (f, d),
          "bias": (d,)}


def embed_shapes(m):
  return {"wte/embeddings": (m.vocab_size, m.d_model)}


def head_shapes(m):
  return {"ln_f/gamma": (m.d_model,), "ln_f/beta": (m.d_model,),
          "lm_head/kernel": (m.d_model, m.vocab_size)}


Rule = tfpar.Rule
RULES = tfpar.Rules("alibi_lm", (
    Rule(r"wte/embeddings", tfpar.VOCAB, decay=True),
    Rule(r"block_\d+/ln/(gamma|beta)"),  # Whole, not decayed.
    Rule(r"block_\d+/attn/(query|key|value)/kernel", tfpar.COLUMN, decay=True),  # Heads / T.
    Rule(r"block_\d+/attn/output/kernel", tfpar.ROW, decay=True),
    Rule(r"block_\d+/mlp/fc_in/kernel", tfpar.COLUMN, decay=True),
    Rule(r"block_\d+/mlp/fc_in/bias", tfpar.COLUMN),
    Rule(r"block_\d+/mlp/fc_out/kernel", tfpar.ROW, decay=True),
    Rule(r"block_\d+/bias"),  # Added once, after the shards' sums.
    Rule(r"ln_f/(gamma|beta)"),
    Rule(r"lm_head/kernel", decay=True),  # Whole, on the last stage.
), block_shapes, embed_shapes, head_shapes)

# No positions setting applies: ALiBi is its own (positions=()).
FAMILY = tfpar.register(tfpar.Family(name="alibi_lm", model=AlibiLM, rules=RULES,
                                     title="ALiBi parallel-residual LM", positions=()))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--model_dir", default="runs/alibi")
  parser.add_argument("--train_steps", type=int, default=100)
  args = parser.parse_args()
  cfg = tfpar.make_config(
      architecture=FAMILY.name, num_layers=4, d_model=128, num_heads=4, seq_len=128,
      num_cpu_devices=4, pipeline_stages=2, tensor_parallel=2, microbatches=2,
      train_steps=args.train_steps, model_dir=args.model_dir)
  records = tfpar.Trainer(cfg).fit()
  print(records)


if __name__ == "__main__":
  main()
