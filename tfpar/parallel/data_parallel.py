"""Data parallelism: the gradient all-reduce that combines replicas.

R replicas each hold the whole model and a B = G/R slice of the global batch
of G sequences. Each replica's loss is already divided by the *global* token
count (see tfpar.tasks.task), so its gradient g_r is its share of the mean
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

from typing import Dict, List, Sequence

import tensorflow as tf

from tfpar.parallel.compression import all_reduce


def all_reduce_gradients(grads: List[tf.Tensor]) -> List[tf.Tensor]:
  """SUMs each gradient over the replicas in sync (identity with one replica)."""
  return all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


# Held-out results combine by one rule (tfpar.tasks.task.Task.eval_outputs):
# scalars are shares of a global mean, or counts, and are SUMMED; tensors of
# rank >= 1 hold one row per example and are concatenated along axis 0.


def combine_outputs(parts: Sequence[Dict[str, tf.Tensor]]) -> Dict[str, tf.Tensor]:
  """Several micro-batches' eval outputs as one batch's."""
  if len(parts) == 1:
    return dict(parts[0])
  return {k: tf.add_n([p[k] for p in parts]) if parts[0][k].shape.rank == 0
          else tf.concat([p[k] for p in parts], axis=0) for k in parts[0]}


def reduce_outputs(strategy: tf.distribute.Strategy, per_replica: Dict) -> Dict[str, tf.Tensor]:
  """Every replica's eval outputs as the global batch's (in cross-replica context)."""
  out = {}
  for key, value in per_replica.items():
    rank = strategy.experimental_local_results(value)[0].shape.rank
    out[key] = (strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None) if rank == 0
                else strategy.gather(value, axis=0))
  return out
