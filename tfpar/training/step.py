"""The replica step: loss, gradients, reduction, update. Apart from the loop.

`TrainStep` is the function each replica runs under `strategy.run`. The loss
is the task's (tfpar.tasks.task.Task.loss), already divided by the GLOBAL
batch's count of labelled units: the task module says why, in one place. The
tail of every engine's step (reduce the gradients over the data-parallel
replicas, clip, apply) is `reduce_gradients` + `apply_gradients` here, and
only here: TrainStep, the hybrid engine's replicas and the parameter-server
step call them. The reduction itself is the engine's gradient exchange
(tfpar.parallel.exchange), handed in: this module imports no loss, model or
collective.
"""

from typing import List

import tensorflow as tf

from tfpar.training.optimizer import inner_optimizer


def reduce_gradients(exchange, grads, *, replica: int = 0,
                     compressed: bool = True, densify: bool = True) -> List[tf.Tensor]:
  """This replica's gradients -> their sum over the replicas, through `exchange`.

  `exchange` is a tfpar.parallel.exchange.GradientExchange, or None for a
  step with one replica in sync (nothing to exchange: the identity).

  An embedding lookup's gradient comes as IndexedSlices. Made dense before
  the all-reduce, the reduction sums it (rather than concatenating the
  replicas' slices) and the clipping norm is that of the summed gradient.
  `densify=False` keeps them sparse, for a single replica only (the
  parameter-server step, whose ps then updates only the rows looked up).
  """
  if densify:
    grads = [tf.convert_to_tensor(g) for g in grads]
  elif exchange is not None and exchange.num_replicas > 1:
    raise ValueError("sparse gradients cannot be all-reduced: pass densify=True")
  if exchange is None:
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
      raise ValueError(f"{ctx.num_replicas_in_sync} replicas in sync and no gradient exchange: "
                       "pass the engine's (tfpar.parallel.exchange)")
    return list(grads)
  return exchange.reduce(list(grads), replica=replica, compressed=compressed)


def apply_gradients(optimizer, grads, variables, *, skip_nonfinite: bool = False) -> tf.Tensor:
  """Clips (by global norm, inside AdamW) and applies reduced gradients; returns their norm.

  Clipping happens after the reduction, on the summed gradient: clipping each
  replica's share would be wrong. Under mixed_float16 the gradients are still
  loss-scaled here (the LossScaleOptimizer unscales them in `apply`); the
  reported norm is the true one. With `skip_nonfinite` (--on_nonfinite=skip)
  a step whose norm is NaN or infinite changes nothing (see `apply_or_skip`).
  """
  grad_norm = tf.linalg.global_norm(grads)
  if hasattr(optimizer, "inner_optimizer"):
    grad_norm = grad_norm / tf.cast(optimizer.scale_loss(1.0), grad_norm.dtype)
  apply_or_skip(optimizer, grads, variables, grad_norm, skip_nonfinite=skip_nonfinite)
  return grad_norm


def apply_or_skip(optimizer, grads, variables, grad_norm, *, skip_nonfinite: bool,
                  in_order: bool = False, scale=None):
  """Applies the reduced gradients; with `skip_nonfinite`, only if their norm is finite.

  `in_order`: the update runs one weight at a time, each gradient multiplied by
  `scale` (a clip factor, or None) inside its own weight's update
  (tfpar.training.optimizer.AdamW.in_order): a step then holds one weight's
  scaled gradient and AdamW temporaries at a time, not a copy of them all.

  A skipped step changes no weight and no AdamW slot, but counts: the step
  counter still advances, so the learning rate schedule and the data position
  (both functions of the step) stay where an applied step would leave them.
  The norm is of the all-reduced gradient, the same number on every replica,
  so every replica takes the same branch. Under mixed_float16 the
  LossScaleOptimizer already skips non-finite gradients (and lowers its scale).

  Under MirroredStrategy the update's merge_call cannot sit inside a tf.cond
  in replica context; as Keras' LossScaleOptimizer does, the cond then runs in
  cross-replica context and calls the update for each replica.
  """
  if in_order:
    with inner_optimizer(optimizer).in_order(scale):
      apply_or_skip(optimizer, grads, variables, grad_norm, skip_nonfinite=skip_nonfinite)
    return
  if scale is not None:
    raise ValueError("apply_or_skip: `scale` is applied inside an in_order update only")
  if not skip_nonfinite or hasattr(optimizer, "inner_optimizer"):
    optimizer.apply(grads, variables)
    return

  def skip():
    inner_optimizer(optimizer).iterations.assign_add(1)

  def apply():
    optimizer.apply(grads, variables)

  finite = tf.math.is_finite(grad_norm)
  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    tf.cond(finite, apply, skip)
    return

  def cross_replica(distribution, finite):
    first = distribution.experimental_local_results(finite)[0]
    tf.cond(first, lambda: distribution.extended.call_for_each_replica(apply), skip)

  tf.distribute.get_replica_context().merge_call(cross_replica, args=(finite,))


class TrainStep:
  """One optimizer step on one replica's batch: gradients, all-reduce, update.

  With one replica in sync the all-reduce is the identity, so nothing has to
  happen between the backward pass and the update: `fuse_update=True` then
  compiles the whole step (forward, backward, clipping, AdamW) as one XLA
  program, as Keras `model.fit` does, and the update's few hundred small
  per-variable ops fuse instead of running one by one. With several replicas
  the all-reduce runs between the compiled gradients and the update.

  Args:
    model: the task's Keras model (inputs -> outputs).
    optimizer: tfpar AdamW (optionally inside a LossScaleOptimizer).
    loss_fn: (outputs, targets) -> this replica's share of the global mean
      loss (a task's `loss`).
    jit_compile: compile the forward and backward pass with XLA.
    fuse_update: also compile the update into the same XLA program (only
      valid when one replica is in sync; needs jit_compile).
    exchange: the data-parallel gradient exchange (tfpar.parallel.exchange);
      None with one replica in sync.
    skip_nonfinite: drop the update of a step whose gradient norm is NaN or
      infinite (--on_nonfinite=skip); see `apply_or_skip`.
    update: where the optimizer's state is sharded over the replicas
      (tfpar.parallel.zero.ZeroUpdate), what reduces, clips and applies the
      gradients in place of `reduce_gradients` + `apply_gradients`.
  """

  def __init__(self, model, optimizer, *, loss_fn, jit_compile: bool,
               fuse_update: bool = False, exchange=None, skip_nonfinite: bool = False,
               update=None):
    self.model = model
    self.update = update
    self.skip_nonfinite = skip_nonfinite
    self.optimizer = optimizer
    self.loss_fn = loss_fn
    self.exchange = exchange
    self.scaled = hasattr(optimizer, "inner_optimizer")  # mixed_float16 loss scaling
    self.fused = jit_compile and fuse_update
    if self.fused:
      self._fused_step = tf.function(self._step, jit_compile=True)
    else:
      self._grads = tf.function(self._loss_and_grads, jit_compile=jit_compile)

  def _loss_and_grads(self, inputs, targets):
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      loss = self.loss_fn(self.model(inputs, training=True), targets)
      scaled = self.optimizer.scale_loss(loss) if self.scaled else loss
    return loss, tape.gradient(scaled, variables)

  def _step(self, inputs, targets, loss_and_grads=None, replica=0, compressed=True):
    loss, grads = (loss_and_grads or self._loss_and_grads)(inputs, targets)
    if self.update is not None:
      return loss, self.update.apply(grads, replica, exchange=self.exchange, compressed=compressed,
                                     skip_nonfinite=self.skip_nonfinite)
    grads = reduce_gradients(self.exchange, grads, replica=replica, compressed=compressed)
    return loss, apply_gradients(self.optimizer, grads, self.model.trainable_variables,
                                 skip_nonfinite=self.skip_nonfinite)

  def __call__(self, inputs, targets, replica: int = 0, compressed: bool = True):
    """One step on this replica; `replica` (its local index) and `compressed` go to the exchange."""
    if self.fused:
      return self._fused_step(inputs, targets)
    return self._step(inputs, targets, self._grads, replica, compressed)


class EvalStep:
  """A task's eval outputs on one replica's held-out batch (the loss scaled as in training).

  Args:
    model: the task's Keras model.
    eval_fn: (outputs, targets) -> dict of tensors (a task's `eval_outputs`).
    jit_compile: compile with XLA.
  """

  def __init__(self, model, eval_fn, *, jit_compile: bool):
    self.model = model
    self.eval_fn = eval_fn
    self._outputs = tf.function(self._eval_outputs, jit_compile=jit_compile)

  def _eval_outputs(self, inputs, targets):
    return self.eval_fn(self.model(inputs, training=False), targets)

  def __call__(self, inputs, targets):
    return self._outputs(inputs, targets)
