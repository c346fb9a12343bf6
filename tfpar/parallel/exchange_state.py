"""The gradient exchange's state in the canonical checkpoint (tfpar.training.checkpoint).

PowerSGD (tfpar.parallel.compression) keeps, per local replica, a residual
e_r per compressed matrix and a Q that is the same on every replica. Two
layout entries hold them, whatever the replica count or placement:

  compression/powersgd@q      every Q once, flattened and concatenated in
                              variable order: [sum n R]
  compression/powersgd@error  every replica's residuals, each replica's
                              flattened and concatenated in variable order,
                              stacked in global replica order: [R, sum m n]
                              (one all-gather across workers at save)
"""

from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar.parallel import collectives


def powersgd_entries(q: List[Dict[int, tf.Variable]], error: List[Dict[int, tf.Variable]],
                     num_replicas: int, strategy=None) -> dict:
  """Layout entries for the per-local-replica PowerSGD state `q` and `error`."""
  ids = collectives.replica_ids(strategy, len(q))
  order = sorted(q[0])
  return {
      "compression/powersgd@q": (None, [FlatEntry([[r[i] for i in order] for r in q])]),
      "compression/powersgd@error": (None, [FlatEntry([[e[i] for i in order] for e in error],
                                                      ids, num_replicas, strategy)]),
  }


class FlatEntry:
  """A checkpoint entry: per-replica lists of variables, each list flattened into one vector.

  Without `replica_ids` the lists hold the same values (read the first, set
  all): shape [n]. With them, every replica's vector, in replica order: [R, n].
  """

  def __init__(self, per_replica, replica_ids=None, num_replicas=None, strategy=None):
    self.per_replica, self.ids, self.strategy = per_replica, replica_ids, strategy
    self.sizes = [int(np.prod(v.shape)) for v in per_replica[0]]
    self.dtype = per_replica[0][0].dtype
    n = sum(self.sizes)
    self.shape = tf.TensorShape([n] if replica_ids is None else [num_replicas, n])

  def _vector(self, variables):
    return tf.concat([tf.reshape(v.read_value(), [-1]) for v in variables], axis=0)

  @property
  def value(self):
    if self.ids is None:
      return self._vector(self.per_replica[0])
    if len(self.per_replica) == self.shape[0]:  # Every replica is in this process.
      with tf.device("/cpu:0"):
        return tf.stack([self._vector(self.per_replica[j]) for j in np.argsort(self.ids)])
    local = dict(zip(self.ids, self.per_replica))
    values = self.strategy.experimental_distribute_values_from_function(
        lambda ctx: self._vector(local[ctx.replica_id_in_sync_group])[None])
    return self.strategy.gather(values, axis=0)  # A collective: every worker saves.

  def _assign(self, variables, vector):
    for v, part in zip(variables, np.split(np.asarray(vector), np.cumsum(self.sizes)[:-1])):
      v.assign(part.reshape(v.shape))

  def assign(self, value):
    if self.ids is None:
      for variables in self.per_replica:
        self._assign(variables, value)
    else:
      for r, variables in zip(self.ids, self.per_replica):
        self._assign(variables, value[r])
