"""One training step whose variables live on the parameter servers."""

import tensorflow as tf

from tfpar.training.step import apply_gradients, reduce_gradients


class RemoteVariableTrainStep:
  """tfpar's TrainStep for variables that live on other tasks (the ps).

  The same step as `tfpar.training.step.TrainStep` (the task's loss, gradient
  reduction, true norm under loss scaling, AdamW apply), split so that XLA can
  compile it: XLA reads a resource variable only on the device its cluster
  runs on ("Trying to access resource wte/embeddings/0 located in device
  /job:ps/... from device /job:worker/..."), so the weights are first read by
  ordinary ops (which TensorFlow places on the ps and sends over), and the
  compiled part is a pure function of their values through Keras'
  `stateless_call`. The update then runs on the ps, outside XLA.

  Args:
    model, optimizer, loss_fn, jit_compile, skip_nonfinite: as for TrainStep.
  """

  def __init__(self, model, optimizer, *, loss_fn, jit_compile: bool,
               skip_nonfinite: bool = False):
    self.model = model
    self.optimizer = optimizer
    self.loss_fn = loss_fn
    self.skip_nonfinite = skip_nonfinite
    self.scaled = hasattr(optimizer, "inner_optimizer")  # mixed_float16 loss scaling
    self._grads = tf.function(self._loss_and_grads, jit_compile=jit_compile)

  def _loss_and_grads(self, trainable, non_trainable, inputs, targets):
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      logits, _ = self.model.stateless_call(trainable, non_trainable, inputs, training=True)
      loss = self.loss_fn(logits, targets)
      scaled = self.optimizer.scale_loss(loss) if self.scaled else loss
    return loss, tape.gradient(scaled, trainable)

  def __call__(self, inputs, targets):
    trainable = [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables]
    non_trainable = [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables]
    loss, grads = self._grads(trainable, non_trainable, inputs, targets)
    # One replica per worker: no exchange (the config refuses compression here:
    # nothing is all-reduced), sparse gradients kept, then the same clip and apply.
    grads = reduce_gradients(None, grads, densify=False)
    return loss, apply_gradients(self.optimizer, grads, self.model.trainable_variables,
                                 skip_nonfinite=self.skip_nonfinite)
