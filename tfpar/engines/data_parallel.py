"""The data-parallel engine: one model replicated by a tf.distribute strategy.

For the strategies that own the variables (one_device, mirrored,
multi_worker_mirrored, tpu): the model and optimizer are built under
`strategy.scope()`, and each replica runs `TrainStep` under `strategy.run`:
its gradients, the run's gradient exchange (tfpar.parallel.exchange: the SUM
over replicas, or a codec), then the update of the mirrored variables.
"""

import numpy as np
import tensorflow as tf

from tfpar.config import Config, check_batch
from tfpar.engines.base import Engine, build_model
from tfpar.parallel import plan as plan_lib
from tfpar.parallel.compression import make_exchange
from tfpar.training.checkpoint import model_layout
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
    with strategy.scope():
      self.model = build_model(cfg, task=self.task)
      self.optimizer = self.build_optimizer(self.model.trainable_variables)
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
    self.layouts = [{**model_layout(self.model, self.optimizer),
                     **self.exchange.checkpoint_entries(strategy)}]
    jit = cfg.train.jit_compile
    # One replica: nothing runs between gradients and update, so XLA compiles both.
    self._train_step = TrainStep(self.model, self.optimizer, loss_fn=self.task.loss,
                                 jit_compile=jit, fuse_update=self.num_replicas == 1,
                                 exchange=self.exchange,
                                 skip_nonfinite=cfg.train.on_nonfinite == "skip")
    self._eval_step = EvalStep(self.model, self.task.eval_outputs, jit_compile=jit)

  @property
  def input_strategy(self):
    return None if self._plain_input else self.strategy

  def _replica_train(self, inputs, targets, compressed):
    replica = 0
    if self.exchange.stateful and len(self._local_devices) > 1:  # Which local replica runs this.
      device = tf.nest.flatten(tf.distribute.get_replica_context().devices)[0]
      replica = self._replica_of_device[plan_lib.device_key(device)]
    return self._train_step(inputs, targets, replica=replica, compressed=compressed)

  def _replica_step(self, inputs, targets, compressed):
    loss, norm = self.strategy.run(self._replica_train, args=(inputs, targets, compressed))
    # The norm is of the all-reduced gradient: the same on every replica.
    return (self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
            self.strategy.experimental_local_results(norm)[0])

  def _replica_eval(self, inputs, targets):
    return self._eval_step(inputs, targets)

  def describe(self) -> dict:
    return {"strategy": type(self.strategy).__name__, "replicas": self.num_replicas,
            "parameters": int(sum(np.prod(v.shape) for v in self.model.trainable_variables))}
