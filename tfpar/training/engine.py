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
from tfpar.config import Config, ConfigError
from tfpar.data import pipeline
from tfpar.parallel.data_parallel import reduce_outputs
from tfpar.training.checkpoint import model_layout
from tfpar.training.optimizer import make_optimizer, inner_optimizer
from tfpar.training.step import EvalStep, TrainStep


def build_model(cfg: Config, tensor_shards: int = 1, task=None):
  """The task's model (default: cfg's) with every weight created now, from the run's seed."""
  task = task or tasks.make(cfg)
  keras.utils.set_random_seed(cfg.train.seed)
  model = task.build_model(tensor_shards=tensor_shards, seed=cfg.train.seed)
  model.build_all()
  return model


def check_batch(global_batch_size: int, num_replicas: int) -> None:
  if global_batch_size % num_replicas:
    raise ConfigError(f"--global_batch_size={global_batch_size} does not split evenly over "
                      f"{num_replicas} replicas: use a multiple of {num_replicas}")


class Engine:
  """What tfpar.training.loop drives; the surface every engine shares.

  A subclass sets `task` (what is trained) and `optimizer` (whose step
  counter is the run's step), builds the model(s), and sets
  `_train_fn(iterator, n) -> (losses[n], grad_norms[n])` and
  `_eval_fn(iterator) -> the global batch's eval outputs` (the task's
  `eval_outputs`, reduced over replicas); it also provides `layouts`,
  `num_replicas`, `train_iterator(start_step)`, `eval_iterator()` and `describe()`.
  """

  optimizer = None
  task = None

  def train(self, iterator, num_steps: int):
    """Runs `num_steps` steps; returns per-step (losses, grad_norms) as numpy."""
    losses, norms = self._train_fn(iterator, tf.constant(num_steps))
    return np.asarray(losses), np.asarray(norms)

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
    check_batch(cfg.train.global_batch_size, self.num_replicas)
    with strategy.scope():
      self.model = build_model(cfg, task=self.task)
      self.optimizer = make_optimizer(cfg.optim, cfg.train.train_steps, cfg.train.precision)
      inner_optimizer(self.optimizer).build(self.model.trainable_variables)
      if self.optimizer is not inner_optimizer(self.optimizer):
        self.optimizer.build(self.model.trainable_variables)
    self.layouts = [model_layout(self.model, self.optimizer)]
    jit = cfg.train.jit_compile
    # One replica: nothing runs between gradients and update, so XLA compiles both.
    self._train_step = TrainStep(self.model, self.optimizer, loss_fn=self.task.loss,
                                 jit_compile=jit, fuse_update=self.num_replicas == 1)
    self._eval_step = EvalStep(self.model, self.task.eval_outputs, jit_compile=jit)
    self._train_fn = tf.function(self._train_steps)
    self._eval_fn = tf.function(self._eval_batch)

  # --- data -------------------------------------------------------------------
  def _dataset(self, split, start_step: int, shuffle: bool):
    g = self.cfg.train.global_batch_size

    def dataset_fn(ctx: tf.distribute.InputContext):
      shard = pipeline.shard_for_pipeline(ctx, g, file_level=self.sharding == "file" and shuffle)
      return self.task.dataset(split, shard, start_step=start_step, shuffle=shuffle)

    return self.strategy.distribute_datasets_from_function(dataset_fn)

  def train_iterator(self, start_step: int):
    return iter(self._dataset(self.data.train, start_step, shuffle=True))

  def eval_iterator(self):
    return iter(self._dataset(self.data.eval, 0, shuffle=False))

  # --- steps ------------------------------------------------------------------
  def _train_steps(self, iterator, num_steps):
    losses = tf.TensorArray(tf.float32, size=num_steps)
    norms = tf.TensorArray(tf.float32, size=num_steps)
    for i in tf.range(num_steps):
      inputs, targets = next(iterator)
      loss, norm = self.strategy.run(self._train_step, args=(inputs, targets))
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
