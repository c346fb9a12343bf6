"""Data parallelism: the gradient all-reduce that combines replicas.

R replicas each hold the whole model and a B = G/R slice of the global batch
of G sequences. Each replica's loss is already divided by the *global* token
count (see tfpar.training.step), so its gradient g_r is its share of the mean
gradient, and the update uses

    g = sum_r g_r          (one SUM all-reduce over the R replicas)

which equals the gradient one device computes on the whole batch. The reduce
runs in the replica context of whatever tf.distribute strategy is active: a
ring over gRPC between workers (MultiWorkerMirrored), a reduce to one device
and broadcast between logical CPUs (Mirrored), NCCL between GPUs, the TPU
interconnect; with one replica (one_device, each parameter-server worker) it
is the identity. Every engine reaches it through the run's GradientReducer
(tfpar.parallel.compression), which can also compress it.
"""

from typing import List

import tensorflow as tf

from tfpar.parallel.compression import all_reduce


def all_reduce_gradients(grads: List[tf.Tensor]) -> List[tf.Tensor]:
  """SUMs each gradient over the replicas in sync (identity with one replica)."""
  return all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
