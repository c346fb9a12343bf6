"""Several column-parallel Dense layers of one input computed as ONE matmul (--fused_projections).

Q, K and V (and a gated MLP's gate and up) all multiply the same x. Shard t's
kernels side by side, [W_q[:, t] | W_k[:, t] | W_v[:, t]] of [d, (H + 2G) D / T],
are Megatron-LM's fused QKV weight of shard t (Shoeybi et al. 2019): its own
heads' queries, keys and values, grouped-query attention too (G key/value heads).
One x [W_1 | W_2 | ...] replaces the separate x W_1, x W_2, ...: fewer and wider
matmuls, forward and backward (one weight gradient x^T dY, one input gradient
dY W^T). The weights stay the separate layers' variables, so their names,
shards and checkpoints are unchanged; the concatenation of the kernels (d x
3w values a step, next to the matmul's B T d 3w multiply-adds) is the cost.
"""

from typing import List, Sequence

from keras import ops

from tfpar.layers.parallel import ColumnParallelDense


def fused_columns(x, denses: Sequence[ColumnParallelDense], shard: int) -> List:
  """[dense(x, shard=shard) for dense in denses], from one matmul of x by their shard kernels.

  Args:
    x: [..., d_in], in the compute dtype (the kernels are cast to it, as Keras'
      autocast would inside each dense's call).
    denses: column-parallel Dense layers of the same input width and shard count.
    shard: t.

  Returns:
    One tensor per dense, [..., units/T], its bias and activation applied.
  """
  kernel = ops.concatenate([ops.cast(d.kernels[shard], x.dtype) for d in denses], axis=-1)
  y = ops.matmul(x, kernel)  # [..., sum of units/T]
  out, start = [], 0
  for d in denses:
    width = d.units // d.shards
    part = y[..., start:start + width]
    if d.use_bias:
      part = part + ops.cast(d.biases[shard], x.dtype)
    out.append(d.activation(part))
    start += width
  return out
