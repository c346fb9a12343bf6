"""ZeRO-1/2 optimizer sharding: the flat layout and AdamW on one shard.

Layout. The N trainable parameters (in `model.trainable_variables` order) are
flattened into one float32 vector, padded with zeros to P = D * ceil(N / D),
and cut into D equal contiguous shards; replica r owns [r*S, (r+1)*S), S = P/D.
Each replica needs its shard of the summed gradient (what a reduce-scatter
would hand it; see Collectives), and one all-gather of the updated shards
rebuilds the weights. Padding is zero and stays zero (its
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
||g|| is the norm of the whole summed gradient, the same number on every
replica (zero1: of the summed tensors; zero2: from every chunk's sum of
squares). `decay_mask` is 1 on the elements of variables Keras' AdamW decays
(its `_use_weight_decay`, i.e. the partitioning rules' no-decay names) and 0
elsewhere.

Memory. Unsharded, each replica holds m and v for all N parameters (8N bytes
in float32); zero1 and zero2 hold 8S = 8N/D (plus the replicated weights they
update from, 4N). `ShardedAdamW.slot_bytes()` is what one replica's slots
occupy; `state_bytes` is the prediction the engine prints beside it.

Collectives (`ZeroUpdate`, in replica context). tf.distribute's
ReplicaContext offers all_reduce and all_gather but no reduce-scatter. zero1
sums the gradient whole, through the run's gradient exchange (a codec too),
and slices its shard of the sum; zero2 sums it one shard at a time and keeps
its own (`ZeroUpdate.apply` says what that saves). The new weight shards come
back with one all_gather.

Checkpoints. `ZeroUpdate.checkpoint_slots` gives each variable's m and v as
`SlotView`s at full shape, under the names unsharded AdamW's slots have in
tfpar.training.checkpoint's canonical layout: a save gathers them, a restore
writes each shard's part, so any sharding restores any other's checkpoint.

Model-parallel plans (`PlanZero`): each device position (k, t) of a plan row
is a ZeroUpdate of its own over the weights it holds, sharded over the D peers
(d, k, t); the global norm stays that of the whole gradient. With pipeline
stages on different workers each stage's worker runs its own PlanZero over the
weights it holds (tfpar.engines.stage_worker), its sums and gathers collectives
among the stage's copies.

Wired into tfpar.engines.data_parallel and tfpar.engines.model_parallel by
--optimizer_sharding (docs/design.md, "Optimizer sharding"); tests/test_zero.py,
tests/test_zero_hybrid.py.
"""

import functools
import re
from typing import List, Sequence

import numpy as np
import tensorflow as tf

from tfpar.parallel import collectives
from tfpar.parallel import exchange as exchange_lib
from tfpar.parallel.traffic import Traffic


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

  def pieces(self, shard: int):
    """[(variable index, start, stop)] of the elements of each variable that lie in `shard`."""
    lo, hi = self.shard_range(shard)
    return [(i, max(lo, o) - o, min(hi, o + n) - o)
            for i, (o, n) in enumerate(zip(self.offsets, self.sizes)) if o < hi and o + n > lo]

  def slice(self, tensors: Sequence[tf.Tensor], shard: int) -> tf.Tensor:
    """`shard` of the tensors' padded flat vector, built from the parts in it only (S floats)."""
    # Reshaped to the known size: a gradient from a compiled function may come unshaped.
    parts = [tf.reshape(tf.cast(tf.convert_to_tensor(tensors[i]), tf.float32),
                        [self.sizes[i]])[a:b] for i, a, b in self.pieces(shard)]
    pad = self.shard_size - sum(b - a for _, a, b in self.pieces(shard))
    return tf.concat(parts + [tf.zeros([pad])], axis=0)

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
    m, v, new = adamw(weights, grads * clip_factor(norm, self.clip_norm), self.m, self.v,
                      lr=self._lr(iterations), iterations=iterations, decay=self.decay_mask,
                      weight_decay=self.weight_decay, beta_1=self.beta_1, beta_2=self.beta_2,
                      epsilon=self.epsilon)
    if apply is not True:
      m, v, new = (tf.where(apply, a, b) for a, b in ((m, self.m), (v, self.v), (new, weights)))
    self.m.assign(m)
    self.v.assign(v)
    return new


def adamw(weights, grads, m, v, *, lr, iterations, decay, weight_decay: float, beta_1: float,
          beta_2: float, epsilon: float):
  """(m, v, weights) after one AdamW step on clipped `grads` (the module docstring's formulas).

  `decay` is 1 where weight decay applies and 0 elsewhere (a tensor broadcast against the
  weights, or a float); `iterations` the step count before this step.
  """
  new = weights
  if weight_decay:
    new = new - new * tf.constant(weight_decay, tf.float32) * lr * decay
  t = tf.cast(iterations + 1, tf.float32)
  b1, b2 = tf.constant(beta_1, tf.float32), tf.constant(beta_2, tf.float32)
  m = m + (grads - m) * (1 - b1)
  v = v + (tf.square(grads) - v) * (1 - b2)
  alpha = lr * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
  return m, v, new - m * alpha / (tf.sqrt(v) + epsilon)


def state_bytes(num_params: int, num_replicas: int, mode: str) -> dict:
  """Predicted bytes one replica holds for N float32 parameters (`mode` 'none', 'zero1',
  'zero2', 'zero3').

  weights: 4N (replicated), or for zero3 4 ceil(N/D) (tfpar.parallel.zero3; its rows rounded
  up per tensor apart). optimizer: m and v, 8N or 8 ceil(N/D), plus AdamW's int64 step.
  summed_gradient: the all-reduced gradient alive through the update, 4N, or for zero2 two
  shards (its own and the one in flight), 8 ceil(N/D), or for zero3 its own shard, 4 ceil(N/D);
  the replica's own unreduced gradient (4N) comes on top under every mode but zero3 (whose
  full gradient exists one part at a time).
  """
  shard = -(-num_params // num_replicas)
  sharded = mode != "none"
  summed = {"zero2": min(4 * num_params, 8 * shard), "zero3": 4 * shard}.get(mode, 4 * num_params)
  return {"weights": 4 * (shard if mode == "zero3" else num_params),
          "optimizer": 8 * (shard if sharded else num_params) + 8,
          "summed_gradient": summed}


def decay_flags(optimizer, variables) -> List[bool]:
  """Which of `variables` the Keras AdamW `optimizer` decays (its own rule, not a copy).

  A variable without storage (tfpar.parallel.zero3's template) is matched by its name alone,
  against the names the optimizer excludes (tfpar.training.optimizer excludes by name only):
  Keras' own check would read its value, drawing the whole tensor.
  """
  pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)

  def decays(v):
    if getattr(v, "_value", True) is None:
      return pattern is None or re.search(pattern, v.name) is None
    return optimizer._use_weight_decay(v)  # pylint: disable=protected-access
  return [bool(optimizer.weight_decay) and decays(v) for v in variables]


MODES = ("zero1", "zero2")


class ZeroUpdate:
  """ZeRO over the replicas in sync: each keeps 1/D of AdamW's m and v (replaces the optimizer's
  apply).

  Args:
    optimizer: the Keras AdamW whose update this shards (its iterations,
      schedule, decay set and clipping are used; it builds no slots of its own).
    variables: one replica's trainable variables (mirrored).
    mode: 'zero1' (the gradient is reduced whole, by the run's gradient
      exchange, and each replica slices its shard) or 'zero2' (reduced shard by
      shard; each replica keeps only its own: see `apply`).
    shard_ids: the global replica id of each replica of this process.
    devices: the device of each replica of this process.
    num_replicas: D, the replicas in sync.
    strategy: the strategy the replicas run under (gathers the slots at a
      save when other processes hold some shards).
    jit_compile: each replica's update of its shard (slicing its weights,
      clipping, AdamW) as one XLA program, one per replica.
    copies: the variables each local replica's update slices its weights from
      (default `variables` for every replica: mirrored ones, which each replica
      reads as its own); `variables` stay the layout's and the checkpoint's.
    gather: `gather(shard)` -> [D * S], a slot's shard held here and every other
      replica's, in shard order (a collective every replica joins at a save);
      default: the strategy's all-gather.
  """

  def __init__(self, optimizer, variables, *, mode: str = "zero1", shard_ids: Sequence[int],
               devices: Sequence[str], num_replicas: int, strategy=None,
               jit_compile: bool = False, copies=None, gather=None):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    self.mode = mode
    self.optimizer = optimizer
    self.strategy = strategy
    self.variables = list(variables)
    self.layout = FlatLayout([v.shape for v in self.variables], num_replicas)
    self.shards = []
    for shard, device in zip(shard_ids, devices):
      with tf.device(device):
        self.shards.append(ShardedAdamW.like(optimizer, self.layout, shard, self.variables))
    # One function per replica: each captures its replica's shard and copy of the weights.
    self._updates = [functools.partial(self._update, s, c)
                     for s, c in zip(self.shards, copies or [self.variables] * len(self.shards))]
    if jit_compile:
      self._updates = [tf.function(f, jit_compile=True) for f in self._updates]
    self._gathered = None  # ((step, version), {"m": [...], "v": [...]}): the last gather.
    # [D, S]: every replica's [1, S], in replica order over all processes (traced once).
    self._gather = tf.function(lambda v: strategy.gather(v, axis=0))
    self._gather_shard = gather
    self._version = 0  # Bumped by every restore, so a gather after one is not stale.

  def slot_bytes(self) -> int:
    """Bytes of AdamW slots one replica holds (what a memory measurement reads)."""
    return self.shards[0].slot_bytes()

  def apply(self, grads: List[tf.Tensor], replica: int = 0, *, exchange=None,
            compressed: bool = True, skip_nonfinite: bool = False) -> tf.Tensor:
    """Sums `grads` over the replicas, updates this replica's shard, gathers; returns the norm.

    Runs in replica context on each replica; `replica` is its local index.
    zero1 sums through `exchange` (tfpar.parallel.exchange; a codec too) and
    slices this replica's shard of the sum. zero2 sums the flat gradient one
    shard-sized chunk at a time, in shard order, each chunk's reduction waiting
    for the previous chunk's sum of squares: a replica keeps the chunk of its
    own shard and drops each other one once its squares are counted, so at most
    two shards of the summed gradient are alive instead of all of it (the
    replica's own unreduced gradient, 4N bytes, is alive either way).
    """
    grads = [tf.convert_to_tensor(g) for g in grads]
    shard = self.shards[replica]
    if self.mode == "zero1":
      summed = (exchange.reduce(grads, replica=replica, compressed=compressed)
                if exchange is not None else collectives.all_reduce(
                    tf.distribute.ReduceOp.SUM, grads))
      norm = tf.linalg.global_norm(summed)  # As tfpar.training.step.apply_gradients.
      mine = self.layout.slice(summed, shard.shard)
    else:
      kept, norm = reduce_scatter([self.layout], [grads], shard.shard)
      mine = kept[0]
      if exchange is not None:  # What the loop logs as comm_bytes: the same bytes as one SUM.
        count_scatter(exchange, [self.layout], compressed)
    new = self.update_shard(replica, mine, norm, self.optimizer.iterations, skip_nonfinite)
    ctx = tf.distribute.get_replica_context()
    gathered = tf.reshape(ctx.all_gather(new[None], axis=0), [-1])
    ctx.merge_call(self._assign, args=(self.layout.unflatten(gathered),))
    return norm

  def update_shard(self, replica: int, mine, norm, iterations,
                   skip_nonfinite: bool = False) -> tf.Tensor:
    """Local replica `replica`'s new weight shard from its shard of the summed gradient
    (`mine`), the global norm and the step count (one XLA program under jit_compile)."""
    with tf.name_scope("adamw"):  # Where scripts/dp_profile.py finds the update.
      return self._updates[replica](mine, norm, tf.convert_to_tensor(iterations), skip_nonfinite)

  def _update(self, shard: ShardedAdamW, variables, mine, norm, iterations,
              skip_nonfinite: bool) -> tf.Tensor:
    """`shard`'s new weights from its part of the summed gradient (`mine`) and the global norm."""
    weights = self.layout.slice(variables, shard.shard)
    finite = tf.math.is_finite(norm) if skip_nonfinite else True
    return shard.update(weights, mine, norm, iterations, apply=finite)

  def _assign(self, distribution, values):
    """Cross-replica: every replica's copy of each variable takes the gathered value."""
    for variable, value in zip(self.variables, values):
      distribution.extended.update(getattr(variable, "value", variable),
                                   lambda v, x: v.assign(x), args=(value,), group=False)
    iterations = self.optimizer.iterations
    distribution.extended.update(getattr(iterations, "value", iterations),
                                 lambda v: v.assign_add(1), group=False)

  # --- the canonical checkpoint's view of the slots ---------------------------
  def slots(self) -> dict:
    """{"m": [...], "v": [...]}: each slot per variable, at full shape, from every shard.

    The shards of other processes come with one all-gather per slot (a
    collective: every process calls this at the same point, as a save does);
    the result is kept until the next step or restore.
    """
    key = (int(self.optimizer.iterations.numpy()), self._version)
    if self._gathered is None or self._gathered[0] != key:
      out = {}
      for name in ("m", "v"):
        mine = {s.shard: getattr(s, name) for s in self.shards}
        if len(mine) == self.layout.num_shards:
          flat = tf.concat([mine[i] for i in range(self.layout.num_shards)], 0)
        elif self._gather_shard is not None:
          flat = self._gather_shard(next(iter(mine.values())))
        else:
          flat = tf.reshape(self._gather(_per_replica(self.strategy, lambda i, n=name: getattr(
              self._shard_of(i), n))), [-1])
        out[name] = self.layout.unflatten(flat)
      self._gathered = (key, out)
    return self._gathered[1]

  def _shard_of(self, shard_id: int) -> ShardedAdamW:
    return next(s for s in self.shards if s.shard == shard_id)

  def assign_slot(self, name: str, index: int, value) -> None:
    """Writes variable `index`'s full slot `name` ('m' or 'v') into the shards held here."""
    self._version += 1
    flat = np.reshape(np.asarray(value, np.float32), [-1])
    offset = self.layout.offsets[index]
    for shard in self.shards:
      lo, _ = self.layout.shard_range(shard.shard)
      for i, a, b in self.layout.pieces(shard.shard):
        if i == index:
          getattr(shard, name)[offset + a - lo:offset + b - lo].assign(flat[a:b])

  def checkpoint_slots(self, variable):
    """(m, v) of `variable` as the checkpoint layout holds slots (tfpar.training.checkpoint)."""
    index = next(i for i, v in enumerate(self.variables) if v is variable)
    return tuple(SlotView(self, name, index) for name in ("m", "v"))


class PlanZero:
  """ZeRO on the data-parallel dimension of a model-parallel plan: one ZeroUpdate per device.

  A plan row holds the weights of one model copy over its K x T devices; device
  (d, k, t) and its D-1 peers (d', k, t) hold the same weights. Each device position is a
  ZeroUpdate of its own (its FlatLayout over the weights that position holds, cut into D
  shards; copy d keeps shard d of m and v on device (d, k, t)). Per step (`apply`): the
  gradient summed over the D copies (zero1: through the run's gradient exchange; zero2:
  chunk by chunk, `reduce_scatter`, every position's chunk in one round), its norm over ALL
  positions (the number one device computes, which clips and skips), each position's
  shard updated on its device (one XLA program per position and copy under jit_compile),
  and every copy's new shards brought back into each copy's weights. The weights stay
  replicated: only m and v are split. (A stage worker, tfpar.engines.stage_worker, holds
  one copy of its stage's weights, sums through `reduce_scatter(ops=...)` and the
  exchange among the stage's copies, and gathers with `gather`.)

  It runs in copy d's replica function (the D copies are the replicas in sync:
  MirroredStrategy over the anchors, or one copy per worker): the sums are collectives
  (packed per device) and an all_gather brings the shards back.

  Args:
    optimizers: each local copy's Keras AdamW (built without slots; its step counter,
      schedule, decay set and clipping are used).
    copies: each local copy's trainable variables (the same order and shapes in every copy).
    mode, num_replicas, strategy, jit_compile, gather: as for ZeroUpdate (strategy: the
      data-parallel one).
    shard_ids: the global replica id of each local copy.
    groups: the variable indices of each position, each its own FlatLayout (default: the
      variables of each device; a stage worker keeps the tied embedding apart).
  """

  def __init__(self, optimizers, copies, *, mode: str, shard_ids: Sequence[int],
               num_replicas: int, strategy=None, jit_compile: bool = False, groups=None,
               gather=None):
    self.mode = mode
    self.optimizers = list(optimizers)
    self.copies = [list(c) for c in copies]
    self.num_replicas = num_replicas
    self.groups = [list(g) for g in groups] if groups is not None else list(
        collectives.by_device([variable_device(v) for v in self.copies[0]]).values())
    # Each position's update slices each copy's own weights there (on the copy's device).
    self.updates = [
        ZeroUpdate(self.optimizers[0], [self.copies[0][i] for i in group], mode=mode,
                   shard_ids=shard_ids, devices=[variable_device(c[group[0]]) for c in self.copies],
                   num_replicas=num_replicas, strategy=strategy, jit_compile=jit_compile,
                   copies=[[c[i] for i in group] for c in self.copies], gather=gather)
        for group in self.groups]
    self._slot_of = {id(c[i]): (update, j) for c in self.copies
                     for update, group in zip(self.updates, self.groups)
                     for j, i in enumerate(group)}

  def slot_variables(self) -> list:
    """Every m and v shard this process holds (each on its device)."""
    return [x for u in self.updates for s in u.shards for x in (s.m, s.v)]

  def apply(self, grads: List[tf.Tensor], copy: int, *, exchange, compressed: bool = True,
            skip_nonfinite: bool = False) -> tf.Tensor:
    """The step of local copy `copy` in its replica function, after its backward pass
    (`grads` its gradients); returns the norm."""
    grads = [tf.convert_to_tensor(g) for g in grads]
    step = tf.convert_to_tensor(self.optimizers[copy].iterations)  # Where kept.
    devices = [variable_device(self.copies[copy][group[0]]) for group in self.groups]
    layouts = [u.layout for u in self.updates]
    shard = self.updates[0].shards[copy].shard
    if self.mode == "zero1":
      summed = exchange.reduce(grads, replica=copy, compressed=compressed)
      norm = tf.linalg.global_norm(summed)  # As tfpar.training.step.apply_gradients.
      mine = []
      for layout, group, device in zip(layouts, self.groups, devices):
        with tf.device(device):
          mine.append(layout.slice([summed[i] for i in group], shard))
    else:
      mine, norm = reduce_scatter(layouts, [[grads[i] for i in group] for group in self.groups],
                                  shard, devices)
      count_scatter(exchange, layouts, compressed)
    new = []
    for update, device, summed_shard in zip(self.updates, devices, mine):
      with tf.device(device):
        new.append(update.update_shard(copy, summed_shard, norm, step, skip_nonfinite))
    for update, group, device, flat in zip(self.updates, self.groups, devices, self._gather(new)):
      with tf.device(device):
        for i, value in zip(group, update.layout.unflatten(flat)):
          self.copies[copy][i].assign(value)
    self.optimizers[copy].iterations.assign_add(1)
    return norm

  def _gather(self, new):
    """Every shard of each position, in shard order: [flat per position] (`new`: the copy's
    new shard per position, all-gathered over the replicas, one [1, S] per position)."""
    if self.num_replicas == 1:
      return new
    gathered = tf.distribute.get_replica_context().all_gather([x[None] for x in new], axis=0)
    return [tf.reshape(x, [-1]) for x in gathered]

  def checkpoint_slots(self, variable):
    """(m, v) of any local copy's `variable`, at full shape (tfpar.training.checkpoint)."""
    update, index = self._slot_of[id(variable)]
    return tuple(SlotView(update, name, index) for name in ("m", "v"))


def variable_device(variable) -> str:
  """The device of a tf.Variable or a Keras variable (whose `.value` is the tf.Variable)."""
  return (variable if isinstance(variable, tf.Variable) else variable.value).device


def reduce_scatter(layouts: Sequence[FlatLayout], grads, shard: int, devices=None, ops=None):
  """([shard `shard` of each group's summed flat gradient], the norm of the whole sum): zero2's
  sum, in replica context.

  `grads[g]` are this replica's gradients in `layouts[g]`'s order, on `devices[g]`: one
  group for the data-parallel engine; one per device for a model-parallel plan. Each
  chunk's sum is a collective over the replicas in sync, one per device.
  The D shard-sized chunks are summed in shard order, chunk k of every group in one round,
  each round waiting for the previous round's sums of squares: a replica keeps the chunks
  of its own shard and drops each other one once its squares are counted, so at most two
  shards of the summed gradient are alive instead of all of it. `ops` sums the chunks
  another way (tfpar.parallel.p2p.Among: collectives among a stage's workers).
  """
  home = devices or [None] * len(layouts)
  summing = ops or exchange_lib.InReplica(home, pack=devices is not None)
  squares, kept, after = [], None, []
  for k in range(layouts[0].num_shards):
    with tf.control_dependencies(after):
      chunks = []
      for layout, group, device in zip(layouts, grads, home):
        with collectives.on_device(device):
          chunks.append(layout.slice(group, k))
    summed = summing.sum([chunks], range(len(layouts)))
    after = []
    for chunk, device in zip(summed, home):
      with collectives.on_device(device):
        after.append(tf.reduce_sum(tf.square(chunk)))
    squares += after
    if k == shard:
      kept = summed
  return kept, tf.sqrt(tf.add_n(squares))


def count_scatter(exchange, layouts: Sequence[FlatLayout], compressed: bool) -> None:
  """Records zero2's chunked sum as the bytes of one SUM of the gradient (the loop's
  comm_bytes)."""
  padded = 4 * sum(layout.padded_size for layout in layouts)
  exchange.traffic[compressed] = Traffic(padded, padded)


def _per_replica(strategy, value_of):
  """`value_of(shard id)` of each local replica, [1, S], as one distributed value."""
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.identity(value_of(ctx.replica_id_in_sync_group))[None])


class SlotView:
  """One variable's m or v as a checkpoint layout entry: its full shape, read from and
  written into the ZeRO shards (tfpar.training.checkpoint reads `.value`, calls `assign`)."""

  def __init__(self, update: ZeroUpdate, name: str, index: int):
    self.update, self.name, self.index = update, name, index
    self.shape = tf.TensorShape(update.layout.shapes[index])
    self.dtype = tf.float32

  @property
  def value(self) -> tf.Tensor:
    return self.update.slots()[self.name][self.index]

  def assign(self, value) -> None:
    self.update.assign_slot(self.name, self.index, value)
