"""How the GPT's variables split (tfpar.partitioning): tfpar.layers.Block's rules, a tied token
table and learned positions before the blocks, a final LayerNorm after them."""

from typing import Dict

from tfpar.partitioning import (BLOCK_RULES, DROPOUT_RULES, VOCAB, Rule, Rules, Shape,
                                block_shapes, final_norm_shapes, norm)


def embed_shapes(m) -> Dict[str, Shape]:
  """The token table (tied: also the output projection) and the learned positions."""
  shapes = {"wte/embeddings": (m.vocab_size, m.d_model)}
  if m.positions == "learned":
    shapes["wpe/embeddings"] = (m.seq_len, m.d_model)
  return shapes


RULES = Rules("gpt", (
    Rule(r"wte/embeddings", VOCAB, decay=True),  # Tied: also the output projection.
    Rule(r"wpe/embeddings", decay=True),
    *BLOCK_RULES,
    *norm("ln_f"),
    *DROPOUT_RULES,
), block_shapes, embed_shapes, final_norm_shapes)
