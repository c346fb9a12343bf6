"""AdamW with warmup + cosine decay, whose gradient reduction tfpar owns.

Keras 3's TF optimizer all-reduces gradients itself (a SUM in replica context,
in the gradients' dtype, with no options). tfpar reduces them in
`tfpar.training.step` instead (where compression and collective options
live), so this optimizer applies the gradients it is given as they are.
Global-norm clipping then happens inside `apply`, after that reduction, which is
where it belongs: clipping each replica's partial gradient would be wrong.
"""

import keras

from tfpar import partitioning
from tfpar.config import OptimConfig

# Decoupled weight decay applies to matrices and embeddings, not to biases or
# LayerNorm scales (GPT-2/nanoGPT practice): the no-decay rules of every
# registered model family (tfpar.partitioning), by the short names Keras matches.
NO_DECAY = list(partitioning.no_decay_names())


class AdamW(keras.optimizers.AdamW):
  """keras.optimizers.AdamW that leaves gradient reduction to the caller."""

  def _all_reduce_sum_gradients(self, grads_and_vars):
    return list(grads_and_vars)


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
  opt.exclude_from_weight_decay(var_names=list(partitioning.no_decay_names()))
  if precision == "mixed_float16":
    opt = keras.optimizers.LossScaleOptimizer(opt)
  return opt


def inner_optimizer(opt):
  """The AdamW inside a LossScaleOptimizer, or the optimizer itself."""
  return getattr(opt, "inner_optimizer", opt)
