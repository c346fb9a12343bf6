"""Generic collectives over the replicas in sync: the one place that calls them.

Every data-parallel exchange (tfpar.parallel.exchange) and every eval
reduction goes through these helpers, in the replica context of whatever
tf.distribute strategy is active: a ring over gRPC between workers
(MultiWorkerMirrored), a reduce to one device and broadcast between logical
CPUs (Mirrored), NCCL between GPUs, the TPU interconnect. With one replica in
sync (one_device, a parameter-server worker, a D=1 plan) each is the identity.

Packing by device: the hybrid engine's gradients live on the K x T devices of
a replica's plan row; given `devices`, the tensors of one device are
concatenated into one vector there and reduced as one, so a replica runs
K x T collectives per round (device (d, k, t) with its peers (d', k, t)), not
one per tensor. Without it the strategy packs (--all_reduce_pack_mb for
multi_worker_mirrored).

Eval outputs combine by one rule (tfpar.tasks.task.Task.eval_outputs):
scalars are shares of a global mean, or counts, and are SUMMED; tensors of
rank >= 1 hold one row per example and are concatenated along axis 0.
"""

import collections
import contextlib
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf


def by_device(devices: Sequence[Optional[str]]) -> Dict[Optional[str], List[int]]:
  """Tensor indices grouped by device, in first-seen order."""
  groups = collections.defaultdict(list)
  for i, device in enumerate(devices):
    groups[device].append(i)
  return groups


def all_reduce(op, tensors: List[tf.Tensor], devices: Optional[List[str]] = None) -> List[tf.Tensor]:
  """Reduces each tensor over the replicas in sync (identity with one replica).

  Args:
    op: a tf.distribute.ReduceOp.
    tensors: this replica's tensors.
    devices: if given, the device of each tensor: the tensors of one device
      are concatenated into one vector there and reduced as one.
  """
  ctx = tf.distribute.get_replica_context()
  if ctx is None or ctx.num_replicas_in_sync == 1 or not tensors:
    return list(tensors)
  if devices is None:
    return _reduce(ctx, op, list(tensors))
  packs, vectors = pack(tensors, devices)
  return unpack(packs, _reduce(ctx, op, vectors), tensors)


def _reduce(ctx, op, tensors: List[tf.Tensor]) -> List[tf.Tensor]:
  """ctx.all_reduce(op, tensors) without its gradient: what these helpers reduce (gradients,
  norms, eval outputs) is never differentiated.

  ReplicaContext.all_reduce wraps its collective in a tf.custom_gradient, which in a graph
  walks back from the result to the inputs for the variables read in between. Under
  MirroredStrategy a replica's result depends on every replica's inputs, so the walk runs
  through all of the step's graph built so far, at every call: a zero3 step, which sums
  each part's gradient in its backward, traced in time quadratic in its blocks (a tiny GPT
  of 16 blocks over 2 mirrored replicas: 255 s to its first step, 88 s without the walks in
  the backward, 67 s without the norm's; docs/zero.md). The merge_call below is the one
  ReplicaContext.all_reduce makes inside the wrapper (and makes bare for IndexedSlices).
  Where a strategy runs without merge_calls each replica's collective is its own, the walk
  stays local, and ctx.all_reduce is called as it is.
  """
  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    return ctx.all_reduce(op, tensors)
  where = lambda x: x.device if isinstance(x, tf.Tensor) else x  # all_reduce's destinations.
  return ctx.merge_call(lambda strategy, *xs: strategy.extended.batch_reduce_to(
      op, [(x, where(x)) for x in xs]), args=tuple(tensors))


def pack(tensors: Sequence[tf.Tensor], devices: Sequence[Optional[str]]):
  """([(device, indices)], [vector]): the tensors of one device and dtype concatenated into
  one vector there (a pack), in first-seen order, to be reduced as one."""
  packs = [(device, indices) for (device, _), indices in
           by_device([(d, t.dtype) for d, t in zip(devices, tensors)]).items()]
  vectors = []
  for device, indices in packs:
    with on_device(device):
      vectors.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], axis=0))
  return packs, vectors


def unpack(packs, vectors: Sequence[tf.Tensor], tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
  """Each pack's (reduced) vector split back into its tensors' shapes, on the pack's device."""
  out = [None] * len(tensors)
  for (device, indices), flat in zip(packs, vectors):
    with on_device(device):
      parts = tf.split(flat, [int(np.prod(tensors[i].shape)) for i in indices])
      for i, part in zip(indices, parts):
        out[i] = tf.reshape(part, tensors[i].shape)
  return out


def all_max(scalars: List[tf.Tensor], devices: Optional[List[str]] = None) -> List[tf.Tensor]:
  """The largest value over the replicas of each [1]-shaped tensor.

  An all-gather and a local max: MirroredStrategy's reduction to one device
  knows only SUM and MEAN.
  """
  ctx = tf.distribute.get_replica_context()
  out = [None] * len(scalars)
  for device, indices in by_device(devices or [None] * len(scalars)).items():
    with tf.device(device):
      packed = tf.concat([scalars[i] for i in indices], axis=0)[None]  # [1, n]
      peaks = tf.reduce_max(ctx.all_gather(packed, axis=0), axis=0)  # [n]
      for j, i in enumerate(indices):
        out[i] = peaks[j]
  return out


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


def replica_ids(strategy, local: int) -> List[int]:
  """The global replica id of each of this process's `local` replicas, in local order."""
  if strategy is None or strategy.num_replicas_in_sync == local:
    return list(range(local))
  ids = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.constant(ctx.replica_id_in_sync_group))
  return [int(x) for x in strategy.experimental_local_results(ids)]


def on_device(device: Optional[str]):
  """tf.device(device), or no change of placement for None (tf.device(None) would clear it)."""
  return tf.device(device) if device else contextlib.nullcontext()
