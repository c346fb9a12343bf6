"""Asynchronous data parallelism with a parameter server: `--strategy=parameter_server`.

What lives where (a job of C=1 chief, W workers, P parameter servers):

  ps i       holds the variables: every weight, every AdamW slot (m, v) and the
             optimizer step, placed round-robin over the P servers; with
             `--ps_shards=S` each variable of rank >= 1 is cut along its first
             axis into up to S shards on different servers (a ShardedVariable),
             so one server need not hold or serve a whole large embedding.
  worker w   holds no state: it runs the closures the chief schedules. One
             closure = one optimizer step: read the current weights from the
             ps tasks, forward + backward on the worker's own batch, send the
             gradients back; the AdamW update runs on the ps that owns each
             variable (`strategy.extended.update` colocates it there).
  chief      the coordinator (`ClusterCoordinator`): builds the model and
             optimizer under `strategy.scope()` (which creates them on the ps
             tasks), traces the step once, schedules steps on whichever worker
             is free, fetches each step's loss, evaluates inline and writes
             checkpoints. It trains nothing itself.

Asynchronous updates and staleness. Workers never wait for each other: each
step applies its own gradient as soon as it is computed. A step that read the
weights at version t (the optimizer step counter) applies its gradient at
version t + tau + 1, where tau is the number of updates the other workers made
in the meantime (its staleness). So the update is

    theta_{t+tau+1} = theta_{t+tau} - lr * AdamW(g(theta_t; batch))

and not g(theta_{t+tau}): with W equally fast workers, tau is about W - 1 on
average. A small, bounded tau acts like noise in the gradient (training still
converges, a little less per step than synchronous training at the same batch);
a large tau (slow or many workers) hurts, which is why lowering the learning
rate or warming up longer helps with many workers. Each closure records the
step counter it read and the one its update produced, so tau is measured, not
guessed: it is in `<model_dir>/ps_steps.jsonl` as `staleness`.

Batches. `--global_batch_size=G` is the batch of ONE update (one worker's step),
so the loss and learning rate mean what they mean under one_device. Worker w
reads its own part of the one data order of tfpar.data.pipeline: its k-th batch
is positions [(k*W + w)*G, (k*W + w + 1)*G), i.e. a `Shard` of W "replicas" of
a G*W batch whose `first_replica` is the worker's index. The index is not known
when the chief traces the dataset function; it comes at run time from
`tf.distribute.coordinator.experimental_get_current_worker_index()`, a value the
coordinator substitutes per worker when the dataset is created there. So the
workers read disjoint windows with nothing sent through the chief. As steps go
to whichever worker is free, the workers need not run equally many steps; a
resumed run restarts every worker at batch `step // W`, so around a resume a few
batches may be read twice or skipped (async training is not step-for-step
reproducible anyway).

Keras 3 and ParameterServerStrategy (keras#18624: no support in `fit`). What we
found, checked on TF 2.21 / Keras 3.15 (details in docs/strategies_ps_tpu.md):
  * A custom loop works: Keras 3 layers and optimizer create their variables
    through `tf.Variable`, so under `strategy.scope()` they land on the ps tasks
    (and become ShardedVariables with a partitioner); the Keras optimizer's
    update goes through `strategy.extended.update`, which runs it on the ps.
  * The hang with servers created inside the coordinator's process is thread
    starvation, not Keras: in-process servers with the default inter-op pool
    (sized by the core count, 2 here) never finished 100 scheduled steps of a
    small Keras model (killed after 90 s); with inter_op_parallelism_threads=3
    (num_workers + 1) the same script ran them in 2 s. TensorFlow's own
    in-process test clusters raise the pool to num_workers + 1 for this reason
    ("The cluster may hang if workers don't have enough inter_op threads",
    b/172296720). We did not trace which ops block. tfpar runs every task in
    its own process, and `serve` still gives each server at least
    num_workers + 1 inter-op threads.
  * Keras 3's `Variable.assign_add` is a read then a write (`assign(self +
    value)`), so the optimizer's step counter loses increments when two
    workers update at once; tfpar makes that one increment atomic (see
    `_make_step_counter_atomic`). Slot and weight updates were already atomic.
  * The whole closure cannot be one XLA cluster: XLA reads a resource
    variable only on the device the cluster runs on, and the variables live on
    the ps tasks. tfpar's TrainStep compiles the forward+backward
    (`jit_compile`) with the variables as inputs read by ordinary ops; see
    the engine for what runs where.

Launch (one machine): `python -m tfpar.launch --num_workers=2 --num_ps=1 --
--strategy=parameter_server --model_dir=...`. On a cluster every task runs
`python -m tfpar.train` with the same flags and its own TF_CONFIG; the ps and
worker tasks serve until the chief is gone, then exit.
"""

import os
import socket
import time
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar import storage
from tfpar.cluster import Cluster, ClusterError
from tfpar.config import Config, DistConfig
from tfpar.data import pipeline
from tfpar.parallel.data_parallel import all_reduce_gradients
from tfpar.training.checkpoint import model_layout
from tfpar.training.metrics import to_json
from tfpar.training.engine import Engine, build_model
from tfpar.training.optimizer import inner_optimizer, make_optimizer
from tfpar.training.step import apply_or_skip, token_loss

# How often, and how many times in a row, a server checks that the chief is
# still there before it exits (the ps and worker servers have no other end).
CHIEF_POLL_SECONDS = 2.0
CHIEF_MISSES_TO_EXIT = 3
# A server that never sees its chief gives up after this long.
CHIEF_WAIT_SECONDS = 600.0


def _check_cluster(cluster: Cluster) -> None:
  spec = cluster.spec
  missing = [job for job in ("chief", "worker", "ps") if not spec.get(job)]
  if missing:
    raise ClusterError(
        f"--strategy=parameter_server needs TF_CONFIG with a chief, workers and ps tasks "
        f"(missing: {', '.join(missing)}): start the job with python -m tfpar.launch "
        "--num_workers=N --num_ps=P -- --strategy=parameter_server ...")
  if len(spec["chief"]) != 1:
    raise ClusterError(f"TF_CONFIG has {len(spec['chief'])} chief tasks: parameter_server "
                       "needs exactly one (the coordinator)")


def make_strategy(dist: DistConfig, cluster: Cluster) -> tf.distribute.Strategy:
  """The ParameterServerStrategy of this job, seen from the chief (coordinator)."""
  _check_cluster(cluster)
  if cluster.task_type != "chief":
    raise ClusterError(f"the {cluster.task_type} task of a parameter_server job serves; only "
                       "the chief builds the strategy")
  partitioner = None
  if dist.ps_shards > 1:
    # Every variable of rank >= 1 is cut in ps_shards along axis 0 (fewer when
    # axis 0 is shorter). A MinSizePartitioner would leave small variables
    # whole; with the fixed count the layout is predictable and tested.
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(dist.ps_shards)
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  return tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)


def _chief_reachable(address: str) -> bool:
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=2.0):
      return True
  except OSError:
    return False


def serve(cluster: Cluster) -> None:
  """Runs this worker or ps task's gRPC server until the chief goes away.

  TensorFlow's servers never return from `join()` and cannot be stopped, so
  instead of joining, the task watches the chief's port and exits (status 0)
  once the chief, seen before, has been unreachable CHIEF_MISSES_TO_EXIT times
  in a row; status 1 if it never appears within CHIEF_WAIT_SECONDS.
  """
  _check_cluster(cluster)
  if cluster.task_type not in ("worker", "ps"):
    raise ClusterError(f"serve() is for worker and ps tasks, not {cluster.task_type!r}")
  config = tf.compat.v1.ConfigProto()
  # TF's default pool has one inter-op thread per core; fewer than
  # num_workers + 1 can hang the cluster (see the module docstring).
  min_threads = len(cluster.spec["worker"]) + 1
  if (os.cpu_count() or 1) < min_threads:
    config.inter_op_parallelism_threads = min_threads
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster.spec), job_name=cluster.task_type,
                                task_index=cluster.task_index, protocol="grpc", config=config,
                                start=True)
  del server  # Lives until the process ends.
  chief = cluster.spec["chief"][0]
  print(f"tfpar: {cluster.task_type} {cluster.task_index} serving; waits for chief {chief}",
        flush=True)
  seen, misses, start = False, 0, time.monotonic()
  while True:
    time.sleep(CHIEF_POLL_SECONDS)
    if _chief_reachable(chief):
      seen, misses = True, 0
    elif seen:
      misses += 1
      if misses >= CHIEF_MISSES_TO_EXIT:
        print(f"tfpar: {cluster.task_type} {cluster.task_index}: chief gone, exiting", flush=True)
        os._exit(0)  # pylint: disable=protected-access  # Servers cannot be stopped otherwise.
    elif time.monotonic() - start > CHIEF_WAIT_SECONDS:
      print(f"tfpar: {cluster.task_type} {cluster.task_index}: chief {chief} never came up in "
            f"{CHIEF_WAIT_SECONDS:.0f}s, exiting", flush=True)
      os._exit(1)  # pylint: disable=protected-access


def _make_step_counter_atomic(optimizer) -> None:
  """Makes the optimizer's `iterations += 1` one atomic op on its ps.

  Keras 3 increments the step counter with `Variable.assign_add`, which it
  implements as `assign(self + 1)`: a read, then a write. Two workers updating
  at once both read t and both write t + 1, so the counter (and the learning
  rate schedule and Adam's bias correction that read it) falls behind the
  updates really applied: we saw 40 scheduled steps leave it at 37. The
  slot and weight updates are not affected (the TF optimizer routes them to
  tf.Variable.assign_add/assign_sub, one AssignAddVariableOp each).
  """
  counter = optimizer.iterations
  counter.assign_add = lambda value: counter.value.assign_add(tf.cast(value, counter.dtype))


def _is_sharded(variable) -> bool:
  """True for a Keras variable (or tf variable) that is cut over several ps tasks."""
  sharded = tf.__internal__.distribute.ShardedVariable
  return isinstance(getattr(variable, "value", variable), sharded)


def _update_sharded_variables_directly(optimizer) -> None:
  """Lets Keras 3's TF optimizer update ShardedVariables (--ps_shards > 1).

  Call before the optimizer is built. Keras routes every update and the
  weight decay through `strategy.extended.update(var, fn)`, which colocates
  `fn` with `var`, and a
  ShardedVariable "doesn't support being used as a reference" (it is several
  variables on several ps tasks). For those variables only, tfpar calls the
  same Keras `update_step` (and decay) directly: the AdamW math then reads the
  slots where they live and each shard's assign_add/assign_sub runs on that
  shard's ps (ShardedVariable slices the delta). Whole variables keep Keras'
  path, where the update runs on their ps.
  """
  # Keras creates each slot colocated with its weight, which for a sharded
  # weight gives one whole slot on one ps. Created without colocation, under
  # the strategy's scope, the partitioner shards the slot like its weight.
  tf_optimizer = next(c for c in type(optimizer).__mro__ if c.__name__ == "TFOptimizer")
  keras_add_slot = optimizer.add_variable_from_reference
  uncolocated_add_slot = super(tf_optimizer, optimizer).add_variable_from_reference

  def add_slot(reference_variable, name=None, initializer="zeros"):
    add = uncolocated_add_slot if _is_sharded(reference_variable) else keras_add_slot
    return add(reference_variable, name=name, initializer=initializer)

  optimizer.add_variable_from_reference = add_slot
  keras_update = optimizer._distributed_tf_update_step  # pylint: disable=protected-access
  keras_decay = optimizer._apply_weight_decay  # pylint: disable=protected-access

  def update(distribution, grads_and_vars, learning_rate):
    keras_update(distribution, [(g, v) for g, v in grads_and_vars if not _is_sharded(v)],
                 learning_rate)
    for grad, var in grads_and_vars:
      if _is_sharded(var):
        optimizer.update_step(grad, var, learning_rate)

  def weight_decay(variables):
    keras_decay([v for v in variables if not _is_sharded(v)])
    if optimizer.weight_decay is None:
      return
    for var in (v.value for v in variables if _is_sharded(v)):
      if optimizer._use_weight_decay(var):  # pylint: disable=protected-access
        lr = tf.cast(optimizer.learning_rate, var.dtype)
        var.assign_sub(tf.convert_to_tensor(var) * tf.cast(optimizer.weight_decay, var.dtype) * lr)

  optimizer._distributed_tf_update_step = update  # pylint: disable=protected-access
  optimizer._apply_weight_decay = weight_decay  # pylint: disable=protected-access


class RemoteVariableTrainStep:
  """tfpar's TrainStep for variables that live on other tasks (the ps).

  The same step as `tfpar.training.step.TrainStep` (token_loss, gradient
  reduction, true norm under loss scaling, AdamW apply), split so that XLA can
  compile it: XLA reads a resource variable only on the device its cluster
  runs on ("Trying to access resource wte/embeddings/0 located in device
  /job:ps/... from device /job:worker/..."), so the weights are first read by
  ordinary ops (which TensorFlow places on the ps and sends over), and the
  compiled part is a pure function of their values through Keras'
  `stateless_call`. The update then runs on the ps, outside XLA.

  Args:
    model, optimizer, global_tokens, jit_compile, skip_nonfinite: as for TrainStep.
  """

  def __init__(self, model, optimizer, *, global_tokens: int, jit_compile: bool,
               skip_nonfinite: bool = False):
    self.model = model
    self.optimizer = optimizer
    self.skip_nonfinite = skip_nonfinite
    self.global_tokens = global_tokens
    self.scaled = hasattr(optimizer, "inner_optimizer")  # mixed_float16 loss scaling
    self._grads = tf.function(self._loss_and_grads, jit_compile=jit_compile)

  def _loss_and_grads(self, trainable, non_trainable, inputs, targets):
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      logits, _ = self.model.stateless_call(trainable, non_trainable, inputs, training=True)
      loss = token_loss(logits, targets, self.global_tokens)
      scaled = self.optimizer.scale_loss(loss) if self.scaled else loss
    return loss, tape.gradient(scaled, trainable)

  def __call__(self, inputs, targets):
    trainable = [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables]
    non_trainable = [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables]
    loss, grads = self._grads(trainable, non_trainable, inputs, targets)
    grads = all_reduce_gradients(grads)  # One replica per worker: the identity.
    grad_norm = tf.linalg.global_norm(grads)
    if self.scaled:  # Report the true norm, not the loss-scaled one.
      grad_norm = grad_norm / tf.cast(self.optimizer.scale_loss(1.0), grad_norm.dtype)
    apply_or_skip(self.optimizer, grads, self.model.trainable_variables, grad_norm,
                  skip_nonfinite=self.skip_nonfinite)
    return loss, grad_norm


class ParameterServerEngine(Engine):
  """The coordinator's engine: schedules asynchronous steps on the workers.

  Same surface as `DataParallelEngine` (what tfpar.training.loop drives).

  Args:
    cfg: the run's config.
    strategy: a ParameterServerStrategy (from `make_strategy`).
    corpus: the token streams (every worker reads its own part of them).
  """

  def __init__(self, cfg: Config, strategy, corpus: pipeline.Corpus):
    self.cfg = cfg
    self.strategy = strategy
    self.corpus = corpus
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    self.num_workers = strategy.extended._num_workers  # pylint: disable=protected-access
    self.num_ps = strategy.extended._num_ps  # pylint: disable=protected-access
    # Replicas training at once (each on its own, asynchronously).
    self.num_replicas = self.num_workers
    self.global_tokens = cfg.train.global_batch_size * cfg.model.seq_len
    with strategy.scope():
      self.model = build_model(cfg)
      self.optimizer = make_optimizer(cfg.optim, cfg.train.train_steps, cfg.train.precision)
      _make_step_counter_atomic(inner_optimizer(self.optimizer))
      _update_sharded_variables_directly(inner_optimizer(self.optimizer))
      inner_optimizer(self.optimizer).build(self.model.trainable_variables)
      if self.optimizer is not inner_optimizer(self.optimizer):
        self.optimizer.build(self.model.trainable_variables)
    self.layouts = [model_layout(self.model, self.optimizer)]
    jit = cfg.train.jit_compile
    self._train_step = RemoteVariableTrainStep(
        self.model, self.optimizer, global_tokens=self.global_tokens, jit_compile=jit,
        skip_nonfinite=cfg.train.on_nonfinite == "skip")
    self._eval_loss = tf.function(self._stateless_eval_loss, jit_compile=jit)
    self._worker_fn = tf.function(self._worker_step)
    self._eval_fn = tf.function(self._eval_steps)
    self.records: List[Dict] = []
    self._records_path = os.path.join(cfg.train.model_dir, "ps_steps.jsonl")

  # --- data -------------------------------------------------------------------
  def train_iterator(self, start_step: int):
    """Per-worker iterators: worker w reads batches w, W + w, 2W + w, ... of the data order."""
    g, w, seq_len, seed = (self.cfg.train.global_batch_size, self.num_workers,
                           self.cfg.model.seq_len, self.cfg.train.seed)
    tokens = self.corpus.train

    def dataset_fn(_):
      worker = tf.distribute.coordinator.experimental_get_current_worker_index()  # int64 []
      # W "replicas" of a G*W batch, this worker being replica `worker`.
      shard = pipeline.Shard(g * w, w, worker, 1)
      return pipeline.window_dataset(tokens, seq_len, shard, seed=seed,
                                     start_step=start_step // w, shuffle=True)

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    return iter(self.coordinator.create_per_worker_dataset(per_worker_dataset_fn))

  def eval_iterator(self):
    """The held-out batches, read on the chief (evaluation runs there, inline)."""
    shard = pipeline.Shard(self.cfg.train.global_batch_size)
    return iter(pipeline.window_dataset(self.corpus.eval, self.cfg.model.seq_len, shard,
                                        seed=self.cfg.train.seed, shuffle=False))

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
    self.coordinator.join()  # Raises the first error a closure raised.
    results = [{k: np.asarray(v).item() for k, v in f.fetch().items()} for f in futures]
    new = []
    for r in results:
      r["worker"] = int(r["worker"])
      r["step"] = int(r["write_version"])
      r["staleness"] = int(r["write_version"] - r["read_version"] - 1)
      new.append(r)
    self.records.extend(new)
    self._write_records(new)
    return (np.array([r["loss"] for r in results], np.float32),
            np.array([r["grad_norm"] for r in results], np.float32))

  def _write_records(self, records):
    storage.makedirs(os.path.dirname(self._records_path) or ".")
    storage.append_lines(self._records_path, [to_json(r) + "\n" for r in records])

  def _stateless_eval_loss(self, trainable, non_trainable, inputs, targets):
    logits, _ = self.model.stateless_call(trainable, non_trainable, inputs, training=False)
    return token_loss(logits, targets, self.global_tokens)

  def _eval_steps(self, iterator, num_steps):
    # The weights are read from the ps once, then used as plain tensors (as
    # in training: no ShardedVariable reaches the layers' code).
    trainable = [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables]
    non_trainable = [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables]
    total = tf.constant(0.0)
    for _ in tf.range(num_steps):
      inputs, targets = next(iterator)
      total += self._eval_loss(trainable, non_trainable, inputs, targets)
    return total / tf.cast(num_steps, tf.float32)

  def evaluate(self, iterator, num_steps: int) -> float:
    """Held-out loss, computed on the chief from the current ps weights (inline)."""
    self.coordinator.join()
    return super().evaluate(iterator, num_steps)

  def describe(self) -> dict:
    return {"strategy": "ParameterServerStrategy (async)", "replicas": self.num_replicas,
            "workers": self.num_workers, "ps": self.num_ps, "ps_shards": self.cfg.dist.ps_shards,
            "sharded_variables": sum(_is_sharded(v) for v in self.model.variables),
            "sharded_slots": sum(_is_sharded(v) for v in inner_optimizer(self.optimizer).variables),
            "parameters": int(sum(np.prod(v.shape) for v in self.model.trainable_variables))}
