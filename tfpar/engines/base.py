"""The engine core: what every engine shares, and the one place each piece is written.

An engine is what tfpar.training.loop drives: it owns a task's model(s), the
optimizer (whose step counter is the run's step), the input and the compiled
steps. Three engines differ only in how a replica computes its gradients and
where the variables live:

  DataParallelEngine   (tfpar.engines.data_parallel) one model under a
                       tf.distribute strategy's scope (one_device, mirrored,
                       multi_worker_mirrored, tpu), a TrainStep per replica;
  ModelParallelEngine  (tfpar.engines.model_parallel) one model copy per
                       data-parallel replica, placed over its plan row by
                       tf.device, a pipeline schedule per copy;
  ParameterServerEngine (tfpar.engines.parameter_server) one model on the ps
                       tasks, asynchronous steps scheduled on the workers.

This base owns the rest: the task (the one fallback to the task cfg names),
the optimizer build, the input (each input pipeline reads its Shard of the
global batch: tfpar.data.pipeline), the step loop (`steps_per_call` steps in
one tf.function call, each replica's loss SUMMED: every share is already
divided by the global count, so the sum is the global mean), the warmup and
compressed phases of the gradient exchange (tfpar.parallel.exchange), eval and
the run's step. tfpar.engines.make chooses the engine for a config.

Engines import no model, loss or reader: the task brings them.
"""

from typing import Dict, List

import keras
import numpy as np
import tensorflow as tf

from tfpar import tasks
from tfpar.config.schema import Config
from tfpar.data import pipeline
from tfpar.parallel.collectives import reduce_outputs
from tfpar.parallel.traffic import NONE, Traffic
from tfpar.training import initialise
from tfpar.training.checkpoint import (CanonicalCheckpointer, CheckpointMismatchError,
                                       layout_slices, model_layout)
from tfpar.training.optimizer import inner_optimizer, make_optimizer


def build_model(cfg: Config, tensor_shards: int = 1, task=None, initialised: bool = True):
  """The task's model (default: cfg's) with every weight created now, from the run's seed.

  `initialised=False` leaves the weights as their initializers made them (inside a
  keras.StatelessScope: without storage, for tfpar.parallel.zero3's template, which makes
  each shard's values itself).
  """
  task = task or tasks.make(cfg)
  keras.utils.set_random_seed(cfg.train.seed)
  with initialise.recording() as initializers:
    model = task.build_model(tensor_shards=tensor_shards, seed=cfg.train.seed)
    model.build_all()
  if initialised:  # The values every plan starts from (tfpar.training.initialise).
    initialise.initialise(layout_slices(model_layout(model)), cfg.train.seed, initializers)
  return model


class Engine:
  """What tfpar.training.loop drives; the surface and the core every engine shares.

  A subclass builds the model(s) and sets `optimizer` (`build_optimizer`),
  `layouts` (one canonical checkpoint layout per model copy in this process),
  `num_replicas`, `exchange` (the gradient exchange, or None), `strategy`
  (the data-parallel strategy the replicas run under; None: one replica,
  called directly) and, if the input differs from it, `input_strategy` (the
  strategy whose replicas the input feeds; None: one plain tf.data pipeline),
  and implements

    _replica_step(inputs, targets, compressed) -> (global loss, gradient norm)
        one optimizer step over the data-parallel replicas (in the step loop's
        tf.function, cross-replica context);
    _replica_eval(inputs, targets) -> this replica's eval outputs;
    describe() -> what the run's first line says about the engine;
    bytes_report() -> a line on the bytes a replica holds, or "" (the default);
    write_files(model_dir) -> what the engine writes beside config.json (the chief's);
    memory_devices() and predicted_memory() -> this process's compute devices and what
        each is predicted to hold, for the allocator peak the loop measures
        (tfpar.training.memory; the default: none, nothing measured).

  Args:
    cfg: the run's config.
    data: what this worker reads (the task's `load_data`: `.train`, `.eval`).
    sharding: 'data' (every worker reads its slice of each global batch) or
      'file' (each worker reads the batches of its own files).
    task: what is trained (default: the task cfg names).
  """

  optimizer = None
  exchange = None
  strategy = None

  @property
  def input_strategy(self):
    return self.strategy

  def __init__(self, cfg: Config, data, *, sharding: str = "data", task=None):
    self.cfg = cfg
    self.task = task or tasks.make(cfg)
    self.data = data
    self.sharding = sharding
    self._train_fn = tf.function(self._train_steps)
    self._eval_fn = tf.function(self._eval_batch)

  def checkpointer(self, directory: str, **kwargs) -> CanonicalCheckpointer:
    """The CanonicalCheckpointer of this engine's state (kwargs: is_chief, worker_index,
    keep, background, log)."""
    return CanonicalCheckpointer(self.layouts, directory, **kwargs)

  def build_optimizer(self, variables, prepare=None, slots: bool = True):
    """The run's AdamW (inside a LossScaleOptimizer under mixed_float16), built for `variables`.

    Its slots are created colocated with their variables (or, under a
    strategy's scope, where the strategy puts them). `prepare(inner)` runs
    before the build (the parameter-server engine's patches). `slots=False`
    builds none (its step counter, schedule and decay set only: the sharded
    update of tfpar.parallel.zero keeps the slots).
    """
    optimizer = make_optimizer(self.cfg.optim, self.cfg.train.train_steps,
                               self.cfg.train.precision)
    inner = inner_optimizer(optimizer)
    if prepare is not None:
      prepare(inner)
    if not slots:
      return optimizer
    inner.build(variables)
    if optimizer is not inner:
      optimizer.build(variables)
    return optimizer

  # --- data -------------------------------------------------------------------
  def _dataset(self, split, start_step: int, shuffle: bool):
    """The task's batches for each input pipeline of `input_strategy` (one without it)."""
    g = self.cfg.train.global_batch_size

    def dataset_fn(ctx: tf.distribute.InputContext):
      shard = pipeline.shard_for_pipeline(ctx, g, file_level=self.sharding == "file" and shuffle)
      return self.task.dataset(split, shard, start_step=start_step, shuffle=shuffle)

    if self.input_strategy is None:
      return dataset_fn(tf.distribute.InputContext())
    return self.input_strategy.distribute_datasets_from_function(dataset_fn)

  def train_iterator(self, start_step: int):
    return iter(self._dataset(self.data.train, start_step, shuffle=True))

  def eval_iterator(self):
    return iter(self._dataset(self.data.eval, 0, shuffle=False))

  # --- steps ------------------------------------------------------------------
  def _train_steps(self, iterator, num_steps, compressed=False):
    """`num_steps` optimizer steps in one call: (losses[n], grad_norms[n])."""
    losses = tf.TensorArray(tf.float32, size=num_steps)
    norms = tf.TensorArray(tf.float32, size=num_steps)
    for i in tf.range(num_steps):
      inputs, targets = next(iterator)
      loss, norm = self._replica_step(inputs, targets, compressed)
      losses = losses.write(i, loss)
      norms = norms.write(i, norm)
    return losses.stack(), norms.stack()

  def _replica_step(self, inputs, targets, compressed):
    raise NotImplementedError

  def bytes_report(self) -> str:
    return ""

  def write_files(self, model_dir: str) -> None:
    del model_dir

  def memory_devices(self) -> List[str]:
    return []

  def predicted_memory(self) -> Dict[str, Dict[str, int]]:
    return {}

  def _replica_eval(self, inputs, targets):
    raise NotImplementedError

  def _eval_batch(self, iterator):
    """The global batch's eval outputs: every replica's, combined (tfpar.parallel.collectives)."""
    inputs, targets = next(iterator)
    strategy = self.strategy
    if strategy is None:
      return self._replica_eval(inputs, targets)
    return reduce_outputs(strategy, strategy.run(self._replica_eval, args=(inputs, targets)))

  def train(self, iterator, num_steps: int):
    """Runs `num_steps` steps; returns per-step (losses, grad_norms) as numpy.

    Warmup steps (uncompressed) and compressed steps run as separate calls:
    the choice is made when tracing, not by a tf.cond around collectives.
    """
    phases = (self.exchange.phases(self.step, num_steps) if self.exchange is not None
              else [(num_steps, False)])
    losses, norms = [], []
    for n, compressed in phases:
      l, g = self._train_fn(iterator, tf.constant(n), compressed)
      losses.append(np.asarray(l))
      norms.append(np.asarray(g))
    return np.concatenate(losses), np.concatenate(norms)

  def traffic(self, step: int) -> Traffic:
    """Bytes one replica handed to the collectives in step `step` (1-based; once it ran)."""
    return NONE if self.exchange is None else self.exchange.step_traffic(step)

  def eval_metrics(self, iterator, num_steps: int) -> Dict[str, float]:
    """The task's held-out metrics over `num_steps` global batches (always a "loss")."""
    batches = [{k: np.asarray(v) for k, v in self._eval_fn(iterator).items()}
               for _ in range(num_steps)]
    return self.task.eval_metrics(batches)

  def evaluate(self, iterator, num_steps: int) -> float:
    """Mean held-out loss over `num_steps` global batches."""
    return self.eval_metrics(iterator, num_steps)["loss"]

  # --- state ------------------------------------------------------------------
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
    strategy = self.strategy
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
