"""ZeRO's flat-shard AdamW (tfpar.parallel.zero) against Keras AdamW on the same gradients.

D shards are updated one after the other in one process, the global norm
built from each shard's sum of squares as the all-reduce would; the gathered
weights and slots must equal Keras' per-variable AdamW (the decay set, the
warmup + cosine schedule, bias correction and clipping included).
Then ZeroUpdate on 4 mirrored logical CPUs against one device's tfpar update
(apply_gradients, --on_nonfinite=skip, clipping active on some steps): loss,
the summed gradient's norm, weights and the gathered m and v after every step
(m after step 1 is (1 - beta_1) x the clipped summed gradient, so the
gradients are compared through it).
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
    flat = tf.concat([opt.update(layout.shard(flat, r), parts[r], norm, tf.constant(step, tf.int64))
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
  out = opt.update(tf.ones([2]), tf.ones([2]), tf.constant(np.inf, tf.float32), 0)
  assert np.all(np.isnan(out.numpy()))


def _model():
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                           keras.layers.Dense(3)])


def _batches():
  rng = np.random.default_rng(3)
  out = []
  for step in range(STEPS):
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = rng.standard_normal((8, 3)).astype(np.float32) * (1 + 20 * (step % 2))  # Some steps clip.
    if step == 3:
      y[0, 0] = np.inf  # A non-finite step: skipped.
    out.append((x, y))
  return out


def _loss(model, x, y):
  return tf.reduce_sum(tf.square(model(x) - y)) / 8.0  # Share of the global (8) mean.


@pytest.fixture(scope="module")
def serial_run():
  """One device: Keras AdamW via tfpar's apply_gradients (--on_nonfinite=skip, clip active)."""
  from tfpar.training.step import apply_gradients
  model = _model()
  optim = OptimConfig(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, clip_norm=10.0)
  opt = make_optimizer(optim, train_steps=STEPS)
  out = []
  for x, y in _batches():
    with tf.GradientTape() as tape:
      loss = _loss(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    norm = apply_gradients(opt, grads, model.trainable_variables, skip_nonfinite=True)
    out.append((float(loss), float(norm), [v.numpy() for v in model.trainable_variables],
                [[opt._momentums[opt._get_variable_index(v)].numpy()
                  for v in model.trainable_variables],
                 [opt._velocities[opt._get_variable_index(v)].numpy()
                  for v in model.trainable_variables]]))
  return optim, out


@pytest.mark.parametrize("mode", zero.MODES)
def test_zero_on_4_mirrored_replicas_is_the_serial_twin(serial_run, mode):
  """Loss, gradient norm, weights and gathered slots after each step, at 1e-5."""
  optim, serial = serial_run
  norms = [n for _, n, _, _ in serial]
  assert max(n for n in norms if np.isfinite(n)) > optim.clip_norm > min(norms)  # Clipping active.
  assert sum(not np.isfinite(n) for n in norms) == 1  # One step skipped.
  devices = [f"/cpu:{i}" for i in range(4)]
  # As tfpar.strategies on CPUs: collective ops would reuse one key per strategy in a process.
  strategy = tf.distribute.MirroredStrategy(devices,
                                            cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    model = _model()
    opt = make_optimizer(optim, train_steps=STEPS)
  update = zero.ZeroUpdate(opt, model.trainable_variables, mode=mode, shard_ids=range(4),
                           devices=strategy.extended.worker_devices, num_replicas=4)

  @tf.function
  def step(x, y):
    def fn(x, y):
      ctx = tf.distribute.get_replica_context()
      device = tf.nest.flatten(ctx.devices)[0]
      local = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
      i = local.index(tf.DeviceSpec.from_string(device).to_string())
      with tf.GradientTape() as tape:
        loss = _loss(model, x, y)
      grads = tape.gradient(loss, model.trainable_variables)
      return loss, update.apply(grads, i, skip_nonfinite=True)
    loss, norm = strategy.run(fn, args=(x, y))
    return (strategy.reduce("SUM", loss, axis=None), strategy.experimental_local_results(norm)[0])

  for (x, y), (want_loss, want_norm, want_w, want_slots) in zip(_batches(), serial):
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[2 * ctx.replica_id_in_sync_group:2 * ctx.replica_id_in_sync_group + 2],
                     y[2 * ctx.replica_id_in_sync_group:2 * ctx.replica_id_in_sync_group + 2]))
    loss, norm = step(*dist)
    if np.isfinite(want_loss):
      np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
      np.testing.assert_allclose(float(norm), want_norm, rtol=1e-5)
    else:
      assert not np.isfinite(float(norm))
    for got, want in zip(model.trainable_variables, want_w):
      np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
    slots = update.slots()
    for got_slot, want_slot in zip((slots["m"], slots["v"]), want_slots):
      for got, want in zip(got_slot, want_slot):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
  assert int(opt.iterations.numpy()) == STEPS
  assert update.slot_bytes() == 8 * update.layout.shard_size
  assert abs(4 * update.slot_bytes() - 8 * update.layout.size) <= 8 * 4  # A quarter, but padding.
