"""ZeRO's flat-shard AdamW (tfpar.parallel.zero) against Keras AdamW on the same gradients.

D shards are updated one after the other in one process, the global norm
built from each shard's sum of squares as the all-reduce would; the gathered
weights and slots must equal Keras' per-variable AdamW (the decay set, the
warmup + cosine schedule, bias correction and clipping included).
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

from tfpar.schema import OptimConfig
from tfpar.parallel import zero
from tfpar.training.optimizer import learning_rate_schedule, make_optimizer

SHAPES = {"embeddings": (7, 5), "kernel": (5, 3), "bias": (3,), "gamma": (5,)}
STEPS = 6
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, clip_norm=1.0)


def gradients(step):
  rng = np.random.default_rng(step)
  scale = 10.0 if step % 2 else 0.05  # Odd steps clip, even ones do not.
  return [scale * rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]


@pytest.fixture(scope="module")
def keras_run():
  """Keras AdamW's weights, m and v (flat per variable) after each step."""
  rng = np.random.default_rng(0)
  variables = [keras.Variable(rng.standard_normal(s).astype(np.float32), name=n)
               for n, s in SHAPES.items()]
  opt = make_optimizer(OPTIM, train_steps=STEPS)
  initial = [v.numpy() for v in variables]
  history = []
  for step in range(STEPS):
    opt.apply([tf.constant(g) for g in gradients(step)], variables)
    history.append(([v.numpy() for v in variables],
                     [opt._momentums[opt._get_variable_index(v)].numpy() for v in variables],
                     [opt._velocities[opt._get_variable_index(v)].numpy() for v in variables]))
  return initial, zero.decay_flags(opt, variables), history


@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_sharded_adamw_equals_keras_adamw(keras_run, num_shards):
  initial, decay, history = keras_run
  assert decay == [True, True, False, False]
  layout = zero.FlatLayout(SHAPES.values(), num_shards)
  shards = [zero.ShardedAdamW(layout, r, decay, learning_rate=learning_rate_schedule(OPTIM, STEPS),
                              weight_decay=OPTIM.weight_decay, beta_1=0.9, beta_2=0.95,
                              epsilon=1e-8, clip_norm=OPTIM.clip_norm)
            for r in range(num_shards)]
  flat = layout.flatten(initial)
  for step in range(STEPS):
    grads = layout.flatten(gradients(step))
    parts = [layout.shard(grads, r) for r in range(num_shards)]
    norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(p)) for p in parts]))  # The scalar all-reduce.
    flat = tf.concat([opt.update(layout.shard(flat, r), parts[r], norm)
                      for r, opt in enumerate(shards)], axis=0)  # The all-gather.
    weights, m, v = history[step]
    for got, want in [(layout.unflatten(flat), weights),
                      (layout.unflatten(tf.concat([o.m for o in shards], 0)), m),
                      (layout.unflatten(tf.concat([o.v for o in shards], 0)), v)]:
      for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-7)
  assert not np.any(flat.numpy()[layout.size:])  # The padding stays zero.
  assert sum(o.slot_bytes() for o in shards) == 8 * layout.padded_size
  assert shards[0].slot_bytes() == 8 * -(-layout.size // num_shards)


def test_a_nonfinite_norm_makes_the_update_nan():
  """Keras' clip turns a non-finite norm into NaN everywhere; the caller's skip must catch it."""
  layout = zero.FlatLayout([(4,)], 2)
  opt = zero.ShardedAdamW(layout, 0, [True], learning_rate=0.1, weight_decay=0.0,
                          beta_1=0.9, beta_2=0.95, epsilon=1e-8, clip_norm=1.0)
  out = opt.update(tf.ones([2]), tf.ones([2]), tf.constant(np.inf, tf.float32))
  assert np.all(np.isnan(out.numpy()))
