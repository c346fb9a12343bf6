"""keras-hub's LlamaBackbone <-> tfpar's Llama (tfpar.models.llama): names and config.

Every weight maps one to one; keras-hub's attention kernels keep heads as an
axis ([d, H, D] for the query, [d, G, D] for key and value, [H, D, d] for the
output), tfpar's are the same numbers as matrices ([d, H D], [H D, d]): a
row-major reshape each way. The untied output projection is keras-hub's
`token_embedding/reverse_embeddings` [d, V]. Numerics agree exactly
(tfpar.models.llama): RMSNorm epsilon, rotary halves with max wavelength
10000, K/V heads repeated in order; presets with other rotary settings
(Llama 3.1 frequency scaling, position scaling) are refused.
"""

CLASS = "LlamaBackbone"
CAUSAL_LM = ("LlamaCausalLM", "LlamaCausalLMPreprocessor")  # The task and its preprocessor.
EPSILON = 1e-6  # tfpar.layers.LlamaBlock.EPSILON.

# canonical name (inside block i: "{i}") -> keras-hub weight path.
NAMES = {
    "wte/embeddings": "token_embedding/embeddings",
    "lm_head/kernel": "token_embedding/reverse_embeddings",
    "ln_f/scale": "sequence_output_layernorm/scale",
    "block_{i}/ln_1/scale": "transformer_layer_{i}/self_attention_layernorm/scale",
    "block_{i}/ln_2/scale": "transformer_layer_{i}/feedforward_layernorm/scale",
    "block_{i}/attn/query/kernel": "transformer_layer_{i}/self_attention/query/kernel",
    "block_{i}/attn/key/kernel": "transformer_layer_{i}/self_attention/key/kernel",
    "block_{i}/attn/value/kernel": "transformer_layer_{i}/self_attention/value/kernel",
    "block_{i}/attn/output/kernel": "transformer_layer_{i}/self_attention/attention_output/kernel",
    "block_{i}/mlp/gate/kernel": "transformer_layer_{i}/feedforward_gate_dense/kernel",
    "block_{i}/mlp/up/kernel": "transformer_layer_{i}/feedforward_intermediate_dense/kernel",
    "block_{i}/mlp/down/kernel": "transformer_layer_{i}/feedforward_output_dense/kernel",
}
# What tfpar cannot compute, as keras-hub config -> the one value tfpar's model has.
FIXED = {"rope_max_wavelength": 10000, "rope_position_scaling_factor": 1.0,
         "rope_frequency_adjustment_factor": None, "layer_norm_epsilon": EPSILON,
         "tie_word_embeddings": False}


def flags_of(config: dict) -> dict:
  """The tfpar model flags a LlamaBackbone config stands for."""
  return {"architecture": "llama", "vocab_size": config["vocabulary_size"],
          "num_layers": config["num_layers"], "d_model": config["hidden_dim"],
          "num_heads": config["num_query_heads"], "num_kv_heads": config["num_key_value_heads"],
          "d_ff": config["intermediate_dim"]}


def backbone_config(m) -> dict:
  """The LlamaBackbone config of a tfpar ModelConfig."""
  return {"vocabulary_size": m.vocab_size, "num_layers": m.num_layers,
          "num_query_heads": m.num_heads, "num_key_value_heads": m.kv_heads,
          "hidden_dim": m.d_model, "intermediate_dim": m.d_ff, "dropout": 0.0,
          "layer_norm_epsilon": EPSILON, "rope_max_wavelength": 10000,
          "tie_word_embeddings": False}
