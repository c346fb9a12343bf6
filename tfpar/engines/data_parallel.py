"""The data-parallel engine: one model replicated by a tf.distribute strategy.

For the strategies that own the variables (one_device, mirrored,
multi_worker_mirrored, tpu): the model and optimizer are built under
`strategy.scope()`, and each replica runs `TrainStep` under `strategy.run`:
its gradients, the run's gradient exchange (tfpar.parallel.exchange: the SUM
over replicas, or a codec), then the update of the mirrored variables. Under
--optimizer_sharding each replica keeps AdamW's state for its shard only and
tfpar.parallel.zero.ZeroUpdate does the sum, clip and update instead of the
Keras optimizer, whose slots are then never built. With several replicas the
exchange sits between the compiled gradients and the update, so under
--jit_compile the update is compiled apart: one XLA program per replica
(`AdamW.compile_update`, or ZeroUpdate's for its shard).
"""

import numpy as np
import tensorflow as tf

from tfpar.config.schema import Config
from tfpar.config.rules import check_batch, check_zero3_replicas
from tfpar.engines.base import Engine, build_model
from tfpar.layout import placement as plan_lib
from tfpar.parallel import zero, zero3
from tfpar.parallel.compression import make_exchange
from tfpar.training.checkpoint import CanonicalCheckpointer, layout_slices, model_layout
from tfpar.training.optimizer import inner_optimizer
from tfpar.training.step import EvalStep, TrainStep


class DataParallelEngine(Engine):
  """One model replicated by a tf.distribute strategy.

  Args:
    cfg: the run's config.
    strategy: the tf.distribute strategy.
    data, sharding, task: as for tfpar.engines.base.Engine.
  """

  def __init__(self, cfg: Config, strategy, data, *, sharding: str = "data", task=None):
    super().__init__(cfg, data, sharding=sharding, task=task)
    self.strategy = strategy
    self.num_replicas = strategy.num_replicas_in_sync
    # config checked this for CPU hosts; GPUs and TPU cores are counted only now.
    check_batch(cfg.train.global_batch_size, self.num_replicas)
    sharding_mode = cfg.parallel.optimizer_sharding
    if sharding_mode == "zero3":
      check_zero3_replicas(self.num_replicas)
    # zero3: the model is a template without storage; its weights live in zero3's shards.
    self.model = self._template() if sharding_mode == "zero3" else None
    with strategy.scope():
      self.model = self.model or build_model(cfg, task=self.task)
      self.optimizer = self.build_optimizer(self.model.trainable_variables,
                                            slots=sharding_mode == "none")
    variables = self.model.trainable_variables
    # PowerSGD state: one set per replica of this process, on the replica's device.
    self._local_devices = list(strategy.extended.worker_devices)
    # One replica on a CPU reads a plain tf.data iterator: a tf.distribute iterator alive
    # in the process slows XLA's CPU programs by about 10%
    # (scripts/input_iterator_peak.py); on a GPU its prefetch to the device is worth keeping.
    self._plain_input = (isinstance(strategy, tf.distribute.OneDeviceStrategy) and
                         "CPU" in self._local_devices[0].upper())
    self._replica_of_device = {plan_lib.device_key(d): i
                               for i, d in enumerate(self._local_devices)}
    self.exchange = make_exchange(cfg.compression, variables, num_replicas=self.num_replicas,
                                  state_devices=[[d] * len(variables)
                                                 for d in self._local_devices],
                                  seed=cfg.train.seed)
    jit = cfg.train.jit_compile
    # --optimizer_sharding: each local replica's shard of AdamW's m and v, on its device.
    # Under --jit_compile each replica's update (clip + AdamW) is one XLA program.
    self.zero = None
    if sharding_mode == "zero3":
      self.zero = zero3.Zero3(self.model, self.optimizer, shard_ids=_replica_ids(strategy),
                              devices=self._local_devices, num_replicas=self.num_replicas,
                              strategy=strategy, jit_compile=jit, **self._zero3_placement())
    elif sharding_mode != "none":
      self.zero = zero.ZeroUpdate(
          self.optimizer, variables, mode=sharding_mode, shard_ids=_replica_ids(strategy),
          devices=self._local_devices, num_replicas=self.num_replicas, strategy=strategy,
          jit_compile=jit)
    if self.zero is None and jit and self.num_replicas > 1:
      inner_optimizer(self.optimizer).compile_update()
    slots = self.zero.checkpoint_slots if self.zero else None
    layout = model_layout(self.model, self.optimizer, slots)
    if sharding_mode == "zero3":
      layout = self.zero.checkpoint_layout(layout)
      self.zero.initialise(cfg.train.seed)  # Each replica makes its rows (no whole model).
    self.layouts = [{**layout, **self.exchange.checkpoint_entries(strategy)}]
    # One replica: nothing runs between gradients and update, so XLA compiles both.
    self._train_step = TrainStep(self.model, self.optimizer, loss_fn=self.task.loss,
                                 jit_compile=jit,
                                 fuse_update=self.num_replicas == 1 and self.zero is None,
                                 exchange=self.exchange, update=self.zero,
                                 skip_nonfinite=cfg.train.on_nonfinite == "skip")
    self._eval_step = EvalStep(self.model, self.task.eval_outputs, jit_compile=jit)

  def _template(self):
    """zero3's model: the task's, its weights without storage (tfpar.parallel.zero3)."""
    return zero3.build_template(lambda: build_model(self.cfg, task=self.task,
                                                    initialised=False))

  def _zero3_placement(self) -> dict:
    """Where zero3 runs each replica's parts (Zero3's placements; none: on the replica's
    device)."""
    return {}

  def checkpointer(self, directory: str, **kwargs) -> CanonicalCheckpointer:
    """Under zero3 every process writes and restores its replicas' rows of every weight, m
    and v (tfpar.parallel.zero3.Zero3.slices) and no process gathers a tensor; the chief
    writes the rest (the step, the dropout RNG states), which every process restores."""
    if not (self.zero and self.zero.mode == "zero3"):
      return super().checkpointer(directory, **kwargs)
    rows = self.zero.slices()
    rest = [p for p in layout_slices(self.layouts[0]) if not isinstance(p.variable, zero3.View)]
    return CanonicalCheckpointer(
        self.layouts, directory, held=rows + rest,
        write=rows + (rest if kwargs.get("is_chief", True) else []),
        writers=self.num_replicas // len(self._local_devices), **kwargs)

  @property
  def input_strategy(self):
    return None if self._plain_input else self.strategy

  def _replica_train(self, inputs, targets, compressed):
    replica = self._local_replica() if self.exchange.stateful or self.zero else 0
    if self.zero and self.zero.mode == "zero3":
      loss, grads = self.zero.loss_and_grads(inputs, targets, self.task.loss, replica)
      return loss, self.zero.apply(grads, replica,
                                   skip_nonfinite=self.cfg.train.on_nonfinite == "skip")
    return self._train_step(inputs, targets, replica=replica, compressed=compressed)

  def _local_replica(self) -> int:
    """The local index of the replica running this (replica) function."""
    if len(self._local_devices) == 1:
      return 0
    device = tf.nest.flatten(tf.distribute.get_replica_context().devices)[0]
    return self._replica_of_device[plan_lib.device_key(device)]

  def _replica_step(self, inputs, targets, compressed):
    loss, norm = self.strategy.run(self._replica_train, args=(inputs, targets, compressed))
    # The norm is of the all-reduced gradient: the same on every replica.
    return (self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
            self.strategy.experimental_local_results(norm)[0])

  def _replica_eval(self, inputs, targets):
    if self.zero and self.zero.mode == "zero3":
      return self.task.eval_outputs(self.zero.outputs(inputs, self._local_replica()), targets)
    return self._eval_step(inputs, targets)

  # --- bytes per replica --------------------------------------------------------
  def measured_bytes(self) -> dict:
    """Bytes one replica holds, from the variables allocated: weights and optimizer state."""
    optimizer = _nbytes(inner_optimizer(self.optimizer).variables)  # Without slots under ZeRO.
    if self.zero and self.zero.mode == "zero3":  # The template's weights have no storage.
      return {"weights": self.zero.held_bytes(("w",)) + _nbytes(self.model.non_trainable_variables),
              "optimizer": optimizer + self.zero.held_bytes(("m", "v"))}
    slots = self.zero.slot_bytes() if self.zero else 0
    return {"weights": _nbytes(self.model.variables), "optimizer": optimizer + slots}

  def predicted_bytes(self) -> dict:
    """What tfpar.parallel.zero.state_bytes predicts from the model flags' parameter count."""
    counts = plan_lib.count_params(self.cfg.model, family=self.task.family)
    params = counts.embedding + counts.head + self.cfg.model.num_layers * counts.block
    return zero.state_bytes(params, self.num_replicas, self.cfg.parallel.optimizer_sharding)

  def memory_devices(self):
    return list(self._local_devices)

  def predicted_memory(self):
    """Per local replica: the state above, its own gradient (and the summed one beside it when
    replicas sum), and the activations its backward keeps at G/D sequences: the plan of
    one device holding the whole model (tfpar.layout.placement)."""
    cfg, d = self.cfg, self.num_replicas
    state = self.predicted_bytes()
    one = plan_lib.make_plan(
        cfg.replace(parallel={"data_parallel": 1, "microbatches": 1},
                    train={"global_batch_size": cfg.train.global_batch_size // d}),
        [self._local_devices[0]], family=self.task.family)
    activations = sum(one.activation_bytes().values())
    gradients = state["weights"] + (state["summed_gradient"] if d > 1 else 0)
    one = {"weights": state["weights"], "gradients": gradients, "optimizer": state["optimizer"],
           "activations": activations}
    if self.zero and self.zero.mode == "zero3":
      step = self.zero.step_bytes()
      one.update(weights=state["weights"] + step["weights"],
                 gradients=state["summed_gradient"] + step["gradients"])
    return {device: one for device in self._local_devices}

  def write_files(self, model_dir: str) -> None:
    """plan.json in ParallelPlan.write's shape (the grid's sizes; per device, the predicted
    bytes and beside them the measured), one entry per local replica's device."""
    predicted, measured = self.predicted_bytes(), self.measured_bytes()
    devices = [plan_lib.device_key(d) for d in self._local_devices]
    per_device = lambda b: {d: {"parameters": b["weights"], "optimizer": b["optimizer"]}
                            for d in devices}
    plan_lib.write_plan_json(model_dir, {
        "strategy": type(self.strategy).__name__, "data_parallel": self.num_replicas,
        "pipeline_stages": 1, "tensor_parallel": 1,
        "optimizer_sharding": self.cfg.parallel.optimizer_sharding,
        "summed_gradient_bytes": predicted["summed_gradient"],
        "bytes_per_device": per_device(predicted),
        "measured_bytes_per_device": per_device(measured)})

  def bytes_report(self) -> str:
    measured, predicted = self.measured_bytes(), self.predicted_bytes()
    return ("bytes per replica, predicted | measured: " + ", ".join(
        f"{kind} {plan_lib.kib(predicted[kind])} | {plan_lib.kib(measured[kind])}"
        for kind in measured) + f", summed gradient {plan_lib.kib(predicted['summed_gradient'])} "
        "(predicted only: a tensor, not a variable)")

  def describe(self) -> dict:
    info = {"strategy": type(self.strategy).__name__, "replicas": self.num_replicas,
            "parameters": int(sum(np.prod(v.shape) for v in self.model.trainable_variables))}
    if self.zero:
      info["optimizer sharding"] = self.zero.mode
    return info


def _nbytes(variables) -> int:
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def _replica_ids(strategy):
  """The global replica id of each of this process's replicas, in local device order."""
  ids = []
  strategy.experimental_distribute_values_from_function(
      lambda ctx: ids.append(ctx.replica_id_in_sync_group) or tf.constant(0))
  return ids
