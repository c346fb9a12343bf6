"""The data-parallel engine: model, optimizer, data and compiled steps under one strategy.

An engine is what the loop drives. This one serves the strategies that own
the variables (one_device, mirrored, multi_worker_mirrored, tpu): the model
and optimizer are built under `strategy.scope()`, each replica runs
`TrainStep` under `strategy.run`, and `steps_per_call` steps run inside one
`tf.function` call. Model-parallel plans have their own engine in
tfpar.parallel.hybrid, with the same surface.

What is trained (model, loss, data, metrics) comes from a task
(tfpar.tasks.task.Task); an engine only runs it.
"""

from typing import Dict

import keras
import numpy as np
import tensorflow as tf

from tfpar import tasks
from tfpar.config import Config, check_batch
from tfpar.data import pipeline
from tfpar.parallel import plan as plan_lib
from tfpar.parallel.compression import GradientReducer, Traffic
from tfpar.parallel.data_parallel import reduce_outputs
from tfpar.training.checkpoint import CheckpointMismatchError, model_layout
from tfpar.training.optimizer import make_optimizer, inner_optimizer
from tfpar.training.step import EvalStep, TrainStep


def build_model(cfg: Config, tensor_shards: int = 1, task=None):
  """The task's model (default: cfg's) with every weight created now, from the run's seed."""
  task = task or tasks.make(cfg)
  keras.utils.set_random_seed(cfg.train.seed)
  model = task.build_model(tensor_shards=tensor_shards, seed=cfg.train.seed)
  model.build_all()
  return model


class Engine:
  """What tfpar.training.loop drives; the surface every engine shares.

  A subclass sets `task` (what is trained) and `optimizer` (whose step
  counter is the run's step), builds the model(s), and sets
  `_train_fn(iterator, n) -> (losses[n], grad_norms[n])` and
  `_eval_fn(iterator) -> the global batch's eval outputs` (the task's
  `eval_outputs`, reduced over replicas); it also provides `layouts`,
  `num_replicas`, `train_iterator(start_step)`, `eval_iterator()` and `describe()`.
  `_train_fn` takes a third argument, `compressed` (a Python bool: one trace
  each), when the engine has a `reducer` (tfpar.parallel.compression).
  """

  optimizer = None
  task = None
  reducer = None

  def train(self, iterator, num_steps: int):
    """Runs `num_steps` steps; returns per-step (losses, grad_norms) as numpy.

    Warmup steps (uncompressed) and compressed steps run as separate calls:
    the choice is made when tracing, not by a tf.cond around collectives.
    """
    if self.reducer is None:
      losses, norms = self._train_fn(iterator, tf.constant(num_steps))
      return np.asarray(losses), np.asarray(norms)
    losses, norms = [], []
    for n, compressed in self.reducer.phases(self.step, num_steps):
      l, g = self._train_fn(iterator, tf.constant(n), compressed)
      losses.append(np.asarray(l))
      norms.append(np.asarray(g))
    return np.concatenate(losses), np.concatenate(norms)

  def traffic(self, step: int) -> Traffic:
    """Bytes one replica handed to the collectives in step `step` (1-based; once it ran)."""
    if self.reducer is None:
      return Traffic(0, 0)
    return self.reducer.traffic.get(self.reducer.compresses_at(step - 1), Traffic(0, 0))

  def eval_metrics(self, iterator, num_steps: int) -> Dict[str, float]:
    """The task's held-out metrics over `num_steps` global batches (always a "loss")."""
    batches = [{k: np.asarray(v) for k, v in self._eval_fn(iterator).items()}
               for _ in range(num_steps)]
    return self.task.eval_metrics(batches)

  def evaluate(self, iterator, num_steps: int) -> float:
    """Mean held-out loss over `num_steps` global batches."""
    return self.eval_metrics(iterator, num_steps)["loss"]

  @property
  def step(self) -> int:
    return int(inner_optimizer(self.optimizer).iterations.numpy())

  def learning_rate(self) -> float:
    return float(np.asarray(inner_optimizer(self.optimizer).learning_rate))

  def check_same_step(self, step: int) -> None:
    """Across workers: raises unless every worker restored the same step.

    Workers read the checkpoint directory each for itself; one that saw
    another file (a shared volume lagging, a checkpoint unreadable on one
    host only) would train from other weights and data positions.
    """
    strategy = getattr(self, "strategy", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
      return
    mine = tf.constant([step], tf.int64)

    @tf.function  # Eager collectives under MultiWorkerMirroredStrategy warn and run slowly.
    def gather():
      return strategy.gather(strategy.run(lambda: tf.identity(mine)), axis=0)

    steps = gather().numpy().tolist()
    if len(set(steps)) > 1:
      raise CheckpointMismatchError(
          f"workers restored different steps ({steps}; this worker {step}): every worker "
          "must see the same --model_dir (a shared volume or bucket)")


class DataParallelEngine(Engine):
  """One model replicated by a tf.distribute strategy.

  Args:
    cfg: the run's config.
    strategy: the tf.distribute strategy.
    data: what this worker reads (the task's `load_data`: `.train`, `.eval`).
    sharding: 'data' (every worker reads its slice of each global batch) or
      'file' (each worker reads the batches of its own files).
    task: what is trained (default: the task cfg names).
  """

  def __init__(self, cfg: Config, strategy, data, *, sharding: str = "data", task=None):
    self.cfg = cfg
    self.task = task or tasks.make(cfg)
    self.strategy = strategy
    self.data = data
    self.sharding = sharding
    self.num_replicas = strategy.num_replicas_in_sync
    # config checked this for CPU hosts; GPUs and TPU cores are counted only now.
    check_batch(cfg.train.global_batch_size, self.num_replicas)
    with strategy.scope():
      self.model = build_model(cfg, task=self.task)
      self.optimizer = make_optimizer(cfg.optim, cfg.train.train_steps, cfg.train.precision)
      inner_optimizer(self.optimizer).build(self.model.trainable_variables)
      if self.optimizer is not inner_optimizer(self.optimizer):
        self.optimizer.build(self.model.trainable_variables)
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
    self.reducer = GradientReducer(cfg.compression, variables, num_replicas=self.num_replicas,
                                state_devices=[[d] * len(variables) for d in self._local_devices],
                                seed=cfg.train.seed)
    self.layouts = [{**model_layout(self.model, self.optimizer),
                     **self.reducer.checkpoint_entries(strategy)}]
    jit = cfg.train.jit_compile
    # One replica: nothing runs between gradients and update, so XLA compiles both.
    self._train_step = TrainStep(self.model, self.optimizer, loss_fn=self.task.loss,
                                 jit_compile=jit, fuse_update=self.num_replicas == 1,
                                 reducer=self.reducer,
                                 skip_nonfinite=cfg.train.on_nonfinite == "skip")
    self._eval_step = EvalStep(self.model, self.task.eval_outputs, jit_compile=jit)
    self._train_fn = tf.function(self._train_steps)
    self._eval_fn = tf.function(self._eval_batch)

  # --- data -------------------------------------------------------------------
  def _dataset(self, split, start_step: int, shuffle: bool):
    g = self.cfg.train.global_batch_size

    def dataset_fn(ctx: tf.distribute.InputContext):
      shard = pipeline.shard_for_pipeline(ctx, g, file_level=self.sharding == "file" and shuffle)
      return self.task.dataset(split, shard, start_step=start_step, shuffle=shuffle)

    if self._plain_input:
      return dataset_fn(tf.distribute.InputContext())
    return self.strategy.distribute_datasets_from_function(dataset_fn)

  def train_iterator(self, start_step: int):
    return iter(self._dataset(self.data.train, start_step, shuffle=True))

  def eval_iterator(self):
    return iter(self._dataset(self.data.eval, 0, shuffle=False))

  # --- steps ------------------------------------------------------------------
  def _replica_train(self, inputs, targets, compressed):
    replica = 0
    if self.reducer.stateful and len(self._local_devices) > 1:  # Which local replica runs this.
      device = tf.nest.flatten(tf.distribute.get_replica_context().devices)[0]
      replica = self._replica_of_device[plan_lib.device_key(device)]
    return self._train_step(inputs, targets, replica=replica, compressed=compressed)

  def _train_steps(self, iterator, num_steps, compressed=False):
    losses = tf.TensorArray(tf.float32, size=num_steps)
    norms = tf.TensorArray(tf.float32, size=num_steps)
    for i in tf.range(num_steps):
      inputs, targets = next(iterator)
      loss, norm = self.strategy.run(self._replica_train, args=(inputs, targets, compressed))
      losses = losses.write(i, self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None))
      # The norm is of the all-reduced gradient: the same on every replica.
      norms = norms.write(i, self.strategy.experimental_local_results(norm)[0])
    return losses.stack(), norms.stack()

  def _eval_batch(self, iterator):
    inputs, targets = next(iterator)
    return reduce_outputs(self.strategy, self.strategy.run(self._eval_step, args=(inputs, targets)))

  def describe(self) -> dict:
    return {"strategy": type(self.strategy).__name__, "replicas": self.num_replicas,
            "parameters": int(sum(np.prod(v.shape) for v in self.model.trainable_variables))}
