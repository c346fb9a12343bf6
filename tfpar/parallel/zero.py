"""ZeRO-1/2 optimizer sharding: the flat layout and AdamW on one shard.

Layout. The N trainable parameters (in `model.trainable_variables` order) are
flattened into one float32 vector, padded with zeros to P = D * ceil(N / D),
and cut into D equal contiguous shards; replica r owns [r*S, (r+1)*S), S = P/D.
A reduce-scatter of the flat gradient then hands each replica its shard of
the summed gradient, and one all-gather of the updated shards rebuilds the
weights: one collective each way. Padding is zero and stays zero (its
gradient is zero, so m, v and the update stay zero).

AdamW on a shard (equal to keras.optimizers.AdamW per variable, elementwise,
so order of elements does not matter). With t = iterations + 1, lr the
schedule's rate at `iterations`, and c the global-norm clip factor:
    c      = clip * min(1/||g||, 1/clip) + (||g|| - ||g||)    (NaN if ||g|| is not finite)
    g      = c * g
    w      = w - w * wd * lr * decay_mask                      (decoupled, before Adam)
    m      = m + (g - m) * (1 - b1)
    v      = v + (g^2 - v) * (1 - b2)
    alpha  = lr * sqrt(1 - b2^t) / (1 - b1^t)
    w      = w - m * alpha / (sqrt(v) + eps)
||g|| is the norm of the whole summed gradient: each replica's sum of squares
over its shard, all-reduced (one scalar). `decay_mask` is 1 on the elements
of variables Keras' AdamW decays (its `_use_weight_decay`, i.e. the
partitioning rules' no-decay names) and 0 elsewhere.

Memory. Unsharded, each replica holds m and v for all N parameters (8N bytes
in float32); zero1 holds 8S = 8N/D (plus the replicated weights it updates
from, 4N). `ShardedAdamW.slot_bytes()` is what one replica's slots occupy.

Collectives (`ZeroUpdate`, in replica context). The flat gradient is
all-reduced and each replica keeps its shard of the sum: tf.distribute's
ReplicaContext offers all_reduce and all_gather but no reduce-scatter, and an
all-reduce moves the same bytes as the reduce-scatter + all-gather pair it is
made of on a ring. The global norm is then the summed vector's own (no extra
scalar collective); the new weight shards come back with one all_gather.

Status: the layout, the shard math (checked against Keras AdamW on the same
gradients) and ZeroUpdate under MirroredStrategy (twin of one device's
update), tests/test_zero.py. Not yet wired into the engines,
--optimizer_sharding or checkpoints (see docs/design.md, "Optimizer sharding").
"""

from typing import List, Sequence

import numpy as np
import tensorflow as tf

from tfpar.parallel import collectives


class FlatLayout:
  """Where each variable lies in the padded flat vector, and each replica's shard."""

  def __init__(self, shapes: Sequence[Sequence[int]], num_shards: int):
    if num_shards < 1:
      raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    self.shapes = [tuple(int(d) for d in s) for s in shapes]
    self.sizes = [int(np.prod(s)) for s in self.shapes]
    self.offsets = list(np.cumsum([0] + self.sizes[:-1]))
    self.size = sum(self.sizes)
    self.num_shards = num_shards
    self.shard_size = -(-self.size // num_shards)
    self.padded_size = self.shard_size * num_shards

  def shard_range(self, shard: int):
    """[start, stop) of `shard` in the padded flat vector."""
    return shard * self.shard_size, (shard + 1) * self.shard_size

  def flatten(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The tensors (in layout order) as one padded float32 vector."""
    flat = tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float32), [-1])
                      for t in tensors], axis=0)
    return tf.pad(flat, [[0, self.padded_size - self.size]])

  def unflatten(self, flat: tf.Tensor) -> List[tf.Tensor]:
    """A padded flat vector as tensors of the layout's shapes."""
    parts = tf.split(flat[:self.size], self.sizes)
    return [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]

  def shard(self, flat: tf.Tensor, shard: int) -> tf.Tensor:
    start, stop = self.shard_range(shard)
    return flat[start:stop]

  def mask(self, flags: Sequence[bool]) -> np.ndarray:
    """A padded float32 vector: 1 on the elements of variables whose flag is set."""
    out = np.zeros([self.padded_size], np.float32)
    for offset, size, flag in zip(self.offsets, self.sizes, flags):
      if flag:
        out[offset:offset + size] = 1.0
    return out


def clip_factor(norm: tf.Tensor, clip_norm) -> tf.Tensor:
  """Keras' global-norm clip factor for a gradient of norm `norm` (NaN if not finite)."""
  if not clip_norm:
    return tf.ones([], tf.float32)
  clip = tf.constant(clip_norm, tf.float32)
  return clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)


class ShardedAdamW:
  """AdamW state for one shard of a FlatLayout: m and v (and nothing else) of S elements.

  Args:
    layout: the FlatLayout.
    shard: which shard this replica owns.
    decay: one flag per variable, True where weight decay applies (as Keras'
      `_use_weight_decay` says for that variable).
    learning_rate: a float or a Keras schedule (called with `iterations`).
    weight_decay, beta_1, beta_2, epsilon, clip_norm: as keras AdamW's
      weight_decay, beta_1, beta_2, epsilon, global_clipnorm.
  """

  def __init__(self, layout: FlatLayout, shard: int, decay: Sequence[bool], *,
               learning_rate, weight_decay: float, beta_1: float, beta_2: float,
               epsilon: float, clip_norm=None):
    self.layout = layout
    self.shard = shard
    self.learning_rate = learning_rate
    self.weight_decay = weight_decay
    self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
    self.clip_norm = clip_norm
    start, stop = layout.shard_range(shard)
    self.decay_mask = tf.constant(layout.mask(decay)[start:stop])
    self.m = tf.Variable(tf.zeros([layout.shard_size]), trainable=False, name="zero_m")
    self.v = tf.Variable(tf.zeros([layout.shard_size]), trainable=False, name="zero_v")

  @classmethod
  def like(cls, optimizer, layout: FlatLayout, shard: int, variables):
    """The shard of a Keras AdamW `optimizer` (tfpar.training.optimizer.make_optimizer's)."""
    return cls(layout, shard, decay_flags(optimizer, variables),
               learning_rate=optimizer._learning_rate, weight_decay=optimizer.weight_decay,
               beta_1=optimizer.beta_1, beta_2=optimizer.beta_2, epsilon=optimizer.epsilon,
               clip_norm=optimizer.global_clipnorm)

  def slot_bytes(self) -> int:
    """Bytes of optimizer slots this replica holds: its m and v variables, as allocated."""
    return sum(int(np.prod(x.shape)) * x.dtype.size for x in (self.m, self.v))

  def _lr(self, iterations) -> tf.Tensor:
    lr = self.learning_rate
    return tf.cast(lr(iterations) if callable(lr) else lr, tf.float32)

  def update(self, weights: tf.Tensor, grads: tf.Tensor, norm: tf.Tensor, iterations,
             apply=True) -> tf.Tensor:
    """This shard's new weights, from its weights and summed gradient; `norm` is the global one.

    `iterations` is the optimizer's step count before this step (the caller
    advances it). Updates m and v; returns the updated weight shard (the
    caller all-gathers it). Where `apply` is False (--on_nonfinite=skip and a
    non-finite norm) m, v and the weights stay as they were.
    """
    lr = self._lr(iterations)
    grads = grads * clip_factor(norm, self.clip_norm)
    new = weights
    if self.weight_decay:
      new = new - new * tf.constant(self.weight_decay, tf.float32) * lr * self.decay_mask
    t = tf.cast(iterations + 1, tf.float32)
    b1, b2 = tf.constant(self.beta_1, tf.float32), tf.constant(self.beta_2, tf.float32)
    m = self.m + (grads - self.m) * (1 - b1)
    v = self.v + (tf.square(grads) - self.v) * (1 - b2)
    alpha = lr * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
    new = new - m * alpha / (tf.sqrt(v) + self.epsilon)
    if apply is not True:
      m, v, new = (tf.where(apply, a, b) for a, b in ((m, self.m), (v, self.v), (new, weights)))
    self.m.assign(m)
    self.v.assign(v)
    return new


def decay_flags(optimizer, variables) -> List[bool]:
  """Which of `variables` the Keras AdamW `optimizer` decays (its own rule, not a copy)."""
  return [bool(optimizer.weight_decay) and optimizer._use_weight_decay(v) for v in variables]


class ZeroUpdate:
  """zero1 over the replicas in sync: each keeps 1/D of AdamW's m and v; replaces the optimizer's apply.

  Args:
    optimizer: the Keras AdamW whose update this shards (its iterations,
      schedule, decay set and clipping are used; its own slots are not).
    variables: one replica's trainable variables (mirrored).
    shard_ids: the global replica id of each replica of this process.
    devices: the device of each replica of this process.
    num_replicas: D, the replicas in sync.
  """

  def __init__(self, optimizer, variables, *, shard_ids: Sequence[int],
               devices: Sequence[str], num_replicas: int):
    self.optimizer = optimizer
    self.variables = list(variables)
    self.layout = FlatLayout([v.shape for v in self.variables], num_replicas)
    self.shards = []
    for shard, device in zip(shard_ids, devices):
      with tf.device(device):
        self.shards.append(ShardedAdamW.like(optimizer, self.layout, shard, self.variables))

  def slot_bytes(self) -> int:
    """Bytes of AdamW slots one replica holds (what a memory measurement reads)."""
    return self.shards[0].slot_bytes()

  def apply(self, grads: List[tf.Tensor], replica: int = 0, *,
            skip_nonfinite: bool = False) -> tf.Tensor:
    """Sums `grads` over the replicas, updates this replica's shard, gathers; returns the norm.

    Runs in replica context on each replica; `replica` is its local index.
    """
    ctx = tf.distribute.get_replica_context()
    shard = self.shards[replica]
    summed = collectives.all_reduce(tf.distribute.ReduceOp.SUM, [self.layout.flatten(grads)])[0]
    norm = tf.norm(summed)
    mine = self.layout.shard(summed, shard.shard)
    weights = self.layout.shard(self.layout.flatten(self.variables), shard.shard)
    finite = tf.math.is_finite(norm) if skip_nonfinite else True
    new = shard.update(weights, mine, norm, self.optimizer.iterations, apply=finite)
    gathered = tf.reshape(ctx.all_gather(new[None], axis=0), [-1])
    ctx.merge_call(self._assign, args=(self.layout.unflatten(gathered),))
    return norm

  def _assign(self, distribution, values):
    """Cross-replica: every replica's copy of each variable takes the gathered value."""
    for variable, value in zip(self.variables, values):
      distribution.extended.update(getattr(variable, "value", variable),
                                   lambda v, x: v.assign(x), args=(value,), group=False)
    iterations = self.optimizer.iterations
    distribution.extended.update(getattr(iterations, "value", iterations),
                                 lambda v: v.assign_add(1), group=False)

  def slots(self, strategy) -> List[List[np.ndarray]]:
    """[m, v] as per-variable arrays, gathered from this process's shards (all of them, locally)."""
    out = []
    for name in ("m", "v"):
      flat = tf.concat([getattr(s, name) for s in sorted(self.shards, key=lambda s: s.shard)], 0)
      out.append([t.numpy() for t in self.layout.unflatten(flat)])
    del strategy
    return out
