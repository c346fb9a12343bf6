"""Tensor parallelism (Megatron-style): each block's attention and MLP split over T devices.

What is split (Shoeybi et al. 2019, "Megatron-LM"), for a block on devices
dev_0 .. dev_{T-1} of its pipeline stage:

  attention  Q, K, V kernels [d, H*hd] are split by COLUMNS (column-parallel):
             shard t holds heads [t*H/T, (t+1)*H/T), so each shard runs its
             heads' softmax(Q_t K_t^T / sqrt(hd)) V_t alone. The output kernel
             [H*hd, d] is split by ROWS (row-parallel): shard t multiplies its
             heads' output by its rows, giving a partial [B, S, d].
  MLP        W_in [d, d_ff] by columns, W_out [d_ff, d] by rows: GELU acts on
             each column, so shard t computes gelu(x W_in[:, t] + b_in[t]) W_out[t].
  fused      with --fused_projections shard t computes its Q, K, V as one
             matmul by [W_q[:, t] | W_k[:, t] | W_v[:, t]] (its own heads'
             columns: Megatron's fused QKV shard; tfpar.layers.fused), and a
             gated MLP's gate and up by [W_gate[:, t] | W_up[:, t]].

  full output = sum_t partial_t + b_out          (b_out held once, on dev_0)

So nothing is exchanged inside a sub-block; the collectives are

  forward   f: the sub-block input x [B, S, d] goes to every shard (a copy);
            g: the T partial outputs are SUMMED (one reduction per sub-block,
               two per block: after attention and after the MLP).
  backward  g': the output gradient goes unchanged to every shard (identity);
            f': the T shards' input gradients are SUMMED.

In tfpar the sum is `TensorParallel.sum_of_shards` (tfpar.layers.parallel), on
the stage's first device, dev_0, where the residual stream lives, then copied
out: a reduce + broadcast, which is an all-reduce; TensorFlow's send/recv
between the devices carries the copies; the backward of the copy (a sum) and
of the sum (an identity) come from the gradient graph, placed with the
forward ops. The LayerNorms, output biases and residual stream stay on dev_0.
Which variable splits along which axis is tfpar.partitioning's table.

This module only decides *where* and *how* each shard runs: a
`DevicePlacement`, handed to the block by its typed `place()` hook, which the
block also uses while building, so shard t's weights are created on dev_t
(see tfpar.layout.placement for the bytes). Under --jit_compile each shard's
attention and MLP partial is one XLA program on its own device (a compiled
cluster lives on one device); TensorFlow differentiates a compiled function
into a compiled forward (which also returns what the backward needs) and a
compiled backward, placed with it, so the shard's backward runs compiled on
dev_t too. The copy f, the sum g, the LayerNorms and the residual stay
outside, on dev_0.

Sequence parallelism (--sequence_parallel; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2). Outside
the attention and the MLP, a block's ops (LayerNorm or RMSNorm, the output
bias, dropout, the residual add) act on each position alone, so they split
along the sequence: with S = T S', shard t holds positions
[t S', (t+1) S') of the residual stream, x_t [B, S', d], on dev_t, and runs
them there. The collectives become

  forward   g: all-gather along the sequence: dev_t receives every y_u = LN(x_u)
               and concatenates Y = [y_0 | ... | y_{T-1}] [B, S, d], the input of
               its column-parallel matmuls (the copy f is gone);
            g-bar: reduce-scatter: shard t cuts its partial P_t [B, S, d] into T
               slices and dev_u sums the T slices u, z_u = sum_t P_t[:, u] [B, S', d]
               (the sum g is gone);
  backward  g's transpose is a reduce-scatter of dY and g-bar's an all-gather of dz:
            tf.gradients derives both from the concat and the slices, placed with them.

The bytes sent per sub-block equal the all-reduce's (a ring all-reduce is a
reduce-scatter then an all-gather), so nothing is added; what is saved is
memory: the LayerNorm inputs, dropout masks and residual of a block now take
1/T of the sequence on each device instead of all of it on dev_0. In tfpar
each block's gathered Y stays whole on every dev_t until the backward (as in
plain tensor parallelism); Megatron-LM keeps only its slice and gathers again
in the backward. Per block and micro-batch, in 16-bit values
(tfpar.layout.placement.activation_bytes_per_block):

  tensor parallel               s b h (10 + 24/T) + 5 a s^2 b / T  (on dev_0)
  + sequence parallel, tfpar    s b h (4 + 30/T)  + 5 a s^2 b / T  (on every dev_t)
  + sequence parallel, Megatron s b h 34/T        + 5 a s^2 b / T

The stream stays split from block to block inside a stage, and is joined on
the stage's first device where it leaves the stage (to the next stage, or to
the head); under --remat=full each block joins its output, so that the
recomputed block's input is one tensor. LayerNorm weights and biases stay
whole on dev_0, read by every shard (their gradient: the sum of the T
shards'); Megatron replicates them and all-reduces their gradients. Under
--jit_compile the compiled unit is still each shard's partial on dev_t; the
per-slice ops run uncompiled on their devices. Dropout draws a mask per
slice: the same rate, other masks than without sequence parallelism.
"""

import contextlib
from typing import Callable, Sequence

import tensorflow as tf

from tfpar.layers.parallel import Placement, TensorParallel
from tfpar.models.base import ParallelBlock


class DevicePlacement(Placement):
  """Shard t under `tf.device(devices[t])`; each shard's partial one XLA program if asked;
  the blocks' sequence split over the shards if `sequence_parallel`."""

  def __init__(self, devices: Sequence[str], jit_compile: bool = False,
               sequence_parallel: bool = False):
    self.devices = list(devices)
    self.jit_compile = jit_compile
    self.sequence_parallel = sequence_parallel
    self._compiled = {}

  @contextlib.contextmanager
  def scope(self, t: int):
    # A device scope alone is ignored under a colocation, and --remat=full recomputes a
    # block's forward inside tf.gradients' colocation with the block's input (shard 0):
    # shard t's ops would land on shard 0's device, reading shard t's variables across
    # devices, which XLA refuses. Dropping the colocation keeps shard t on its device.
    with tf.compat.v1.colocate_with(None, ignore_existing=True), tf.device(self.devices[t]):
      yield

  def run(self, layer: TensorParallel, t: int) -> Callable:
    if not self.jit_compile:
      return super().run(layer, t)
    key = (id(layer), t)  # Made once per layer and shard.
    if key not in self._compiled:
      self._compiled[key] = tf.function(lambda x: layer.partial(x, t), jit_compile=True)
    return self._compiled[key]


def place_shards(block: ParallelBlock, devices: Sequence[str], jit_compile: bool = False,
                 sequence_parallel: bool = False) -> None:
  """Makes `block` run (and build) shard t under `tf.device(devices[t])`, compiled if asked,
  its sequence split over the shards if `sequence_parallel`."""
  if len(devices) != block.tensor_shards:
    raise ValueError(f"{block.name} has {block.tensor_shards} shards, got {len(devices)} devices")
  block.place(DevicePlacement(devices, jit_compile, sequence_parallel))
