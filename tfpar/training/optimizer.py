"""AdamW with warmup + cosine decay, whose gradient reduction tfpar owns.

Keras 3's TF optimizer all-reduces gradients itself (a SUM in replica context,
in the gradients' dtype, with no options). tfpar reduces them in
`tfpar.training.step` instead (where compression and collective options
live), so this optimizer applies the gradients it is given as they are.
Global-norm clipping then happens inside `apply`, after that reduction, which is
where it belongs: clipping each replica's partial gradient would be wrong.

Under a strategy with several replicas in sync, Keras applies the update
variable by variable in cross-replica context (a merge_call, then one
`extended.update` per variable, each running its ops on every replica's
device): a few hundred small ops outside XLA. `compile_update(True)` makes
it one XLA program per replica instead (`_backend_apply_gradients`): after
the same merge_call, each replica's device runs one compiled function that
clips, decays and applies Keras' own `update_step` to that device's copies
of all the variables and slots.

`in_order(scale)`: within it, `apply` (one replica in sync) updates the weights
one at a time, each weight's update (its decay, then Keras' `update_step`, the
ops and their order one weight sees either way) waiting for the previous
weight's assignments, its gradient multiplied by `scale` (a clip factor) inside
it. The update's temporaries (and the scaled gradient) are then one weight's at
a time, not every weight's at once as the executor would otherwise run them.
"""

import contextlib
import functools

import keras
import tensorflow as tf

from tfpar import families, partitioning
from tfpar.config.schema import OptimConfig

# Decoupled weight decay applies to matrices and embeddings, not to biases or
# LayerNorm scales (GPT-2/nanoGPT practice): the no-decay rules of every
# registered model family (tfpar.partitioning), by the short names Keras matches.
NO_DECAY = list(partitioning.no_decay_names(families.all_rules()))


class AdamW(keras.optimizers.AdamW):
  """keras.optimizers.AdamW that leaves gradient reduction to the caller."""

  def _all_reduce_sum_gradients(self, grads_and_vars):
    return list(grads_and_vars)

  def compile_update(self, enabled: bool = True) -> None:
    """Apply each replica's update as one XLA program (see the module docstring)."""
    self._programs = _ReplicaPrograms(self) if enabled else None

  @contextlib.contextmanager
  def in_order(self, scale=None):
    """Within: `apply` updates one weight at a time, each gradient times `scale` (module
    docstring)."""
    self._order = (scale,)
    try:
      yield
    finally:
      self._order = None

  def _backend_apply_gradients(self, grads, trainable_variables):
    programs = getattr(self, "_programs", None)
    ctx = tf.distribute.get_replica_context()
    if getattr(self, "_order", None) is not None:
      if (self.gradient_accumulation_steps or self.use_ema or
          (ctx is not None and ctx.num_replicas_in_sync > 1)):
        raise ValueError("AdamW.in_order: one replica in sync, no gradient accumulation or EMA")
      self._apply_in_order(grads, trainable_variables, *self._order)
      return
    if (programs is None or ctx is None or ctx.num_replicas_in_sync == 1 or
        self.gradient_accumulation_steps or self.use_ema or
        tf.__internal__.distribute.strategy_supports_no_merge_call()):
      super()._backend_apply_gradients(grads, trainable_variables)
      return
    ctx.merge_call(functools.partial(programs.apply, variables=trainable_variables), args=(grads,))

  def _apply_in_order(self, grads, variables, scale):
    if scale is not None and (self.clipnorm or self.global_clipnorm or self.clipvalue):
      grads, scale = [g * tf.cast(scale, g.dtype) for g in grads], None  # Keras clips them all.
    grads = self._clip_gradients(grads)  # pylint: disable=protected-access
    learning_rate = self.learning_rate
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    previous = []
    for grad, variable in zip(grads, variables):
      first = len(graph.get_operations()) if graph is not None else 0
      with tf.control_dependencies(previous):
        if scale is not None:
          grad = grad * tf.cast(scale, grad.dtype)
        decay(self, variable, learning_rate)
        self.update_step(grad, variable, learning_rate)
      if graph is not None:
        previous = [op for op in graph.get_operations()[first:] if op.type in _ASSIGNS]


_ASSIGNS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def decay(opt, variable, learning_rate) -> None:
  """Keras' decoupled weight decay of one weight (TFOptimizer._apply_weight_decay's ops)."""
  if opt.weight_decay is not None and opt._use_weight_decay(variable):  # pylint: disable=protected-access
    wd = tf.cast(opt.weight_decay, variable.dtype)
    opt.assign_sub(variable, variable * wd * tf.cast(learning_rate, variable.dtype))


def learning_rate_schedule(optim: OptimConfig, train_steps: int):
  """Linear warmup to `learning_rate`, then cosine decay to `learning_rate * min_lr_ratio`."""
  decay_steps = max(1, train_steps - optim.warmup_steps)
  if optim.warmup_steps == 0:
    return keras.optimizers.schedules.CosineDecay(
        optim.learning_rate, decay_steps, alpha=optim.min_lr_ratio)
  return keras.optimizers.schedules.CosineDecay(
      0.0, decay_steps, alpha=optim.min_lr_ratio, warmup_target=optim.learning_rate,
      warmup_steps=optim.warmup_steps)


def make_optimizer(optim: OptimConfig, train_steps: int, precision: str = "float32"):
  """Builds the optimizer (wrapped for dynamic loss scaling under mixed_float16)."""
  opt = AdamW(learning_rate=learning_rate_schedule(optim, train_steps),
              weight_decay=optim.weight_decay, beta_1=0.9, beta_2=0.95, epsilon=1e-8,
              global_clipnorm=optim.clip_norm or None)
  # Read now, not at import: a family registered since (a test's toy) counts too.
  opt.exclude_from_weight_decay(var_names=list(partitioning.no_decay_names(families.all_rules())))
  if precision == "mixed_float16":
    opt = keras.optimizers.LossScaleOptimizer(opt)
  return opt


def inner_optimizer(opt):
  """The AdamW inside a LossScaleOptimizer, or the optimizer itself."""
  return getattr(opt, "inner_optimizer", opt)


class _ReplicaPrograms:
  """One `tf.function(jit_compile=True)` per replica: Keras AdamW's clip, decay and update of
  that replica's copies (each traces in its replica's update context, so it captures them)."""

  def __init__(self, optimizer):
    self.optimizer = optimizer
    self.programs = {}

  def apply(self, distribution, grads, variables):
    """Cross-replica (inside the merge_call): each device's program on its gradients."""
    mirrored = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    devices = [v.device for v in mirrored[0].values]

    def on_device(first, *local_grads):
      replica = devices.index(first.device)
      if replica not in self.programs:
        self.programs[replica] = tf.function(lambda g: self._update(g, variables),
                                             jit_compile=True)
      return self.programs[replica](list(local_grads))

    distribution.extended.update(mirrored[0], on_device, args=tuple(grads), group=False)

  def _update(self, grads, variables):
    """As keras' _backend_apply_gradients without accumulation or EMA, on this device's copies."""
    opt = self.optimizer
    grads = opt._clip_gradients(grads)  # pylint: disable=protected-access
    learning_rate = opt.learning_rate
    for variable in variables:  # As TFOptimizer._apply_weight_decay, per device.
      decay(opt, variable, learning_rate)
    for grad, variable in zip(grads, variables):
      opt.update_step(grad, variable, learning_rate)
