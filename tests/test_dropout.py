"""Under mirrored, each replica draws its own dropout mask (tfpar.layers.dropout), reproducibly.

keras' Dropout reads its seed from a mirrored SeedGenerator: both replicas drew
the same mask (README's known limitation). Two replicas on two logical CPUs
here: their masks differ, a layer made again with the same seed draws the same
masks again, and one replica draws exactly what keras' own Dropout draws.
"""

import keras
import numpy as np
import tensorflow as tf

from tfpar.layers.dropout import ReplicaDropout


def masks(layer_class, devices, seed=3, calls=2):
  """Each call's per-replica outputs of dropout(rate 0.5) on ones, as arrays."""
  strategy = tf.distribute.MirroredStrategy(devices,
                                            cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    layer = layer_class(0.5, seed=seed)

  @tf.function
  def step():
    return strategy.run(lambda: layer(tf.ones([256]), training=True))

  return [[np.asarray(x) for x in strategy.experimental_local_results(step())]
          for _ in range(calls)]


def test_replicas_draw_their_own_masks_and_a_run_draws_them_again():
  cpus = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
  first = masks(ReplicaDropout, cpus)
  for one, two in first:
    assert not np.array_equal(one == 0, two == 0)  # Independent masks, not one shared.
    assert 0.3 < np.mean(one == 0) < 0.7 and 0.3 < np.mean(two == 0) < 0.7
  assert not np.array_equal(first[0][0], first[1][0])  # A new mask each step.
  again = masks(ReplicaDropout, cpus)
  for got, want in zip(again, first):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)  # Reproducible: a function of seed, step, replica.


def test_one_replica_draws_what_keras_dropout_draws():
  cpu = [tf.config.list_logical_devices("CPU")[0].name]
  for ours, keras_own in zip(masks(ReplicaDropout, cpu), masks(keras.layers.Dropout, cpu)):
    np.testing.assert_array_equal(ours[0], keras_own[0])
