"""The coordinator's engine: asynchronous steps scheduled on the workers.

What lives where, staleness and batches: tfpar.engines.parameter_server.
"""

import time
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar.config.cluster import PeerError
from tfpar.config.schema import Config
from tfpar.data import pipeline
from tfpar.engines.base import Engine, build_model
from tfpar.engines.parameter_server.step import RemoteVariableTrainStep
from tfpar.engines.parameter_server.step_log import StepLog
from tfpar.engines.parameter_server import keras_patches
from tfpar.parallel.servers import reachable
from tfpar.training.checkpoint import model_layout
from tfpar.training.optimizer import inner_optimizer


class ParameterServerEngine(Engine):
  """The coordinator's engine: schedules asynchronous steps on the workers.

  The engine core's surface (tfpar.engines.base), with its own input (one
  per-worker dataset), train (scheduled, not a step loop) and eval (inline,
  on the chief).

  Args:
    cfg: the run's config.
    strategy: a ParameterServerStrategy (from `make_strategy`).
    data: the task's data (every worker reads its own part of `data.train`).
    task: what is trained (default: the task cfg names).
  """

  def __init__(self, cfg: Config, strategy, data, *, sharding: str = "data", task=None):
    del sharding  # Every worker reads its own window of the one data order.
    super().__init__(cfg, data, task=task)
    self.strategy = strategy
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    self.num_workers = strategy.extended._num_workers  # pylint: disable=protected-access
    self.num_ps = strategy.extended._num_ps  # pylint: disable=protected-access
    # Replicas training at once (each on its own, asynchronously).
    self.num_replicas = self.num_workers
    with strategy.scope():
      self.model = build_model(cfg, task=self.task)
      self.optimizer = self.build_optimizer(self.model.trainable_variables,
                                            prepare=_patch_for_ps)
    self.layouts = [model_layout(self.model, self.optimizer)]
    jit = cfg.train.jit_compile
    self._train_step = RemoteVariableTrainStep(
        self.model, self.optimizer, loss_fn=self.task.loss, jit_compile=jit,
        skip_nonfinite=cfg.train.on_nonfinite == "skip")
    self._eval_outputs = tf.function(self._stateless_eval_outputs, jit_compile=jit)
    self._worker_fn = tf.function(self._worker_step)
    self.records: List[Dict] = []
    self._step_log = StepLog(cfg.train.model_dir)

  # --- data -------------------------------------------------------------------
  def train_iterator(self, start_step: int):
    """Per-worker iterators: worker w reads batches w, W + w, 2W + w, ... of the data order."""
    g, w, task = self.cfg.train.global_batch_size, self.num_workers, self.task
    split = self.data.train

    def dataset_fn(_):
      worker = tf.distribute.coordinator.experimental_get_current_worker_index()  # int64 []
      # W "replicas" of a G*W batch, this worker being replica `worker`.
      shard = pipeline.Shard(g * w, w, worker, 1)
      return task.dataset(split, shard, start_step=start_step // w, shuffle=True)

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    return iter(self.coordinator.create_per_worker_dataset(per_worker_dataset_fn))

  def eval_iterator(self):
    """The held-out batches, read on the chief (evaluation runs there, inline)."""
    shard = pipeline.Shard(self.cfg.train.global_batch_size)
    return iter(self.task.dataset(self.data.eval, shard, shuffle=False))

  # --- steps ------------------------------------------------------------------
  def _worker_step(self, iterator):
    """One asynchronous step on whichever worker runs it (scheduled by the chief)."""
    iterations = inner_optimizer(self.optimizer).iterations
    inputs, targets = next(iterator)
    start_time = tf.timestamp()
    with tf.control_dependencies([start_time]):
      read_version = tf.identity(iterations)  # The version the weights are read at.
    with tf.control_dependencies([read_version]):
      loss, norm = self.strategy.run(self._train_step, args=(inputs, targets))
    with tf.control_dependencies([loss, norm]):
      # Ordered after this step's update: both touch the counter's resource.
      write_version = tf.identity(iterations)
    with tf.control_dependencies([write_version]):
      end_time = tf.timestamp()
    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
    return {"loss": loss, "grad_norm": norm, "worker": worker, "read_version": read_version,
            "write_version": write_version, "start_time": start_time, "end_time": end_time}

  def train(self, iterator, num_steps: int):
    """Schedules `num_steps` steps on the workers; returns per-step (losses, grad_norms).

    Steps run in the order workers pick them up; the arrays are in scheduling
    order. Each step's worker, versions and times go to `self.records`.
    """
    futures = [self.coordinator.schedule(self._worker_fn, args=(iterator,))
               for _ in range(num_steps)]
    self._join(futures)
    results = [{k: np.asarray(v).item() for k, v in f.fetch().items()} for f in futures]
    new = []
    for r in results:
      r["worker"] = int(r["worker"])
      r["step"] = int(r["write_version"])
      r["staleness"] = int(r["write_version"] - r["read_version"] - 1)
      new.append(r)
    self.records.extend(new)
    self._step_log.write(new)
    return (np.array([r["loss"] for r in results], np.float32),
            np.array([r["grad_norm"] for r in results], np.float32))

  def _join(self, futures) -> None:
    """`coordinator.join()`, bounded: fails if no step finishes for --collective_timeout s.

    The coordinator waits for a lost worker to come back (up to an hour) and
    runs its steps elsewhere meanwhile; with every worker lost it would wait
    that long. Raises the first error a step raised.
    """
    timeout = self.cfg.dist.collective_timeout
    # RemoteValue's status is not public; NOT_READY until the step ends.
    ready = lambda f: getattr(getattr(f, "_status", None), "name", "READY") != "NOT_READY"
    finished, since = -1, time.monotonic()
    while not self.coordinator.done():  # done() raises a step's error, as join() would.
      now_finished = sum(ready(f) for f in futures)
      if now_finished != finished:
        finished, since = now_finished, time.monotonic()
      elif timeout and time.monotonic() - since > timeout:
        workers = self.strategy.cluster_resolver.cluster_spec().as_dict()["worker"]
        down = [f"worker {i} ({a})" for i, a in enumerate(workers) if not reachable(a)]
        raise PeerError(
            f"no parameter-server step finished in --collective_timeout={timeout} s "
            f"({finished} of {len(futures)} done); unreachable: {', '.join(down) or 'none'}")
      time.sleep(0.05)
    self.coordinator.join()

  def _stateless_eval_outputs(self, trainable, non_trainable, inputs, targets):
    outputs, _ = self.model.stateless_call(trainable, non_trainable, inputs, training=False)
    return self.task.eval_outputs(outputs, targets)

  def _eval_batch(self, iterator):
    # The weights are read from the ps, then used as plain tensors (as in
    # training: no ShardedVariable reaches the layers' code).
    trainable = [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables]
    non_trainable = [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables]
    inputs, targets = next(iterator)
    return self._eval_outputs(trainable, non_trainable, inputs, targets)

  def eval_metrics(self, iterator, num_steps: int):
    """Held-out metrics, computed on the chief from the current ps weights (inline)."""
    self.coordinator.join()
    return super().eval_metrics(iterator, num_steps)

  def describe(self) -> dict:
    return {"strategy": "ParameterServerStrategy (async)", "replicas": self.num_replicas,
            "workers": self.num_workers, "ps": self.num_ps, "ps_shards": self.cfg.dist.ps_shards,
            "sharded_variables": sum(keras_patches.is_sharded(v) for v in self.model.variables),
            "sharded_slots": sum(keras_patches.is_sharded(v) for v in inner_optimizer(self.optimizer).variables),
            "parameters": int(sum(np.prod(v.shape) for v in self.model.trainable_variables))}


def _patch_for_ps(optimizer) -> None:
  """What Keras 3's optimizer needs to update ps-resident variables (before it builds)."""
  keras_patches.make_step_counter_atomic(optimizer)
  keras_patches.update_sharded_variables_directly(optimizer)
