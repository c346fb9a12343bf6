"""The transformer's position-wise feed-forward network, split over tensor shards."""

import keras

from tfpar.layers.fused import fused_columns
from tfpar.layers.parallel import ColumnParallelDense, RowParallelDense, TensorParallel


class MLP(TensorParallel, keras.layers.Layer):
  """GELU MLP `gelu(x W_in + b_in) W_out`, without the output bias.

  W_in is column-parallel and W_out row-parallel (tfpar.layers.parallel): GELU
  acts elementwise on each column, so the T shards' partials sum to the full
  MLP, sum_t gelu(x W_in[:, t] + b_in[t]) W_out[t, :]. The output bias lives in `Block`.

  Args:
    d_ff: hidden width in total.
    d_model: input and output width.
    tensor_shards: T, how many shards the hidden width is split into.
    gelu_approximate: GELU's tanh approximation (GPT-2's, and keras-hub's GPT2Backbone's)
      instead of the exact erf form (the ViT's).
  """

  def __init__(self, *, d_ff, d_model, tensor_shards=1, gelu_approximate=False, **kwargs):
    super().__init__(**kwargs)
    self.d_ff = d_ff
    self.d_model = d_model
    self.tensor_shards = tensor_shards
    self.gelu_approximate = gelu_approximate
    init = keras.initializers.RandomNormal(stddev=0.02)
    gelu = lambda x: keras.activations.gelu(x, approximate=gelu_approximate)
    self.fc_in = ColumnParallelDense(d_ff, shards=tensor_shards, activation=gelu,
                                     kernel_initializer=init, name="fc_in")
    self.fc_out = RowParallelDense(d_model, shards=tensor_shards, kernel_initializer=init,
                                   name="fc_out")

  def build(self, input_shape):
    self.fc_in.build(input_shape)
    self.fc_out.build(tuple(input_shape[:-1]) + (self.d_ff,))

  def partial(self, x, t):
    return self.fc_out(self.fc_in(x, shard=t), shard=t)

  def call(self, x):
    return self.sum_of_shards(x)

  def get_config(self):
    return {**super().get_config(), "d_ff": self.d_ff, "d_model": self.d_model,
            "tensor_shards": self.tensor_shards, "gelu_approximate": self.gelu_approximate}


class GatedMLP(TensorParallel, keras.layers.Layer):
  """SwiGLU MLP `(silu(x W_gate) * (x W_up)) W_down` (Shazeer 2020; Llama's), no biases.

  W_gate and W_up are column-parallel, W_down row-parallel: silu and the product
  act elementwise on each column, so the T shards' partials sum to the whole,
  sum_t (silu(x W_gate[:, t]) * (x W_up[:, t])) W_down[t, :].

  Args:
    d_ff: hidden width in total.
    d_model: input and output width.
    tensor_shards: T, how many shards the hidden width is split into.

  Attributes:
    fused_projections: compute each shard's gate and up as one matmul by
      [W_gate[:, t] | W_up[:, t]] (tfpar.layers.fused; --fused_projections).
  """

  def __init__(self, *, d_ff, d_model, tensor_shards=1, **kwargs):
    super().__init__(**kwargs)
    self.d_ff, self.d_model, self.tensor_shards = d_ff, d_model, tensor_shards
    self.fused_projections = False
    init = keras.initializers.RandomNormal(stddev=0.02)
    column = lambda name, act=None: ColumnParallelDense(
        d_ff, shards=tensor_shards, activation=act, use_bias=False, kernel_initializer=init,
        name=name)
    self.gate, self.up = column("gate", "silu"), column("up")
    self.down = RowParallelDense(d_model, shards=tensor_shards, kernel_initializer=init,
                                 name="down")

  def build(self, input_shape):
    self.gate.build(input_shape)
    self.up.build(input_shape)
    self.down.build(tuple(input_shape[:-1]) + (self.d_ff,))

  def partial(self, x, t):
    gate, up = (fused_columns(x, (self.gate, self.up), t) if self.fused_projections
                else (self.gate(x, shard=t), self.up(x, shard=t)))
    return self.down(gate * up, shard=t)

  def call(self, x):
    return self.sum_of_shards(x)

  def get_config(self):
    return {**super().get_config(), "d_ff": self.d_ff, "d_model": self.d_model,
            "tensor_shards": self.tensor_shards}
