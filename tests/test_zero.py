"""ZeRO's flat-shard AdamW (tfpar.parallel.zero) against Keras AdamW on the same gradients.

D shards are updated one after the other in one process, the global norm
built from each shard's sum of squares as the all-reduce would; the gathered
weights and slots must equal Keras' per-variable AdamW (the decay set, the
warmup + cosine schedule, bias correction and clipping included).
Then ZeroUpdate on 4 mirrored logical CPUs against one device's tfpar update
(apply_gradients, --on_nonfinite=skip, clipping active on some steps): loss,
the summed gradient's norm, weights and the gathered m and v after every step
(m after step 1 is (1 - beta_1) x the clipped summed gradient, so the
gradients are compared through it); zero1 and the unsharded update there also
compiled as one XLA program per replica (--jit_compile's), zero2 op by op.
And PlanZero (a hybrid plan's ZeRO) alone on D=2 copies of a 2-device row against the
same one-device run, with both copies in one program (stages on different workers) and
in replica context, compiled per (position, copy) or not. And the stage worker's update
(AdamW.in_order: weight by weight, the clip factor inside) against that run too.
"""

import json
import re

import numpy as np
import pytest
import tensorflow as tf
import keras

from conftest import TINY, assert_same_state, make_config
from tfpar import strategies
from tfpar.config.cluster import Cluster
from tfpar.data import pipeline
from tfpar.engines.data_parallel import DataParallelEngine
from tfpar.config.schema import CompressionConfig, OptimConfig
from tfpar.parallel import zero, zero3
from tfpar.parallel.compression import make_exchange
from tfpar.planner import clusters, cost
from tfpar.training.checkpoint import assign_canonical, read_canonical, read_checkpoint
from tfpar.training.optimizer import inner_optimizer, learning_rate_schedule, make_optimizer
from tfpar.training.step import apply_gradients, apply_or_skip
from tensorflow.python.ops import op_selector  # pylint: disable=wrong-import-order

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


def mirrored_run(optim, mode, codec=CompressionConfig(), replicas=4, jit_compile=False):
  """[(loss, norm, weights, [m, v])] after each step of the toy on mirrored replicas.

  mode 'none': the exchange's sum and tfpar's apply_gradients (the unsharded
  update); 'zero1'/'zero2': ZeroUpdate. `codec`: the exchange's CompressionConfig.
  `jit_compile`: each replica's update as one XLA program (AdamW.compile_update,
  ZeroUpdate's jit_compile), as the engine does under --jit_compile.
  """
  devices = [f"/cpu:{i}" for i in range(replicas)]
  per = 8 // replicas  # Rows of the global batch (8) each replica reads.
  # As tfpar.strategies on CPUs: collective ops would reuse one key per strategy in a process.
  strategy = tf.distribute.MirroredStrategy(devices,
                                            cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    model = _model()
    opt = make_optimizer(optim, train_steps=STEPS)
    if mode == "none":
      opt.build(model.trainable_variables)
  if mode == "none" and jit_compile:
    opt.compile_update()
  variables = model.trainable_variables
  exchange = make_exchange(codec, variables, num_replicas=replicas,
                           state_devices=[[d] * len(variables)
                                          for d in strategy.extended.worker_devices])
  update = None if mode == "none" else zero.ZeroUpdate(
      opt, variables, mode=mode, shard_ids=range(replicas),
      devices=strategy.extended.worker_devices, num_replicas=replicas, jit_compile=jit_compile)

  @tf.function
  def step(x, y):
    def fn(x, y):
      ctx = tf.distribute.get_replica_context()
      device = tf.nest.flatten(ctx.devices)[0]
      local = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
      i = local.index(tf.DeviceSpec.from_string(device).to_string())
      with tf.GradientTape() as tape:
        loss = _loss(model, x, y)
      grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
      if update is None:
        return loss, apply_gradients(opt, exchange.reduce(grads, i), variables,
                                     skip_nonfinite=True)
      return loss, update.apply(grads, i, exchange=exchange, skip_nonfinite=True)
    loss, norm = strategy.run(fn, args=(x, y))
    return (strategy.reduce("SUM", loss, axis=None), strategy.experimental_local_results(norm)[0])

  out = []
  for x, y in _batches():
    rows = lambda ctx: slice(per * ctx.replica_id_in_sync_group,
                             per * (ctx.replica_id_in_sync_group + 1))
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[rows(ctx)], y[rows(ctx)]))
    loss, norm = step(*dist)
    if update is None:
      slots = [[opt._momentums[opt._get_variable_index(v)].numpy() for v in variables],
               [opt._velocities[opt._get_variable_index(v)].numpy() for v in variables]]
    else:
      slots = [[t.numpy() for t in update.slots()[name]] for name in ("m", "v")]
    out.append((float(loss), float(norm), [v.numpy() for v in variables], slots))
  assert int(opt.iterations.numpy()) == STEPS
  if jit_compile:  # One program per replica, traced once.
    programs = opt._programs.programs.values() if update is None else update._updates
    assert [f.experimental_get_tracing_count() for f in programs] == [1] * replicas
  if update is not None:
    assert update.slot_bytes() == 8 * update.layout.shard_size
    # 1/D of the slots, but padding.
    assert abs(replicas * update.slot_bytes() - 8 * update.layout.size) <= 8 * replicas
  return out


def assert_same_steps(got_steps, want_steps):
  for (loss, norm, weights, slots), (want_loss, want_norm, want_w, want_slots) in zip(
      got_steps, want_steps):
    if np.isfinite(want_loss):
      np.testing.assert_allclose([loss, norm], [want_loss, want_norm], rtol=1e-5)
    else:
      assert not np.isfinite(norm)
    for got, want in zip(weights, want_w):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    for got_slot, want_slot in zip(slots, want_slots):
      for got, want in zip(got_slot, want_slot):
        # Relative to the tensor's scale: a gradient element that is a near-cancelling sum
        # of the replicas' partials carries their float32 rounding (~1e-7 of the partials),
        # which is many times its own size; v squares it (seen: 3.5e-5 of one v element).
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("mode, jit_compile", [("zero1", True), ("zero2", False), ("none", True)])
def test_zero_on_4_mirrored_replicas_is_the_serial_twin(serial_run, mode, jit_compile):
  """Loss, gradient norm, weights and gathered slots after each step, at 1e-5; the update
  compiled per replica (unsharded too) or not (zero1's engine below, zero2's here)."""
  optim, serial = serial_run
  norms = [n for _, n, _, _ in serial]
  assert max(n for n in norms if np.isfinite(n)) > optim.clip_norm > min(norms)  # Clipping active.
  assert sum(not np.isfinite(n) for n in norms) == 1  # One step skipped.
  assert_same_steps(mirrored_run(optim, mode, jit_compile=jit_compile), serial)


def test_zero1_takes_a_codecs_sum_as_the_unsharded_update_does(serial_run):
  """zero1 with --grad_compression=powersgd (rank 1, every matrix compressed; its error
  feedback per replica) on 2 replicas: the unsharded PowerSGD run's steps, at 1e-5. The
  casts (fp16, bf16) reach ZeroUpdate through the same exchange.reduce."""
  optim, _ = serial_run
  codec = CompressionConfig(method="powersgd", rank=1, min_size=0)
  assert_same_steps(mirrored_run(optim, "zero1", codec, replicas=2),
                    mirrored_run(optim, "none", codec, replicas=2))


def plan_run(optim, mode, jit_compile):
  """[[(loss, norm, weights, [m, v])] after each step] of each copy of the toy under PlanZero.

  D=2 copies, each a 2-device row (copy d's layer k on /cpu:2d+k, its step counter on
  /cpu:2d), a device position per layer; one replica function per copy under
  MirroredStrategy over the anchors (/cpu:0, /cpu:2), as the hybrid engine on one host.
  Each copy's own weights and the gathered slots per step.
  """
  reference = _model()
  rows, optimizers = [], []
  for d in range(2):
    rows.append([])
    for k, layer in enumerate(reference.layers):
      with tf.device(f"/cpu:{2 * d + k}"):
        rows[-1].append(keras.layers.Dense.from_config(layer.get_config()))
        rows[-1][-1].build((None, layer.kernel.shape[0]))
        rows[-1][-1].set_weights(layer.get_weights())
    with tf.device(f"/cpu:{2 * d}"):
      optimizers.append(make_optimizer(optim, train_steps=STEPS))
  copies = [[v for layer in row for v in layer.trainable_variables] for row in rows]
  exchange = make_exchange(CompressionConfig(), copies[0], num_replicas=2,
                           state_devices=[[zero.variable_device(v) for v in c] for c in copies],
                           pack_by_device=True)
  plan = zero.PlanZero(optimizers, copies, mode=mode, shard_ids=[0, 1], num_replicas=2,
                       jit_compile=jit_compile)

  def grads_of(d, x, y):
    def forward(x):
      for k, layer in enumerate(rows[d]):
        with tf.device(f"/cpu:{2 * d + k}"):
          x = layer(x)
      return x
    with tf.GradientTape() as tape:
      loss = _loss(forward, x, y)
    return loss, tape.gradient(loss, copies[d])

  strategy = tf.distribute.MirroredStrategy(
      ["/cpu:0", "/cpu:2"], cross_device_ops=tf.distribute.ReductionToOneDevice())

  @tf.function
  def step(x, y):
    def fn(x, y):
      device = tf.nest.flatten(tf.distribute.get_replica_context().devices)[0]
      d = [tf.DeviceSpec.from_string(a).to_string() for a in strategy.extended.worker_devices
           ].index(tf.DeviceSpec.from_string(device).to_string())
      loss, grads = grads_of(d, x, y)
      return loss, plan.apply(grads, d, exchange=exchange, skip_nonfinite=True)
    loss, norm = strategy.run(fn, args=(x, y))
    return strategy.reduce("SUM", loss, axis=None), strategy.experimental_local_results(norm)[0]

  out = [[], []]
  for x, y in _batches():
    x, y = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[4 * ctx.replica_id_in_sync_group:][:4],
                     y[4 * ctx.replica_id_in_sync_group:][:4]))
    loss, norm = step(x, y)
    for d, variables in enumerate(copies):
      slots = [[plan.checkpoint_slots(v)[i].value.numpy() for v in variables] for i in (0, 1)]
      out[d].append((float(loss), float(norm), [v.numpy() for v in variables], slots))
  assert [int(o.iterations.numpy()) for o in optimizers] == [STEPS, STEPS]
  for update, group in zip(plan.updates, plan.groups):  # Copy d's shard beside its weights.
    for d, shard in enumerate(update.shards):
      assert shard.shard == d and shard.m.device == zero.variable_device(copies[d][group[0]])
  if jit_compile:  # One program per (position, copy), traced once.
    assert [f.experimental_get_tracing_count() for u in plan.updates for f in u._updates] == \
        [1] * 4
  return out


@pytest.mark.parametrize("mode, jit_compile", [("zero1", True), ("zero2", False)])
def test_plan_zero_over_two_copies_of_a_2_device_row_is_the_serial_twin(
    serial_run, mode, jit_compile):
  """PlanZero (zero.PlanZero) on D=2 copies x 2 device positions, a replica function per
  copy: every copy's loss, norm, weights and the gathered m and v after each step equal one
  device's AdamW (clipping on some steps, one non-finite step skipped); the shard updates
  compiled as one XLA program per position and copy, or op by op."""
  optim, serial = serial_run
  for copy in plan_run(optim, mode, jit_compile):
    assert_same_steps(copy, serial)


# --- the data-parallel engine under --optimizer_sharding ------------------------------------
# Each engine takes the same STEPS steps from the same data, one call per step; after each step
# its canonical state (weights, m, v, the step: what a checkpoint holds, through the slots'
# view for ZeRO) must be one device's. m after step 1 is (1 - beta_1) x the clipped summed
# gradient, so the gradients are compared through it. --clip_norm=0.05 clips every step.
ENGINE_ARGS = TINY + [f"--train_steps={STEPS}", "--seed=3", "--input_sharding=data",
                      "--jit_compile=false", "--clip_norm=0.05", "--on_nonfinite=skip"]
PLANS = {"none x1": ["--strategy=one_device"],
         "zero1 x4": ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero1"],
         # Its forward, backward and (compiled per replica) update under XLA.
         "zero2 x2": ["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero2",
                      "--jit_compile=true"],
         "none x4": ["--strategy=mirrored", "--num_cpu_devices=4"],
         "zero2 x4": ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero2"],
         "zero3 x4": ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero3"],
         "zero3 x2": ["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero3"]}
CHAIN_SAVE = 2  # zero1 (zero3) x4 saves here; none x1 resumes to 4, then zero2 (zero3) x2 to STEPS.


def make_engine(plan, model_dir):
  cfg = make_config(ENGINE_ARGS + PLANS[plan] + [f"--model_dir={model_dir}"])
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  strategy = strategies.make_strategy(cfg.dist, Cluster())
  corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                eval_fraction=cfg.data.eval_fraction)
  engine = DataParallelEngine(cfg, strategy, corpus)
  engine.write_files(str(model_dir))  # plan.json, as the runner has the chief write it.
  return engine


def train_steps(engine, first, last, save_at=(), directory=None):
  """[(loss, norm, canonical state)] of steps first+1..last, saving after the steps in save_at."""
  iterator, out = engine.train_iterator(first), []
  for step in range(first + 1, last + 1):
    losses, norms = engine.train(iterator, 1)
    out.append((float(losses[0]), float(norms[0]), read_canonical(engine.layouts[0])))
    if step in save_at:
      engine.checkpointer(directory).save(step)
  return out


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
  """{plan: (engine, per-step records)}; zero1 and zero3 x4 also save their step-CHAIN_SAVE
  checkpoint."""
  out = {}
  for plan in ("none x1", "zero1 x4", "zero3 x4"):
    model_dir = tmp_path_factory.mktemp(plan.replace(" ", "_"))
    engine = make_engine(plan, model_dir)
    out[plan] = model_dir, engine, train_steps(engine, 0, STEPS, (CHAIN_SAVE,),
                                               str(model_dir / "checkpoints"))
  return out


@pytest.mark.parametrize("plan", ["zero1 x4", "zero3 x4"])
def test_a_sharded_engine_on_4_mirrored_replicas_is_one_devices_twin(engine_runs, plan):
  """Loss, norm and the canonical state (weights, m, v: the first gradient through m) after
  each of STEPS steps, every one clipped, at 1e-5. (zero2's engine is checked step by step in
  the restore chain below, on 2 replicas; its update on 4, in
  test_zero_on_4_mirrored_replicas_is_the_serial_twin.) zero3's weights are one device's
  from the start: each replica's rows of them."""
  _, serial_engine, serial = engine_runs["none x1"]
  _, engine, sharded = engine_runs[plan]
  assert min(norm for _, norm, _ in serial) > serial_engine.cfg.optim.clip_norm  # Clipping.
  assert engine.zero.mode == plan.split()[0] and engine.num_replicas == 4
  assert not inner_optimizer(engine.optimizer).built  # No Keras slots: the shards hold them.
  for step, ((loss, norm, state), (want_loss, want_norm, want_state)) in enumerate(
      zip(sharded, serial), 1):
    np.testing.assert_allclose([loss, norm], [want_loss, want_norm], rtol=1e-5)
    assert_same_state(state, want_state, f"{plan} step {step}")
  assert int(sharded[-1][2]["optimizer/iterations"]) == STEPS


@pytest.mark.parametrize("first, last", [("zero1 x4", "zero2 x2"), ("zero3 x4", "zero3 x2")])
def test_a_sharded_x4_checkpoint_resumes_unsharded_then_sharded_x2(engine_runs, tmp_path,
                                                                   first, last):
  """zero1 x4 -> none x1 -> zero2 x2, and zero3 x4 -> none x1 -> zero3 x2: every step's loss
  and state as the unsharded run's.

  The unsharded leg is the serial run's engine (traced already), its state replaced by the
  restore; its own records were taken before.
  """
  _, one, serial = engine_runs["none x1"]
  first_dir, _, _ = engine_runs[first]
  written = str(first_dir / "checkpoints" / f"ckpt-{CHAIN_SAVE}")
  assert_same_state(read_checkpoint(written), serial[CHAIN_SAVE - 1][2], f"{first}'s checkpoint")
  assert one.checkpointer(str(tmp_path)).restore(written)
  assert one.step == CHAIN_SAVE
  middle = train_steps(one, CHAIN_SAVE, 4, (4,), str(tmp_path / "one"))
  two = make_engine(last, tmp_path / "two")
  assert two.checkpointer(str(tmp_path)).restore(
      str(tmp_path / "one" / "ckpt-4"))
  assert two.step == 4
  assert two.zero.mode == last.split()[0] and two.num_replicas == 2
  last_steps = train_steps(two, 4, STEPS)
  if last == "zero2 x2":
    assert [f.experimental_get_tracing_count() for f in two.zero._updates] == [1, 1]
  for step, ((loss, norm, state), (want_loss, want_norm, want_state)) in enumerate(
      zip(middle + last_steps, serial[CHAIN_SAVE:]), CHAIN_SAVE + 1):
    np.testing.assert_allclose([loss, norm], [want_loss, want_norm], rtol=1e-5)
    assert_same_state(state, want_state, f"resumed step {step}")


def test_plan_json_measures_a_quarter_of_the_sharded_state_at_d4(engine_runs):
  """Per replica: zero1's slots, and zero3's weights and slots, within 10% of a quarter of
  unsharded (the step counter stays whole); plan.json predicts what it measures."""
  plans, summed = {}, {}
  for plan in ("none x1", "zero1 x4", "zero3 x4"):
    model_dir, engine, _ = engine_runs[plan]
    with open(model_dir / "plan.json") as f:
      record = json.load(f)
    devices = record["measured_bytes_per_device"]
    assert record["data_parallel"] == int(plan[-1]) and len(devices) == int(plan[-1])
    assert devices == record["bytes_per_device"]  # Predicted as measured, on every replica.
    plans[plan], summed[plan] = next(iter(devices.values())), record["summed_gradient_bytes"]
  none, zero1, zero3 = (plans[p] for p in ("none x1", "zero1 x4", "zero3 x4"))
  counter = 8  # AdamW's int64 step, on every replica.
  assert abs((zero1["optimizer"] - counter) / ((none["optimizer"] - counter) / 4) - 1) < 0.1
  assert zero1["parameters"] == none["parameters"]  # Replicated.
  assert abs((zero3["parameters"] + zero3["optimizer"] - counter) /
             ((none["parameters"] + none["optimizer"] - counter) / 4) - 1) < 0.1
  assert abs(zero3["parameters"] / (none["parameters"] / 4) - 1) < 0.1
  assert summed["zero1 x4"] == none["parameters"]
  # zero2 holds 2 of the D shards of the summed gradient: half of it at D=4, all at D=2.
  params = none["parameters"] // 4
  assert zero.state_bytes(params, 4, "zero2")["summed_gradient"] == 8 * -(-params // 4)
  assert zero.state_bytes(params, 2, "zero2")["summed_gradient"] == 4 * params
  assert summed["zero3 x4"] == 4 * -(-params // 4)


def test_zero3_slices_are_row_rectangles_of_the_canonical_state(engine_runs):
  """Zero3.slices(): every weight, m and v of the 4 replicas as (name, full shape, begin, size,
  variable); placed at begin they tile each canonical tensor exactly once, rows only."""
  _, engine, _ = engine_runs["zero3 x4"]
  state = read_canonical(engine.layouts[0])
  tiled = {}
  for s in engine.zero.slices():
    assert tuple(s.variable.shape) == s.size and s.size[1:] == s.shape[1:]
    assert s.begin[1:] == (0,) * (len(s.shape) - 1) and state[s.name].shape == s.shape
    full = tiled.setdefault(s.name, np.full(s.shape, np.nan, np.float32))
    rows = slice(s.begin[0], s.begin[0] + s.size[0])
    assert np.all(np.isnan(full[rows]))  # No row held twice.
    full[rows] = s.variable.numpy()
  assert sorted(tiled) == sorted(n for n in state if n != "optimizer/iterations"
                                 and not n.startswith("dropout_rng/"))
  for name, full in tiled.items():
    np.testing.assert_array_equal(full, state[name], err_msg=name)


def test_the_planners_bytes_per_device_are_plan_jsons_measured_bytes_at_d4(engine_runs, tmp_path):
  """tfpar.planner.cost's weights and optimizer state per device (tfpar system, D = 4) within
  10% of what plan.json measured from the allocated variables, for none, zero1, zero2 and
  zero3 (whose one gathered part and its gradients, tensors, the planner adds on top:
  checked apart).

  zero1 and zero3 x4 are the fixture's runs; none x4 and zero2 x4 are engines built only
  (plan.json is written at start-up, before any step). The summed gradient is a tensor, not a
  variable: the planner's figure is checked against the runtime's own prediction (not measured).
  """
  dirs = {p: engine_runs[p][0] for p in ("zero1 x4", "zero3 x4")}
  for plan in ("none x4", "zero2 x4"):
    dirs[plan] = tmp_path / plan.replace(" ", "_")
    make_engine(plan, dirs[plan])
  written = {}
  for plan, model_dir in dirs.items():
    with open(model_dir / "plan.json") as f:
      written[plan] = json.load(f)
  cfg = engine_runs["zero1 x4"][1].cfg
  modes = ("none", "zero1", "zero2", "zero3")
  n = len(modes)
  plans = cost.Plans(D=np.full(n, 4), K=np.ones(n, int), T=np.ones(n, int),
                     b=np.full(n, cfg.train.global_batch_size // 4), remat=np.zeros(n, int),
                     sharding=np.array([cost.SHARDINGS.index(z) for z in modes]))
  predicted = cost.evaluate(cfg.model, clusters.parse("cpu:4"), plans,
                            global_batch=cfg.train.global_batch_size, precision="float32",
                            system=cost.TFPAR)
  gathered = 4 * cost.zero3_part_params(cfg.model)  # zero3's one part, gathered whole; its
  summed = gathered + gathered / 4  # full gradient, and a quarter of its sum (D = 4 groups).
  assert engine_runs["zero3 x4"][1].zero.step_bytes() == {"weights": gathered,
                                                        "gradients": summed}  # The runtime's.
  assert zero3.SUM_CHUNKS == cost.ZERO3_SUM_CHUNKS == 4
  for i, mode in enumerate(modes):
    plan = written[f"{mode} x4"]
    assert (plan["optimizer_sharding"], plan["data_parallel"]) == (mode, 4)
    measured = next(iter(plan["measured_bytes_per_device"].values()))
    extra = gathered if mode == "zero3" else 0
    assert abs((predicted["weights"][i] - extra) / measured["parameters"] - 1) < 0.1, (mode, measured)
    assert abs(predicted["optimizer"][i] / measured["optimizer"] - 1) < 0.1, (mode, measured)
    assert abs((predicted["gradients"][i] - (summed if extra else 0)) /
               plan["summed_gradient_bytes"] - 1) < 0.1, mode
  # A quarter of the optimizer state under zero1/zero2/zero3; zero2's gradient: 2 of the 4
  # shards; zero3's weights and gradients a quarter too, besides its gathered part.
  assert len(set(predicted["optimizer"][1:])) == 1
  assert predicted["optimizer"][1] == predicted["optimizer"][0] / 4
  assert predicted["gradients"][2] == predicted["gradients"][0] / 2
  assert predicted["weights"][3] - gathered == predicted["weights"][0] / 4
  assert predicted["gradients"][3] - summed == predicted["gradients"][0] / 4
  assert predicted["remat"][3] == cost.FULL  # zero3 recomputes every block.


def test_zero3s_update_runs_one_weight_after_another(engine_runs):
  """In zero3's traced update each weight's clipped gradient waits for the previous weight's
  assignments of w, m and v: one weight's AdamW temporaries at a time, not every weight's."""
  _, engine, _ = engine_runs["zero3 x4"]
  z = engine.zero
  _, indices, _ = z._updates[0][0]  # pylint: disable=protected-access
  update = tf.function(  # pylint: disable=protected-access
      lambda grads, norm, step: z._update(0, indices, grads, norm, step, True))
  graph = update.get_concrete_function(
      [tf.TensorSpec(z.slots[0]["w"][i].shape) for i in indices], tf.TensorSpec([]),
      tf.TensorSpec([], tf.int64)).graph
  clipped = [op for op in graph.get_operations()
             if op.type == "Mul" and op.inputs[0].op.type == "Placeholder"
             and op.inputs[0].shape.rank >= 1]
  assert len(indices) > 1 and len(clipped) == len(indices)
  assert sum(sum(c.type == "AssignVariableOp" for c in op.control_inputs) == 3
             for op in clipped) == len(indices) - 1


def test_zero3_gathers_each_part_once_its_input_exists(engine_runs):
  """In zero3's traced forward every part's gather but the embedding's waits for the part's
  input (the part before's output): one part's gathered weights at a time, not every part's
  gathered as the step starts."""
  _, engine, _ = engine_runs["zero3 x4"]
  z = engine.zero
  forward = tf.function(lambda x: engine.strategy.run(
      lambda x: z.outputs(x, engine._local_replica()), args=(x,)))  # pylint: disable=protected-access
  graph = forward.get_concrete_function(
      tf.TensorSpec([2, engine.cfg.model.seq_len], tf.int32)).graph
  scopes = {}  # Each gather's ops (its name scope, one per part and replica).
  for op in graph.get_operations():
    path = op.name.split("/")
    for depth, name in enumerate(path[:-1]):
      if re.fullmatch(r"gather(_\d+)?", name):
        scopes.setdefault("/".join(path[:depth + 1]), []).append(op)
  waits = [[c for op in ops for c in op.control_inputs] for ops in scopes.values()]
  parts = len(z.blocks) + 2  # The embedding, the blocks, the head.
  assert len(scopes) == 4 * parts
  assert sum(bool(w) for w in waits) == 4 * (parts - 1)
  assert all(c.type not in ("Placeholder", "ReadVariableOp") for w in waits for c in w)


def test_zero3s_sums_do_not_walk_the_step_graph_under_mirrored(engine_runs, monkeypatch):
  """Tracing zero3's step on 4 mirrored replicas, no tf.custom_gradient walks back over much
  of the graph. ReplicaContext.all_reduce's gradient wrapper walked from each sum through
  every replica's graph built so far (a Mirrored sum reads every replica's input): zero3 sums
  each part's gradient in its backward, and its step traced in time quadratic in the blocks
  (tfpar.parallel.collectives._reduce)."""
  _, engine, _ = engine_runs["zero3 x4"]
  walked = []
  real = op_selector.get_backward_walk_ops

  def counted(*args, **kwargs):  # TensorFlow's own walk, its length recorded.
    ops = real(*args, **kwargs)
    walked.append(len(ops))
    return ops

  monkeypatch.setattr(op_selector, "get_backward_walk_ops", counted)
  spec = tf.TensorSpec([8, engine.cfg.model.seq_len], tf.int32)
  graph = tf.function(lambda x, y: engine._replica_step(x, y, False)).get_concrete_function(  # pylint: disable=protected-access
      spec, spec).graph
  assert walked and len(graph.get_operations()) > 10_000
  assert max(walked) < len(graph.get_operations()) / 20, (max(walked), len(graph.get_operations()))


def test_a_nonfinite_step_is_skipped_under_zero3(engine_runs):
  """A NaN weight makes every gradient NaN: --on_nonfinite=skip keeps every weight row, m and
  v of the 4 replicas and still counts the step. (Runs last: it changes the fixture's engine.)"""
  _, engine, _ = engine_runs["zero3 x4"]
  step = engine.step
  values = read_canonical(engine.layouts[0])
  name = next(n for n in values if n.endswith("@m")).removesuffix("@m")
  values[name] = values[name].copy()
  values[name].flat[0] = np.nan
  assign_canonical(engine.layouts[0], values)
  losses, norms = engine.train(engine.train_iterator(step), 1)
  assert np.isnan(losses[0]) and not np.isfinite(norms[0])
  assert engine.step == step + 1
  after = read_canonical(engine.layouts[0])
  for key, want in values.items():
    if key != "optimizer/iterations" and not key.startswith("dropout_rng/"):
      np.testing.assert_array_equal(after[key], want, err_msg=key)


def test_an_in_order_update_with_the_clip_factor_inside_is_the_serial_twin(serial_run):
  """The stage worker's update (apply_or_skip in_order, the clip factor inside each weight's
  update, AdamW's own clip off) after each step, skipped step included, at 1e-5; and in its
  trace each weight's update waits for the previous weight's assignments."""
  optim, serial = serial_run
  model = _model()
  opt = make_optimizer(optim, train_steps=STEPS)
  opt.build(model.trainable_variables)
  inner_optimizer(opt).global_clipnorm = None
  variables = model.trainable_variables

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = _loss(model, x, y)
    grads = tape.gradient(loss, variables)
    norm = tf.linalg.global_norm(grads)
    apply_or_skip(opt, grads, variables, norm, skip_nonfinite=True, in_order=True,
                  scale=zero.clip_factor(norm, optim.clip_norm))
    return loss, norm

  out = []
  for x, y in _batches():
    loss, norm = step(x, y)
    out.append((float(loss), float(norm), [v.numpy() for v in variables],
                [[opt._momentums[opt._get_variable_index(v)].numpy() for v in variables],
                 [opt._velocities[opt._get_variable_index(v)].numpy() for v in variables]]))
  assert_same_steps(out, serial)

  @tf.function
  def update(grads, scale):
    apply_or_skip(opt, grads, variables, 0.0, skip_nonfinite=False, in_order=True, scale=scale)

  graph = update.get_concrete_function([tf.TensorSpec(v.shape) for v in variables],
                                       tf.TensorSpec([])).graph
  assigns = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}
  scaled = [op for op in graph.get_operations()
            if op.type == "Mul" and [t.op.type for t in op.inputs] == ["Placeholder"] * 2]
  # Each weight's scaled gradient after the first waits for the previous weight's update.
  assert len(scaled) == len(variables)
  assert sum(any(c.type in assigns for c in op.control_inputs) for op in scaled) \
      == len(variables) - 1
