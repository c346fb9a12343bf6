"""Dropout whose mask is each data-parallel replica's own.

keras' Dropout draws its mask from the layer's SeedGenerator, a variable that a
tf.distribute strategy mirrors: every replica reads the same seed and, on the
same shapes, drops the same positions, so D replicas train on D copies of one
mask instead of D independent ones (the mean gradient's noise is that of one
replica). Here the seed the generator hands out, s = (s0, s1), becomes
(s0, s1 + r) on replica r (its id in the sync group, 0 outside a strategy or
with one replica), and the mask is TensorFlow's stateless dropout of that seed:
a pure function of (seed, step, replica), so a run stays reproducible, and a
single replica draws exactly what keras' Dropout draws. The generator's
variable is keras' own (the same name in checkpoints).
"""

import keras
import tensorflow as tf


class ReplicaDropout(keras.layers.Dropout):
  """keras.layers.Dropout, with the replica's id folded into the seed of its mask."""

  def call(self, inputs, training=False):
    if not (training and self.rate > 0):
      return inputs
    seed = self.seed_generator.next()
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
      replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
      seed = seed + tf.stack([tf.zeros_like(replica), replica])
    # As keras' TensorFlow backend: int64 state, int32 seeds (XLA's stateless ops).
    seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    return tf.nn.experimental.stateless_dropout(
        inputs, rate=self.rate, seed=seed,
        noise_shape=self._get_concrete_noise_shape(inputs) if self.noise_shape else None)

  def _get_concrete_noise_shape(self, inputs):
    shape = tf.shape(inputs)
    return [shape[i] if d is None else d for i, d in enumerate(self.noise_shape)]
