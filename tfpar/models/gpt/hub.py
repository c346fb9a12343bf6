"""keras-hub's GPT2Backbone <-> tfpar's GPT (tfpar.models.gpt): names and config.

The architectures agree: pre-LayerNorm blocks (epsilon 1e-5), GELU in its tanh
form (tfpar's GPT uses GPT-2's), Q/K/V and MLP biases, the output biases of
attention and MLP (tfpar keeps them in the block as `attn_bias` and
`mlp_bias`, added once after the tensor shards' sum), learned positions, the
output projection tied to the token table. keras-hub's attention kernels keep
heads as an axis ([d, H, D], biases [H, D], output [H, D, d]): a row-major
reshape each way. Positions: a preset has `max_sequence_length` rows, tfpar
`--seq_len`: a run from a preset takes the first seq_len rows (seq_len must
not exceed it); an export writes a preset of max_sequence_length = seq_len.
"""

CLASS = "GPT2Backbone"
CAUSAL_LM = ("GPT2CausalLM", "GPT2CausalLMPreprocessor")  # The task and its preprocessor.

NAMES = {
    "wte/embeddings": "token_embedding/embeddings",
    "wpe/embeddings": "position_embedding/embeddings",
    "ln_f/gamma": "layer_norm/gamma",
    "ln_f/beta": "layer_norm/beta",
    **{f"block_{{i}}/ln_{n}/{p}": f"transformer_layer_{{i}}/{hub}_layer_norm/{p}"
       for n, hub in ((1, "self_attention"), (2, "feedforward")) for p in ("gamma", "beta")},
    **{f"block_{{i}}/attn/{w}/{p}": f"transformer_layer_{{i}}/self_attention/{w}/{p}"
       for w in ("query", "key", "value") for p in ("kernel", "bias")},
    "block_{i}/attn/output/kernel": "transformer_layer_{i}/self_attention/attention_output/kernel",
    "block_{i}/attn_bias": "transformer_layer_{i}/self_attention/attention_output/bias",
    "block_{i}/mlp/fc_in/kernel": "transformer_layer_{i}/feedforward_intermediate_dense/kernel",
    "block_{i}/mlp/fc_in/bias": "transformer_layer_{i}/feedforward_intermediate_dense/bias",
    "block_{i}/mlp/fc_out/kernel": "transformer_layer_{i}/feedforward_output_dense/kernel",
    "block_{i}/mlp_bias": "transformer_layer_{i}/feedforward_output_dense/bias",
}
FIXED = {}


def flags_of(config: dict) -> dict:
  """The tfpar model flags a GPT2Backbone config stands for (seq_len: at most its positions)."""
  return {"architecture": "gpt", "vocab_size": config["vocabulary_size"],
          "num_layers": config["num_layers"], "d_model": config["hidden_dim"],
          "num_heads": config["num_heads"], "d_ff": config["intermediate_dim"],
          "positions": "learned"}


def backbone_config(m) -> dict:
  """The GPT2Backbone config of a tfpar ModelConfig."""
  return {"vocabulary_size": m.vocab_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
          "hidden_dim": m.d_model, "intermediate_dim": m.d_ff, "dropout": 0.0,
          "max_sequence_length": m.seq_len}
