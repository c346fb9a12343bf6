"""How the Llama's variables split (tfpar.partitioning): tfpar.layers.LlamaBlock (no biases,
K and V of kv_heads heads), the token table alone before the blocks, the final RMSNorm and
the untied output projection after them."""

from typing import Dict

from tfpar.partitioning import (BLOCK, COLUMN, DROPOUT_RULES, ROW, VOCAB, Rule, Rules, Shape,
                                dense)


def block_shapes(m) -> Dict[str, Shape]:
  """tfpar.layers.LlamaBlock's variables at full shape."""
  d, f, head = m.d_model, m.d_ff, m.d_model // m.num_heads
  return {"ln_1/scale": (d,), "ln_2/scale": (d,),
          "attn/query/kernel": (d, m.num_heads * head),
          "attn/key/kernel": (d, m.kv_heads * head), "attn/value/kernel": (d, m.kv_heads * head),
          "attn/output/kernel": (m.num_heads * head, d),
          "mlp/gate/kernel": (d, f), "mlp/up/kernel": (d, f), "mlp/down/kernel": (f, d)}


def embed_shapes(m) -> Dict[str, Shape]:
  """The token table alone (positions are rotary, inside attention)."""
  return {"wte/embeddings": (m.vocab_size, m.d_model)}


def head_shapes(m) -> Dict[str, Shape]:
  """The final RMSNorm and the untied output projection."""
  return {"ln_f/scale": (m.d_model,), "lm_head/kernel": (m.d_model, m.vocab_size)}


RULES = Rules("llama", (
    Rule(r"wte/embeddings", VOCAB, decay=True),
    Rule(rf"{BLOCK}/ln_(1|2)/scale"),  # RMSNorm scales: whole, not decayed.
    *dense(rf"{BLOCK}/attn/(query|key|value)", COLUMN, bias=False),  # Heads and KV heads / T.
    *dense(rf"{BLOCK}/attn/output", ROW, bias=False),
    *dense(rf"{BLOCK}/mlp/(gate|up)", COLUMN, bias=False),
    *dense(rf"{BLOCK}/mlp/down", ROW, bias=False),
    Rule(r"ln_f/scale"),
    *dense("lm_head", bias=False),  # Untied, whole on the last stage.
    *DROPOUT_RULES,
), block_shapes, embed_shapes, head_shapes)
