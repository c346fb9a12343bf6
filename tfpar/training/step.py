"""The replica step: loss, gradients, reduction, update. Apart from the loop.

`TrainStep` is the function each replica runs under `strategy.run`. The loss
scaling by the global batch happens in `token_loss`, and only there.
"""

import tensorflow as tf

from tfpar.parallel.data_parallel import all_reduce_gradients


def token_loss(logits, targets, global_tokens):
  """Next-token cross-entropy summed over this replica's tokens / tokens in the GLOBAL batch.

  Dividing by the global count (not this replica's) is what makes data
  parallelism exact: gradients are summed, not averaged, across replicas, so
  the sum of the R replica losses (and of their gradients) is the mean over the
  whole global batch, the same number one device computes. The same holds for
  micro-batches, which are summed too.
  """
  ce = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, tf.cast(logits, tf.float32))
  return tf.reduce_sum(ce) / tf.cast(global_tokens, tf.float32)


class TrainStep:
  """One optimizer step on one replica's batch.

  Args:
    model: a GPT (or any Keras model tokens -> logits).
    optimizer: tfpar AdamW (optionally inside a LossScaleOptimizer).
    global_tokens: global batch size x sequence length.
    jit_compile: compile the forward and backward pass with XLA.
  """

  def __init__(self, model, optimizer, *, global_tokens: int, jit_compile: bool):
    self.model = model
    self.optimizer = optimizer
    self.global_tokens = global_tokens
    self.scaled = hasattr(optimizer, "inner_optimizer")  # mixed_float16 loss scaling
    self._grads = tf.function(self._loss_and_grads, jit_compile=jit_compile)

  def _loss_and_grads(self, inputs, targets):
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      loss = token_loss(self.model(inputs, training=True), targets, self.global_tokens)
      scaled = self.optimizer.scale_loss(loss) if self.scaled else loss
    return loss, tape.gradient(scaled, variables)

  def __call__(self, inputs, targets):
    loss, grads = self._grads(inputs, targets)
    grads = all_reduce_gradients(grads)
    grad_norm = tf.linalg.global_norm(grads)
    if self.scaled:  # Report the true norm, not the loss-scaled one.
      grad_norm = grad_norm / tf.cast(self.optimizer.scale_loss(1.0), grad_norm.dtype)
    self.optimizer.apply(grads, self.model.trainable_variables)
    return loss, grad_norm


class EvalStep:
  """Held-out loss on one replica's batch (scaled by the global token count, like training)."""

  def __init__(self, model, *, global_tokens: int, jit_compile: bool):
    self.model = model
    self.global_tokens = global_tokens
    self._loss = tf.function(self._eval_loss, jit_compile=jit_compile)

  def _eval_loss(self, inputs, targets):
    return token_loss(self.model(inputs, training=False), targets, self.global_tokens)

  def __call__(self, inputs, targets):
    return self._loss(inputs, targets)
