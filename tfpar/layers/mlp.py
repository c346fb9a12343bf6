"""The transformer's position-wise feed-forward network (one shard of it, or all)."""

import keras


class MLP(keras.layers.Layer):
  """GELU MLP `gelu(x W_in + b_in) W_out`, without the output bias.

  Split over T tensor-parallel shards, W_in by columns and W_out by rows, the
  shards' outputs sum to the full MLP (GELU acts elementwise on each column):
  sum_t gelu(x W_in[:, t] + b_in[t]) W_out[t, :]. The output bias lives in `Block`.

  Args:
    d_ff: hidden width of this layer (d_ff / T for a shard).
    d_model: input and output width.
  """

  SHARD_AXES = {"fc_in/kernel": 1, "fc_in/bias": 0, "fc_out/kernel": 0}

  def __init__(self, *, d_ff, d_model, **kwargs):
    super().__init__(**kwargs)
    self.d_ff = d_ff
    self.d_model = d_model
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.fc_in = keras.layers.Dense(d_ff, activation="gelu", kernel_initializer=init,
                                    name="fc_in")
    self.fc_out = keras.layers.Dense(d_model, use_bias=False, kernel_initializer=init,
                                     name="fc_out")

  def build(self, input_shape):
    self.fc_in.build(input_shape)
    self.fc_out.build(tuple(input_shape[:-1]) + (self.d_ff,))

  def call(self, x):
    return self.fc_out(self.fc_in(x))

  def get_config(self):
    return {**super().get_config(), "d_ff": self.d_ff, "d_model": self.d_model}
