"""Hybrid data x pipeline x tensor parallelism: the engine for model-parallel plans.

Placement. `MirroredStrategy` creates every variable on all of its own devices
and ignores `tf.device`, so model-parallel weights are NOT created under any
strategy scope. Instead this engine builds one copy of the task's model per
data-parallel replica, outside every scope, each stage's (and shard's) weights under
`tf.device` of its device in the plan (tfpar.layout.placement), and one AdamW per
copy beside it (its slots are created colocated with their variables; its step
counter on the replica's first device, the "anchor"). Every device makes its
own slices of the weights it holds, equal to what one device initialises
(tfpar.training.initialise): no process ever builds the whole model.

Step. The data-parallel dimension is a tf.distribute strategy whose replicas
are the D anchors: `MirroredStrategy(anchors)` on one host, the job's
`MultiWorkerMirroredStrategy` across hosts (one replica per worker, each worker
holding its K x T devices), nothing at all for D=1. Each replica function

  1. picks its model copy (from its anchor device),
  2. runs its pipeline (tfpar.parallel.pipeline) over its K x T devices with
     explicit tf.device placement, in the order of the plan's schedule
     (tfpar.parallel.schedules: GPipe, 1F1B or interleaved 1F1B),
  3. SUMs each gradient with the same gradient of the other D-1 copies
     through the run's gradient exchange (tfpar.parallel.exchange), packed
     per device: the gradients of the weights one device holds are
     concatenated there, so a replica spanning K x T devices runs K x T
     all-reduces per round (device (d, k, t) with its peers (d', k, t)), not
     one per weight. PowerSGD works per weight matrix before that packing
     (its P and Q are what gets packed), with its state beside each weight.
     It RETURNS the reduced gradients. (A plan whose stages are on different
     workers runs tfpar.engines.stage_worker instead, one program per worker.)

Then, in cross-replica context and outside any strategy scope, each copy's
optimizer applies its reduced gradients to its own variables
(`tfpar.training.step.apply_gradients`, the tail every engine shares). (Keras 3's
optimizer called inside a replica context does a merge_call and a mirrored
`extended.update`, which cannot work on per-replica, non-mirrored variables.)
All copies apply the same summed gradient, so they stay identical.

Under --optimizer_sharding the replica function does the whole update itself
instead (tfpar.parallel.zero.PlanZero): per device position (k, t), copy d
keeps AdamW's m and v for shard d of the weights there, sums (zero1) or
reduce-scatters (zero2) the gradient, updates its shards and all-gathers
every copy's; each replica function writes only its own copy's variables.
Under --jit_compile each (position, copy) shard update is one XLA program on
its device.

The input, the step loop and the optimizer build are the engine core's
(tfpar.engines.base), so tfpar.training.loop drives it unchanged. `layouts` holds one
canonical layout per model copy in this process (D on one host, one per worker
across hosts), so a checkpoint restores into every copy.

XLA: a compiled cluster lives on one device and the step spans K x T, so
under --jit_compile each stage's (or tensor shard's) forward and backward is
compiled on its own device (tfpar.parallel.pipeline, tfpar.parallel.tensor);
the send/recv and the all-reduce run between those programs; the update is
compiled per device too under --optimizer_sharding (PlanZero), op by op without.
"""

import collections
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar import strategies
from tfpar.config.schema import Config
from tfpar.engines.base import Engine
from tfpar.layout import placement as plan_lib
from tfpar.parallel import collectives, schedules, tensor, zero
from tfpar.parallel.compression import make_exchange
from tfpar.parallel.pipeline import Pipeline
from tfpar.training import initialise
from tfpar.training.checkpoint import layout_slices, model_layout
from tfpar.training.step import apply_gradients, reduce_gradients


def predicted_memory(plan, devices) -> Dict[str, Dict[str, int]]:
  """Per device of `devices` (this process's): the plan's weights, optimizer state and
  activations, and a gradient as large as its weights."""
  held, activations = plan.bytes_per_device(), plan.activation_bytes()
  out = {}
  for device in devices:
    key = plan_lib.device_key(device)
    out[device] = {"weights": held[key]["parameters"], "gradients": held[key]["parameters"],
                   "optimizer": held[key]["optimizer"], "activations": activations.get(key, 0)}
  return out


class ModelCopy:
  """One data-parallel replica: the model over its plan row, its optimizer, its pipeline."""

  def __init__(self, cfg: Config, plan: plan_lib.ParallelPlan, row, *, task, build_optimizer):
    self.devices = row  # row[k][t]
    first, last = row[0][0], row[-1][0]
    with initialise.recording() as self.initializers:  # What sharded_initialise draws from.
      self._build(cfg, plan, row, task, first, last)
    with tf.device(first):  # The step counter; slots colocate with their weights.
      self.optimizer = build_optimizer(self.model.trainable_variables)
    self.pipeline = Pipeline(self.model, stage_blocks=[blocks for _, blocks in plan.chunks],
                             stage_devices=[row[k][0] for k, _ in plan.chunks],
                             microbatches=plan.microbatches, loss_fn=task.loss,
                             eval_fn=task.eval_outputs, remat=plan.remat,
                             jit_compile=cfg.train.jit_compile,
                             schedule=schedules.make(plan.schedule, plan.virtual_stages))

  def _build(self, cfg, plan, row, task, first, last):
    """The model's weights, each stage's (and shard's) on its device."""
    self.model = task.build_model(tensor_shards=plan.tensor_parallel, seed=cfg.train.seed)
    with tf.device(first):
      self.model.build_embed()
    for stage in plan.stages:
      for i in stage.blocks:
        block = self.model.blocks[i]
        tensor.place_shards(block, row[stage.index], jit_compile=cfg.train.jit_compile,
                            sequence_parallel=cfg.parallel.sequence_parallel)
        with tf.device(row[stage.index][0]):  # Unsplit weights: the stage's first device.
          block.build(self.model.block_shape)
    with tf.device(last):
      self.model.build_head()
    self.model.built = True

  @property
  def variables(self):
    return list(self.model.variables) + list(self.optimizer.variables)


def measured_bytes(copies, slots=()) -> dict:
  """{device: {"parameters": bytes, "optimizer": bytes}} of the copies' real variables;
  `slots`: optimizer variables held apart from the copies' optimizers (ZeRO's shards)."""
  out = collections.defaultdict(lambda: {"parameters": 0, "optimizer": 0})
  held = [("parameters", v) for copy in copies for v in copy.model.variables] + \
      [("optimizer", v) for copy in copies for v in copy.optimizer.variables] + \
      [("optimizer", v) for v in slots]
  for kind, v in held:
    nbytes = int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
    out[plan_lib.device_key(zero.variable_device(v))][kind] += nbytes
  return dict(out)


class ModelParallelEngine(Engine):
  """Trains a task's model under a D x K x T plan (see the module docstring).

  Args:
    cfg: the run's config.
    strategy: the runner's strategy; only a MultiWorkerMirroredStrategy is
      used (as the data-parallel dimension across workers). On one host the
      engine makes its own MirroredStrategy over the D anchors (none for D=1).
    data, sharding, task: as for tfpar.engines.base.Engine.
  """

  def __init__(self, cfg: Config, strategy, data, *, sharding: str = "data", task=None):
    super().__init__(cfg, data, sharding=sharding, task=task)
    local = strategies.compute_devices(cfg.dist.num_cpu_devices)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
      resolver = strategy.cluster_resolver
      self.plan = plan_lib.make_plan(cfg, [], worker_devices=_worker_devices(resolver, local),
                                     family=self.task.family)
      self.worker_index = _worker_index(resolver)
      self.strategy = strategy
      rows = [self.worker_index]
    else:
      self.plan = plan_lib.make_plan(cfg, local, family=self.task.family)
      self.worker_index = 0
      d = self.plan.data_parallel
      self.strategy = None if d == 1 else tf.distribute.MirroredStrategy(
          self.plan.anchors, cross_device_ops=tf.distribute.ReductionToOneDevice())
      rows = list(range(d))
    self.num_replicas = self.plan.data_parallel
    sharding = cfg.parallel.optimizer_sharding
    build_optimizer = lambda variables: self.build_optimizer(variables, slots=sharding == "none")
    self.copies: List[ModelCopy] = [
        ModelCopy(cfg, self.plan, self.plan.devices[r], task=self.task,
                  build_optimizer=build_optimizer)
        for r in rows]
    self._copy_of_anchor = {plan_lib.device_key(self.plan.devices[r][0][0]): i
                            for i, r in enumerate(rows)}
    for copy in self.copies:  # Each device makes its own slices (tfpar.training.initialise).
      initialise.initialise(layout_slices(model_layout(copy.model)), cfg.train.seed,
                            copy.initializers)
    self.exchange = make_exchange(
        cfg.compression, self.copies[0].model.trainable_variables, num_replicas=self.num_replicas,
        state_devices=[[v.value.device for v in c.model.trainable_variables]
                       for c in self.copies],
        pack_by_device=True, seed=cfg.train.seed)
    # --optimizer_sharding: per device position, each copy's shard of AdamW's m and v there.
    self.zero = None if sharding == "none" else zero.PlanZero(
        [c.optimizer for c in self.copies], [c.model.trainable_variables for c in self.copies],
        mode=sharding, shard_ids=collectives.replica_ids(self.strategy, len(self.copies)),
        num_replicas=self.num_replicas, strategy=self.strategy,
        jit_compile=cfg.train.jit_compile)  # Each shard's update one XLA program on its device.
    slots = self.zero.checkpoint_slots if self.zero else None
    self.layouts = [model_layout(c.model, c.optimizer, slots) for c in self.copies]
    # The compression state of every copy rides in the first layout (read at save).
    self.layouts[0].update(self.exchange.checkpoint_entries(self.strategy))
    if self.worker_index == 0 and cfg.train.model_dir:
      print(f"tfpar: {self.plan.format()}", flush=True)
      self.plan.write(cfg.train.model_dir, measured=self.measured_bytes())

  # --- steps ------------------------------------------------------------------
  def _copy_index(self) -> int:
    """Which of this process's copies the replica running this (replica) function holds."""
    ctx = tf.distribute.get_replica_context()
    if self.strategy is None or len(self.copies) == 1:
      return 0
    return self._copy_of_anchor[plan_lib.device_key(tf.nest.flatten(ctx.devices)[0])]

  def _copy(self) -> ModelCopy:
    return self.copies[self._copy_index()]

  def _replica_train(self, inputs, targets, compressed=False):
    """(loss, the summed gradients); under ZeRO (loss, norm), the copy updated already."""
    index = self._copy_index()
    loss, grads = self.copies[index].pipeline.loss_and_grads(inputs, targets)
    if self.zero:
      return loss, self._zero_update(grads, index, compressed)
    return loss, reduce_gradients(self.exchange, grads, replica=index, compressed=compressed)

  def _zero_update(self, grads, copy, compressed):
    """The norm, once PlanZero has updated local copy `copy` from its `grads`."""
    return self.zero.apply(grads, copy, exchange=self.exchange, compressed=compressed,
                           skip_nonfinite=self.cfg.train.on_nonfinite == "skip")

  def _replica_eval(self, inputs, targets):
    return self._copy().pipeline.eval_outputs(inputs, targets)

  def _run(self, fn, inputs, targets):
    """(per-copy (loss, grads), summed loss) of fn over the data-parallel replicas."""
    if self.strategy is None:
      out = fn(inputs, targets)
      return [out], out[0]
    out = self.strategy.run(fn, args=(inputs, targets))
    total = self.strategy.reduce(tf.distribute.ReduceOp.SUM, out[0], axis=None)
    local = [self.strategy.experimental_local_results(x) for x in tf.nest.flatten(out)]
    per_copy = [tf.nest.pack_sequence_as(out, [x[r] for x in local])
                for r in range(len(self.copies))]
    return per_copy, total

  def _replica_step(self, inputs, targets, compressed):
    per_copy, loss = self._run(lambda x, y: self._replica_train(x, y, compressed), inputs,
                               targets)
    if self.zero:  # Each replica updated its copy (tfpar.parallel.zero.PlanZero).
      return loss, per_copy[0][1]
    # Cross-replica context, default strategy: each optimizer updates its own copy.
    # The reduced gradient is the same on every copy, and so is its norm (and the
    # skip branch of --on_nonfinite=skip).
    skip = self.cfg.train.on_nonfinite == "skip"
    norm = [apply_gradients(copy.optimizer, list(grads), copy.model.trainable_variables,
                            skip_nonfinite=skip)
            for copy, (_, grads) in zip(self.copies, per_copy)][0]
    return loss, norm

  # --- state ------------------------------------------------------------------
  @property
  def optimizer(self):
    """Copy 0's optimizer: every copy applies the same updates and counts the same steps."""
    return self.copies[0].optimizer

  def measured_bytes(self) -> dict:
    return measured_bytes(self.copies, self.zero.slot_variables() if self.zero else ())

  def memory_devices(self):
    return [device for copy in self.copies for stage in copy.devices for device in stage]

  def predicted_memory(self):
    return predicted_memory(self.plan, self.memory_devices())

  def describe(self) -> dict:
    p = self.plan
    per_device = {dev: f"params {plan_lib.kib(b['parameters'])} + "
                       f"optimizer {plan_lib.kib(b['optimizer'])}"
                  for dev, b in self.measured_bytes().items()}
    how = type(self.strategy).__name__ if self.strategy else "none (D=1)"
    return {"strategy": how,
            "replicas": self.num_replicas,
            "plan": f"D={p.data_parallel} x K={p.pipeline_stages} x T={p.tensor_parallel}, "
                    f"M={p.microbatches}, {p.schedule}"
                    f"{f' v={p.virtual_stages}' if p.virtual_stages > 1 else ''}, "
                    f"bubble {p.bubble:.1%}, remat {p.remat}, "
                    f"{'sequence parallel, ' if p.sequence_parallel else ''}"
                    f"xla {'per stage/shard' if self.cfg.train.jit_compile else 'off'}"
                    f"{f', optimizer {self.zero.mode}' if self.zero else ''}",
            "parameters": int(sum(np.prod(v.shape)
                                  for v in self.copies[0].model.trainable_variables)),
            "measured_bytes_per_device": per_device}


def _worker_devices(resolver, local: List[str]) -> List[List[str]]:
  """Each worker's device names, in worker order (chief first), as this worker's local ones."""
  spec = resolver.cluster_spec().as_dict()
  tasks = [("chief", i) for i in range(len(spec.get("chief", [])))] + \
      [("worker", i) for i in range(len(spec.get("worker", [])))]
  indices = [tf.DeviceSpec.from_string(d).device_index for d in local]
  kind = tf.DeviceSpec.from_string(local[0]).device_type
  return [[f"/job:{job}/replica:0/task:{i}/device:{kind}:{j}" for j in indices]
          for job, i in tasks]


def _worker_index(resolver) -> int:
  spec = resolver.cluster_spec().as_dict()
  if resolver.task_type == "worker":
    return resolver.task_id + len(spec.get("chief", []))
  return 0
