"""The replica step: loss, gradients, reduction, update. Apart from the loop.

`TrainStep` is the function each replica runs under `strategy.run`. The loss
is the task's (tfpar.tasks.task.Task.loss), already divided by the GLOBAL
batch's count of labelled units: the task module says why, in one place.
"""

import functools

import tensorflow as tf

from tfpar.parallel.data_parallel import all_reduce_gradients
from tfpar.tasks.task import cross_entropy


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
    global_tokens: instead of loss_fn, the cross-entropy over this many
      labels in the global batch (the language model's loss).
    jit_compile: compile the forward and backward pass with XLA.
    fuse_update: also compile the update into the same XLA program (only
      valid when one replica is in sync; needs jit_compile).
  """

  def __init__(self, model, optimizer, *, loss_fn=None, global_tokens: int = None,
               jit_compile: bool, fuse_update: bool = False):
    self.model = model
    self.optimizer = optimizer
    self.loss_fn = loss_fn or functools.partial(cross_entropy, global_count=global_tokens)
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

  def _step(self, inputs, targets, loss_and_grads=None):
    loss, grads = (loss_and_grads or self._loss_and_grads)(inputs, targets)
    # An embedding lookup's gradient comes as IndexedSlices. Made dense before
    # the all-reduce, the reduction sums it (rather than concatenating the
    # replicas' slices) and the clipping norm is that of the summed gradient.
    grads = [tf.convert_to_tensor(g) for g in grads]
    grads = all_reduce_gradients(grads)
    grad_norm = tf.linalg.global_norm(grads)
    if self.scaled:  # Report the true norm, not the loss-scaled one.
      grad_norm = grad_norm / tf.cast(self.optimizer.scale_loss(1.0), grad_norm.dtype)
    self.optimizer.apply(grads, self.model.trainable_variables)
    return loss, grad_norm

  def __call__(self, inputs, targets):
    if self.fused:
      return self._fused_step(inputs, targets)
    return self._step(inputs, targets, self._grads)


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
