"""What Keras 3's optimizer needs to update variables that live on parameter servers.

Keras 3 has no parameter-server support (keras#18624); these patches, applied to
one optimizer instance before it is built, are what it took (checked on Keras
3.15: they rely on its internals `_distributed_tf_update_step`,
`_apply_weight_decay` and `add_variable_from_reference`).
"""

import tensorflow as tf

def make_step_counter_atomic(optimizer) -> None:
  """Makes the optimizer's `iterations += 1` one atomic op on its ps.

  Keras 3 increments the step counter with `Variable.assign_add`, which it
  implements as `assign(self + 1)`: a read, then a write. Two workers updating
  at once both read t and both write t + 1, so the counter (and the learning
  rate schedule and Adam's bias correction that read it) falls behind the
  updates really applied (docs/strategies_ps_tpu.md, "Keras' step counter"). The
  slot and weight updates are not affected (the TF optimizer routes them to
  tf.Variable.assign_add/assign_sub, one AssignAddVariableOp each).
  """
  counter = optimizer.iterations
  counter.assign_add = lambda value: counter.value.assign_add(tf.cast(value, counter.dtype))


def is_sharded(variable) -> bool:
  """True for a Keras variable (or tf variable) that is cut over several ps tasks."""
  sharded = tf.__internal__.distribute.ShardedVariable
  return isinstance(getattr(variable, "value", variable), sharded)


def update_sharded_variables_directly(optimizer) -> None:
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
    add = uncolocated_add_slot if is_sharded(reference_variable) else keras_add_slot
    return add(reference_variable, name=name, initializer=initializer)

  optimizer.add_variable_from_reference = add_slot
  keras_update = optimizer._distributed_tf_update_step  # pylint: disable=protected-access
  keras_decay = optimizer._apply_weight_decay  # pylint: disable=protected-access

  def update(distribution, grads_and_vars, learning_rate):
    keras_update(distribution, [(g, v) for g, v in grads_and_vars if not is_sharded(v)],
                 learning_rate)
    for grad, var in grads_and_vars:
      if is_sharded(var):
        optimizer.update_step(grad, var, learning_rate)

  def weight_decay(variables):
    keras_decay([v for v in variables if not is_sharded(v)])
    if optimizer.weight_decay is None:
      return
    for var in (v.value for v in variables if is_sharded(v)):
      if optimizer._use_weight_decay(var):  # pylint: disable=protected-access
        lr = tf.cast(optimizer.learning_rate, var.dtype)
        var.assign_sub(tf.convert_to_tensor(var) * tf.cast(optimizer.weight_decay, var.dtype) * lr)

  optimizer._distributed_tf_update_step = update  # pylint: disable=protected-access
  optimizer._apply_weight_decay = weight_decay  # pylint: disable=protected-access
