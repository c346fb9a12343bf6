"""Column- and row-parallel Dense layers, and the typed hook that places their shards.

Megatron-LM's split (Shoeybi et al. 2019) of y = act(x W_1 + b_1) W_2 over T
shards: W_1 [d, n] by COLUMNS, so shard t computes its n/T outputs alone,
act(x W_1[:, t] + b_1[t]) (act elementwise); W_2 [n, d] by ROWS, so shard t
multiplies its slice of the hidden by its rows, and the T partial outputs SUM
to the whole: x W_2 = sum_t x[:, t] W_2[t, :]. Nothing is exchanged between
the two; a `TensorParallel` layer (attention, an MLP) runs each shard's part,
`partial(x, t)`, and sums the T partials once.

Shard t's weights are `kernel_shard_<t>` / `bias_shard_<t>` (plain `kernel`,
`bias` when T = 1, as keras.layers.Dense names them), created under
`placement.scope(t)`; tfpar.partitioning says the same split as data (COLUMN:
last axis, ROW: first), which checkpoints and byte counts read.

Where each shard runs is a `Placement`, given to a layer by `place()`:
`scope(t)` is the context for shard t (a device scope), `run(layer, t)` the
callable that computes its partial (an XLA-compiled one under --jit_compile),
`sequence_parallel` whether the blocks keep their sequence split over the
shards (Korthikanti et al. 2022; tfpar.parallel.tensor states the math).
The default placement runs everything where the caller is.

Sequence parallelism as two collectives along the sequence (axis 1):
`TensorParallel.scattered_sum_of_shards` takes the T slices [B, S/T, d] of
its input (slice t on shard t), gives shard t the whole [B, S, d] (the
all-gather), and returns slice u of the summed output on shard u, the sum
of the T partials' slices u (the reduce-scatter). `whole_sequence` gathers
slices back into one tensor where the caller is.
"""

import contextlib
from typing import Callable, ContextManager

import keras
from keras import ops


class Placement:
  """Where and how tensor shard t runs: here, uncompiled (tfpar.parallel.tensor places them)."""

  sequence_parallel = False  # Blocks split their sequence over the shards (a DevicePlacement's).

  def scope(self, t: int) -> ContextManager:
    del t
    return contextlib.nullcontext()

  def run(self, layer: "TensorParallel", t: int) -> Callable:
    """x -> layer.partial(x, t)."""
    return lambda x: layer.partial(x, t)


HERE = Placement()


def shard_name(name: str, t: int, shards: int) -> str:
  return name if shards == 1 else f"{name}_shard_{t}"


class _ShardedDense(keras.layers.Layer):
  """The shards' weights of a Dense of `units` outputs split `shards` ways (see subclasses)."""

  def __init__(self, units, *, shards=1, activation=None, use_bias=True,
               kernel_initializer="glorot_uniform", **kwargs):
    super().__init__(**kwargs)
    if units % shards:
      raise ValueError(f"{self.name}: {units} units do not split over {shards} shards")
    self.units, self.shards, self.use_bias = units, shards, use_bias
    self.activation = keras.activations.get(activation)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.placement: Placement = HERE

  def _add_shards(self, kernel_shape, bias_shape):
    self.kernels, self.biases = [], []
    for t in range(self.shards):
      with self.placement.scope(t):  # Each shard's weights are created where it will run.
        self.kernels.append(self.add_weight(shape=kernel_shape, initializer=self.kernel_initializer,
                                            name=shard_name("kernel", t, self.shards)))
        if bias_shape is not None:
          self.biases.append(self.add_weight(shape=bias_shape, initializer="zeros",
                                             name=shard_name("bias", t, self.shards)))

  def get_config(self):
    return {**super().get_config(), "units": self.units, "shards": self.shards,
            "activation": keras.activations.serialize(self.activation), "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}


class ColumnParallelDense(_ShardedDense):
  """act(x W + b), W [d_in, units] split by columns: shard t gives outputs [t u/T, (t+1) u/T).

  Call args:
    x: [..., d_in].
    shard: t, whose columns [..., units/T] to compute (a TensorParallel layer's
      `partial(x, t)` calls each shard where its placement says).
  """

  def build(self, input_shape):
    width = self.units // self.shards
    self._add_shards((input_shape[-1], width), (width,) if self.use_bias else None)

  def call(self, x, shard):
    y = ops.matmul(x, self.kernels[shard])
    if self.use_bias:
      y = y + self.biases[shard]
    return self.activation(y)


class RowParallelDense(_ShardedDense):
  """x W, W [d_in, units] split by rows: shard t's partial x[..., t] W[t, :] (no bias: the
  owner adds it once, after the sum of the partials).

  Call args:
    x: shard t's input slice [..., d_in/T].
    shard: t.
  """

  def __init__(self, units, **kwargs):
    super().__init__(units, use_bias=False, **kwargs)

  def build(self, input_shape):
    if input_shape[-1] % self.shards:
      raise ValueError(f"{self.name}: {input_shape[-1]} inputs do not split over {self.shards}")
    self._add_shards((input_shape[-1] // self.shards, self.units), None)

  def call(self, x, shard):
    return ops.matmul(x, self.kernels[shard])

  def get_config(self):
    config = super().get_config()
    config.pop("use_bias")
    return config


class TensorParallel:
  """A layer computed as the sum over its T shards of `partial(x, t)` (mixed into a Layer).

  Subclasses set `tensor_shards` and implement `partial`; `place()` hands the
  placement to this layer and every parallel Dense inside it (before building).
  """

  tensor_shards: int = 1
  placement: Placement = HERE

  def partial(self, x, t: int):
    """Shard t's partial output (the T partials sum to the layer's output)."""
    raise NotImplementedError

  def place(self, placement: Placement) -> None:
    for layer in [self, *self._flatten_layers(include_self=False)]:
      if isinstance(layer, (TensorParallel, _ShardedDense)):
        layer.placement = placement

  def sum_of_shards(self, x):
    partials = []
    for t in range(self.tensor_shards):
      with self.placement.scope(t):
        partials.append(self.placement.run(self, t)(x))
    return _sum(partials)  # The one reduction per sub-block: a sum of T partial outputs.

  def scattered_sum_of_shards(self, slices):
    """The layer's output over a sequence split in T slices, split the same way.

    Args:
      slices: T tensors [B, S/T, d], slice t on shard t's device.

    Returns:
      T tensors [B, S/T, d_out]: slice u, on shard u's device, is sum_t partial_t[:, u].
    """
    parts = []
    for t in range(self.tensor_shards):
      with self.placement.scope(t):
        whole = ops.concatenate(slices, axis=1)  # All-gather: shard t gets [B, S, d].
        # Cut where the partial is, so that only slice u travels to shard u.
        parts.append(ops.split(self.placement.run(self, t)(whole), self.tensor_shards, axis=1))
    out = []
    for u in range(self.tensor_shards):
      with self.placement.scope(u):  # Reduce-scatter: shard u sums the T partials' slice u.
        out.append(_sum([part[u] for part in parts]))
    return out


def _sum(partials):
  return partials[0] if len(partials) == 1 else ops.sum(ops.stack(partials), axis=0)


def whole_sequence(h):
  """h itself, or the T sequence slices of a sequence-parallel block joined [B, S, d] here."""
  return ops.concatenate(h, axis=1) if isinstance(h, (list, tuple)) else h
