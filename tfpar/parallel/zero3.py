"""ZeRO-3: the weights, their gradients and AdamW's m and v all sharded over D replicas.

Layout. Every trainable tensor of shape [r, ...] is cut along its first axis
(rows): replica s holds rows [s c, min(r, (s + 1) c)), c = ceil(r / D), so
each shard is a hyper-rectangle of the canonical tensor (the last shards may
be shorter, or empty when r < D). Replica s keeps, on its own device, a
tf.Variable of its rows of each weight and of that weight's m and v: 12 N / D
bytes of float32 state per replica for N parameters (plus row rounding),
against 12 N unsharded and 4 N + 8 N / D under zero1/zero2. `slices()` lists
them per process as `Slice(name, shape, begin, size, variable)`: what
TensorFlow's checkpoint slices (SaveV2's shape_and_slices) describe.

The model. The Keras model is a template: built inside a keras.StatelessScope,
its variables have shapes and no storage. A part of it (the embedding, each
block, the head) runs inside a StatelessScope that maps its variables to their
full values, gathered just then from the D shards (`Gather`: one all-gather of
the part's packed rows). Each part runs under `recompute`: only its input and
the shard values stay alive between forward and backward, so the gathered
weights are freed once the part's forward is done, and its backward gathers
them again and recomputes the part (as --remat=full does; TensorFlow keeps a
tensor alive while a gradient refers to it, so recomputing is the only way to
free them). A part's gather waits for its input (the part before's output):
nothing else orders it, and TensorFlow's executor would otherwise gather
every part as soon as the step starts, holding several parts' weights while
the first one runs. The backward runs part after part: a part's recomputation
waits for its output gradient, and its input gradient for its weight
gradients' sum, so one part's gathered weights and full gradients are alive
at a time. The embedding and the head both gather every weight outside the
blocks (for a tied table, the one they share).

Gradients. The gather's gradient sums each part's full gradient over the
replicas and keeps this replica's rows (a reduce-scatter; tf.distribute's
replica context has no reduce-scatter, so the part's packed gradient is summed
a group of replicas' rows at a time, min(D, SUM_CHUNKS) all-reduces in turn,
each replica keeping its own: a group's sum alive at a time, not the whole
part's, and a bounded number of collectives however large D). The gradient of a
weight read by two parts (the tied table) is the sum of both parts' shards.

Step (replica context, `apply`), with t = iterations + 1 and the schedule's
lr, on each replica's rows only:
    ||g||  = sqrt(all_reduce(sum over the replica's shards of g^2))  (the whole
             summed gradient's norm: the shards are disjoint)
    c      = Keras' global-norm clip factor of ||g|| (tfpar.parallel.zero.clip_factor)
    m, v, w = AdamW on c g (tfpar.parallel.zero.adamw; decay where Keras decays)
and under --on_nonfinite=skip a non-finite ||g|| leaves w, m and v as they
were; the step counter (the optimizer's, mirrored) advances either way. So
clipping, skipping, weight decay and the schedule are the unsharded update's.
The weights are updated one after another (each waits for the previous one's
assignments), so a step holds one weight's AdamW temporaries, not every weight's.

Initialisation. Each replica makes its rows of each weight itself
(`initialise`: tfpar.training.initialise.slice_value over the canonical
coordinates, from the initializer the template's variable was given), equal
element for element to one device's weights; no process builds the model.

Checkpoints. `slices()` is what each process writes and restores: its
replicas' rows of every weight, m and v, as canonical slices (SaveV2 and
RestoreV2 shape_and_slices), so no process gathers a tensor and a restore
reads only its rows, from a checkpoint written under any plan. So zero3
restores any plan's checkpoint and writes one any plan restores.
`checkpoint_layout` still gives the canonical layout with each weight, m and v
seen at full shape (`View`: read by concatenating the shards), for what reads
the state whole in one process (tests, a keras-hub preset's values).

Pipeline stages (`Placement`). A replica may span K devices, a pipeline's
stages: each part then runs on its stage's device (the embedding on the
first, each block on its stage's, the head on the last), and each weight's
rows, m and v live on the device of the part that owns it, so a stage's
weights are sharded 1/D over that stage's D copies and its gathers and
reduce-scatters run between those D devices. The step's M micro-batches run
forward one after the other under one tape and their backwards after (GPipe's
order), each part gathering its weights again per micro-batch; the update
runs per (replica, device), one XLA program each under jit_compile.

Bytes per replica predicted: tfpar.parallel.zero.state_bytes(mode='zero3');
tfpar.planner.cost models the gathers' traffic. Wired into
tfpar.engines.data_parallel by --optimizer_sharding=zero3, and into
tfpar.engines.hybrid_zero3 for the data-parallel dimension of a pipeline plan;
tests/test_zero.py, tests/test_zero_hybrid.py.
"""

import contextlib
import functools
from typing import Dict, List, NamedTuple, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state

from tfpar.layers.parallel import whole_sequence
from tfpar.parallel import collectives, zero
from tfpar.parallel.pipeline import split_batch
from tfpar.training import initialise
from tfpar.training.checkpoint import Slice

# A part's summed gradient is made in at most this many all-reduces, one after another, of
# about 1/SUM_CHUNKS of the part each (tfpar.planner.cost.ZERO3_SUM_CHUNKS models it).
SUM_CHUNKS = 4


def rows(num_rows: int, shard: int, num_shards: int):
  """(first row, row count) of `shard`'s rows of a tensor of `num_rows` rows."""
  per = -(-num_rows // num_shards)
  first = min(num_rows, shard * per)
  return first, min(num_rows, first + per) - first


def build_template(build):
  """The model `build()` makes, its trainable variables without storage (shapes only).

  Its non-trainable variables (dropout RNG states) are created for real: they are small,
  and a checkpoint holds them. The trainable ones keep their initializer (`Zero3.initialise`
  draws each shard from it) and are taken off Keras' list of variables to initialise, which
  the exit of any StatelessScope (the parts' forwards run in one) would otherwise fill.
  """
  with keras.StatelessScope(initialize_variables=False):
    model = build()
  for variable in model.non_trainable_variables:
    variable._deferred_initialize()  # pylint: disable=protected-access
  pending = global_state.get_global_attribute("uninitialized_variables") or []
  template = {id(v) for v in model.variables}
  pending[:] = [v for v in pending if id(v) not in template]
  return model


class Placement(NamedTuple):
  """Where one replica's parts run (its pipeline stages' devices): the embedding, each block,
  the head."""
  embed: str
  blocks: Sequence[str]
  head: str


def _on(device: Optional[str]):
  return tf.device(device) if device else contextlib.nullcontext()


class Zero3:
  """A template model's weights, gradients and AdamW state sharded by rows over the replicas.

  Args:
    model: the template (`build_template`): a tfpar.models.base.ParallelModel.
    optimizer: the Keras AdamW (built without slots: its step counter, schedule, decay set
      and clipping are used).
    shard_ids: the global replica id of each replica of this process.
    devices: the device of each replica of this process.
    num_replicas: D, the replicas in sync.
    strategy: the strategy they run under (gathers a save's shards from other processes).
    jit_compile: each part's forward (and its recomputation) and each replica's update (per
      device) as XLA programs.
    placements: each local replica's `Placement` (its parts over pipeline stages); None: the
      whole replica on its device.
    embed_variables: with placements, the template variables the embedding owns (their
      shards live on the embedding's device; the other weights outside the blocks on the
      head's).
    microbatches: M, the micro-batches `loss_and_grads` cuts each replica's batch into.
  """

  mode = "zero3"

  def __init__(self, model, optimizer, *, shard_ids: Sequence[int], devices: Sequence[str],
               num_replicas: int, strategy, jit_compile: bool = False,
               placements: Optional[Sequence[Placement]] = None, embed_variables=(),
               microbatches: int = 1):
    self.model = model
    self.optimizer = optimizer
    self.strategy = strategy
    self.num_replicas = num_replicas
    self.shard_ids = list(shard_ids)
    self.variables = list(model.trainable_variables)
    for v in self.variables:
      if not v.shape:
        raise ValueError(f"zero3 shards tensors by rows: {v.path} is a scalar")
    self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
    self.per = [-(-s[0] // num_replicas) for s in self.shapes]  # Rows of a full shard.
    self.decay = zero.decay_flags(optimizer, self.variables)
    self.microbatches = microbatches
    index = {id(v): i for i, v in enumerate(self.variables)}
    blocks = [[index[id(v)] for v in block.trainable_variables] for block in model.blocks]
    in_blocks = {i for b in blocks for i in b}
    self.outside = [i for i in range(len(self.variables)) if i not in in_blocks]
    self.blocks = blocks
    self.placements = list(placements) if placements else [None] * len(devices)
    # homes[replica][i]: the device of variable i's rows, m and v on that replica.
    embed = {id(v) for v in embed_variables}
    self.homes = []
    for device, place in zip(devices, self.placements):
      home = [device] * len(self.variables)
      if place:
        for b, indices in enumerate(blocks):
          for i in indices:
            home[i] = place.blocks[b]
        for i in self.outside:
          home[i] = place.embed if id(self.variables[i]) in embed else place.head
      self.homes.append(home)
    # slots[replica][kind][i]: replica's rows of variable i ('w'), of its m and of its v.
    self.slots = []
    for shard, home in zip(self.shard_ids, self.homes):
      self.slots.append({k: [] for k in ("w", "m", "v")})
      for kind in ("w", "m", "v"):
        for i in range(len(self.variables)):
          with tf.device(home[i]):
            self.slots[-1][kind].append(tf.Variable(tf.zeros(self._shard_shape(i, shard)),
                                                    trainable=kind == "w", name=f"zero3_{kind}"))
    compile_ = (lambda f: tf.function(f, jit_compile=True)) if jit_compile else (lambda f: f)
    # The parts' forwards, with weights given: {training: (embed, [block], head)}; training's
    # compiled under jit_compile (eval's run op by op).
    self._parts = {training: tuple(
        [wrap(functools.partial(self._run_embed, training)),
         [wrap(functools.partial(self._run_block, b, i, training))
          for b, i in zip(model.blocks, blocks)],
         wrap(self._run_head)]) for training, wrap in ((True, compile_), (False, lambda f: f))}
    # Per replica, (device, variable indices, update): one per device its rows live on.
    self._updates = [[(device, indices, compile_(functools.partial(self._update, r, indices)))
                      for device, indices in collectives.by_device(home).items()]
                     for r, home in enumerate(self.homes)]
    self._gather_fn = tf.function(lambda v: strategy.gather(v, axis=0))
    self.names = [None] * len(self.variables)  # Canonical names (`checkpoint_layout`).

  def _shard_shape(self, i: int, shard: int):
    return (rows(self.shapes[i][0], shard, self.num_replicas)[1],) + self.shapes[i][1:]

  # --- forward and backward ---------------------------------------------------
  def loss_and_grads(self, inputs, targets, loss_fn, replica: int = 0):
    """(this replica's loss share, the gradient of each of its weight shards, summed over the
    replicas); in replica context. Each part runs under `recompute` (module docstring)."""
    with tf.GradientTape() as tape:
      shards = [tf.convert_to_tensor(w) for w in self.slots[replica]["w"]]
      losses = []
      for x, y in zip(*(split_batch(t, self.microbatches) for t in (inputs, targets))):
        outputs = self._forward(x, shards, replica, recompute, True)
        with _on(self.placements[replica] and self.placements[replica].head):
          losses.append(loss_fn(outputs, y))  # Each a share of the global mean.
      loss = tf.add_n(losses)
    grads = tape.gradient(loss, shards, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss, grads

  def outputs(self, inputs, replica: int = 0):
    """The model's outputs (not training) on this replica's inputs; in replica context."""
    shards = [tf.convert_to_tensor(w) for w in self.slots[replica]["w"]]
    return self._forward(inputs, shards, replica, lambda f: f, False)

  def _forward(self, inputs, shards, replica, wrap, training):
    """embed -> blocks -> head, each part's weights gathered from `shards` inside `wrap`."""
    gather = Gather(self, replica)
    embed, blocks, head = self._parts[training]
    place = self.placements[replica] or Placement(None, [None] * len(blocks), None)
    outside = [shards[i] for i in self.outside]
    with _on(place.embed):
      h = wrap(lambda *w: embed(inputs, *gather(self.outside, w)))(*outside)
    for indices, run, device in zip(self.blocks, blocks, place.blocks):
      with _on(device):  # The activation h crosses to the block's stage here.
        h = wrap(lambda x, *w, i=indices, r=run: r(x, *gather(i, w, after=x)))(
            h, *[shards[i] for i in indices])
    with _on(place.head):
      return wrap(lambda x, *w: head(x, *gather(self.outside, w, after=x)))(h, *outside)

  def _mapping(self, indices, values):
    return keras.StatelessScope(state_mapping=[(self.variables[i], v)
                                               for i, v in zip(indices, values)])

  def _run_embed(self, training, inputs, *values):
    with self._mapping(self.outside, values):
      return self.model.embed(inputs, training=training)

  def _run_block(self, block, indices, training, h, *values):
    with self._mapping(indices, values):
      return block(h, training=training)

  def _run_head(self, h, *values):
    with self._mapping(self.outside, values):
      return self.model.head(whole_sequence(h))

  # --- the update ---------------------------------------------------------------
  def apply(self, grads: List[tf.Tensor], replica: int = 0, *, skip_nonfinite: bool = False
            ) -> tf.Tensor:
    """Clips by the global norm and updates this replica's shards; returns the norm."""
    squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
    (squares,) = collectives.all_reduce(tf.distribute.ReduceOp.SUM, [squares])
    norm = tf.sqrt(squares)
    iterations = tf.convert_to_tensor(self.optimizer.iterations)
    for device, indices, update in self._updates[replica]:
      with _on(device):
        update([grads[i] for i in indices], norm, iterations, skip_nonfinite)
    tf.distribute.get_replica_context().merge_call(self._advance)
    return norm

  def _update(self, replica, indices, grads, norm, iterations, skip_nonfinite):
    """Replica `replica`'s rows of variables `indices` (on one device), from their `grads`."""
    opt, slots = self.optimizer, self.slots[replica]
    lr = opt._learning_rate  # pylint: disable=protected-access
    lr = tf.cast(lr(iterations) if callable(lr) else lr, tf.float32)
    c = zero.clip_factor(norm, opt.global_clipnorm)
    finite = tf.math.is_finite(norm)
    previous = []
    for i, g in zip(indices, grads):  # One weight at a time: one weight's temporaries.
      w, m, v, decay = slots["w"][i], slots["m"][i], slots["v"][i], self.decay[i]
      with tf.control_dependencies(previous):
        new_m, new_v, new_w = zero.adamw(
            w, g * c, m, v, lr=lr, iterations=iterations, decay=1.0 if decay else 0.0,
            weight_decay=opt.weight_decay, beta_1=opt.beta_1, beta_2=opt.beta_2,
            epsilon=opt.epsilon)
        previous = [var.assign(tf.where(finite, value, var) if skip_nonfinite else value,
                               read_value=False)
                    for var, value in ((m, new_m), (v, new_v), (w, new_w))]

  def _advance(self, distribution):
    iterations = self.optimizer.iterations
    distribution.extended.update(getattr(iterations, "value", iterations),
                                 lambda v: v.assign_add(1), group=False)

  # --- what each replica holds ------------------------------------------------
  def held_bytes(self, kinds=("w", "m", "v")) -> int:
    """Bytes of one replica's shards of `kinds` (its first local one), as allocated."""
    return sum(int(np.prod(x.shape)) * 4 for k in kinds for x in self.slots[0][k])

  def part_bytes(self) -> int:
    """Bytes of the largest part's full weights: what one gather materialises."""
    sizes = [sum(int(np.prod(self.shapes[i])) for i in part)
             for part in self.blocks + [self.outside]]
    return 4 * max(sizes)

  def step_bytes(self) -> Dict[str, int]:
    """What a step holds beside the shards: the largest part's gathered weights, and its full
    gradient with one group's rows of that gradient's sum (the groups are summed in turn).
    tfpar.planner.cost models the same."""
    part = self.part_bytes()
    return {"weights": part, "gradients": part + part // min(self.num_replicas, SUM_CHUNKS)}

  def slices(self, kinds=("w", "m", "v")) -> List[Slice]:
    """Every shard this process holds, weights then '@m' and '@v', as canonical slices
    (an empty one, where a tensor has fewer rows than replicas, left out)."""
    out = []
    for replica, shard in enumerate(self.shard_ids):
      for kind in kinds:
        suffix = {"w": "", "m": "@m", "v": "@v"}[kind]
        for i, variable in enumerate(self.slots[replica][kind]):
          first, count = rows(self.shapes[i][0], shard, self.num_replicas)
          if count:
            out.append(Slice(self.names[i] + suffix, self.shapes[i],
                             (first,) + (0,) * (len(self.shapes[i]) - 1),
                             (count,) + self.shapes[i][1:], variable))
    return out

  def initialise(self, seed: int) -> None:
    """Each local replica's rows of every weight, as one device makes them (the template's
    initializers; `checkpoint_layout` names them first)."""
    template = {id(slot): self.variables[i] for r in range(len(self.slots))
                for i, slot in enumerate(self.slots[r]["w"])}
    pieces = self.slices(("w",))
    recorded = {id(p.variable): (p.variable, template[id(p.variable)]._initializer)  # pylint: disable=protected-access
                for p in pieces}
    done = initialise.initialise(pieces, seed, recorded)
    if done != len(pieces):
      raise ValueError("zero3 makes each shard from its weight's Keras initializer: "
                       f"{len(pieces) - done} weights have none")

  # --- the canonical checkpoint's view --------------------------------------------
  def checkpoint_layout(self, layout: Dict) -> Dict:
    """tfpar.training.checkpoint's layout of the template (and optimizer, slots from
    `checkpoint_slots`), its weights replaced by full-shape views of the shards."""
    index = {id(v): i for i, v in enumerate(self.variables)}
    out = {}
    for name, (axis, shards) in layout.items():
      if len(shards) == 1 and id(shards[0]) in index:
        self.names[index[id(shards[0])]] = name
        shards = [View(self, "w", index[id(shards[0])])]
      out[name] = (axis, shards)
    return out

  def checkpoint_slots(self, variable):
    """(m, v) of a template `variable` at full shape (model_layout's `slots`)."""
    i = next(j for j, v in enumerate(self.variables) if v is variable)
    return View(self, "m", i), View(self, "v", i)

  def full(self, kind: str, i: int) -> tf.Tensor:
    """Variable i's `kind` ('w', 'm', 'v') at full shape, from every replica's rows.

    With replicas in other processes, one strategy.gather (a collective: every process
    calls it at the same point).
    """
    if len(self.slots) == self.num_replicas:
      return tf.concat([self.slots[r][kind][i] for r in np.argsort(self.shard_ids)], axis=0)
    packed = self._gather_fn(self.strategy.experimental_distribute_values_from_function(
        lambda ctx: pack([tf.convert_to_tensor(self.slots[self.shard_ids.index(
            ctx.replica_id_in_sync_group)][kind][i])], [self.per[i]])[None]))
    return unpack(packed, [self.shapes[i]], [self.per[i]], self.num_replicas)[0]

  def assign(self, kind: str, i: int, value) -> None:
    """Writes variable i's full `kind` into the rows each local replica holds."""
    full = np.asarray(value, np.float32)
    for replica, shard in enumerate(self.shard_ids):
      first, count = rows(self.shapes[i][0], shard, self.num_replicas)
      self.slots[replica][kind][i].assign(full[first:first + count])


class View:
  """One variable's weight, m or v at full shape, read from and written into the shards
  (tfpar.training.checkpoint reads `.value`, calls `assign`)."""

  def __init__(self, zero3: Zero3, kind: str, index: int):
    self.zero3, self.kind, self.index = zero3, kind, index
    self.shape = tf.TensorShape(zero3.shapes[index])
    self.dtype = tf.float32

  @property
  def value(self) -> tf.Tensor:
    return self.zero3.full(self.kind, self.index)

  def assign(self, value) -> None:
    self.zero3.assign(self.kind, self.index, value)


def pack(shards: Sequence[tf.Tensor], per: Sequence[int]) -> tf.Tensor:
  """One replica's shards as one vector, each padded with zero rows to its full shard's rows."""
  return tf.concat([tf.reshape(tf.pad(x, [[0, p - tf.shape(x)[0]]] + [[0, 0]] * (x.shape.rank - 1)),
                               [-1]) for x, p in zip(shards, per)], axis=0)


def unpack(packed: tf.Tensor, shapes, per, d: int) -> List[tf.Tensor]:
  """[d, S] packed rows of d replicas (in shard order) -> the full tensors."""
  sizes = [p * int(np.prod(s[1:])) for s, p in zip(shapes, per)]
  out = []
  packed = tf.reshape(packed, [d, sum(sizes)])  # A collective's result may come unshaped.
  for part, shape, p in zip(tf.split(packed, sizes, axis=1), shapes, per):
    out.append(tf.reshape(part, (d * p,) + tuple(shape[1:]))[:shape[0]])
  return out


def recompute(f):
  """f (a part's forward) recomputed in its backward, as tf.recompute_grad does (only its
  arguments stay alive between forward and backward), in two orders of its own.

  The recomputation waits for the part's output gradient, and the gradient of f's first
  argument (the activation, the next part's output gradient; for the embedding a shard)
  waits for the others (the part's weight shards' gradients, summed over the replicas).
  So the backward runs part after part: one part's gathered weights and full gradients at a
  time. tf.recompute_grad orders neither: TensorFlow's executor may recompute a part, and
  gather its weights, while the part after it is still summing its gradients.
  """

  @tf.custom_gradient
  def part(*args):
    def grad(*dys):
      with tf.control_dependencies(dys):
        xs = [tf.identity(a) for a in args]
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(xs)
        out = f(*xs)
      grads = tape.gradient(out, xs, output_gradients=list(dys),
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      with tf.control_dependencies(grads[1:]):
        grads[0] = tf.identity(grads[0])
      return grads
    return f(*args), grad
  return part


class Gather:
  """A part's full weights from the replicas' shards, in replica context; the gradient sums
  the full gradient over the replicas and keeps this replica's rows."""

  def __init__(self, zero3: Zero3, replica: int):
    self.zero3 = zero3
    self.shard = zero3.shard_ids[replica]

  def __call__(self, indices, shards, after: Optional[tf.Tensor] = None):
    """The full weights `indices` from this replica's `shards`, gathered once `after` (the
    part's input) exists."""
    z = self.zero3
    shapes, per = [z.shapes[i] for i in indices], [z.per[i] for i in indices]
    sizes = [x.shape[0] for x in shards]

    @tf.custom_gradient
    def gather(*xs):
      ctx = tf.distribute.get_replica_context()
      with tf.control_dependencies([] if after is None else [after]), tf.name_scope("gather"):
        packed = pack(xs, per)[None]
      if ctx.num_replicas_in_sync > 1:
        packed = ctx.all_gather(packed, axis=0)
      full = unpack(packed, shapes, per, z.num_replicas)

      def grad(*dys):
        d = z.num_replicas
        dys = [tf.zeros(s) if dy is None else tf.convert_to_tensor(dy)
               for dy, s in zip(dys, shapes)]
        packed_grads = tf.concat(  # Row r: replica r's rows of every gradient, as `pack` packs.
            [tf.reshape(tf.pad(dy, [[0, d * p - s[0]]] + [[0, 0]] * (len(s) - 1)), [d, -1])
             for dy, s, p in zip(dys, shapes, per)], axis=1)
        if ctx.num_replicas_in_sync == 1:
          row = packed_grads[self.shard]
        else:  # The rows summed a group at a time (SUM_CHUNKS groups in turn), this
          sums = []  # replica keeping its own rows of its group's sum.
          for group in np.array_split(np.arange(d), min(d, SUM_CHUNKS)):
            with tf.control_dependencies(sums[-1:]):
              sums.extend(collectives.all_reduce(tf.distribute.ReduceOp.SUM,
                                                 [packed_grads[group[0]:group[-1] + 1]]))
            if group[0] <= self.shard <= group[-1]:
              row = sums[-1][self.shard - group[0]]
          with tf.control_dependencies(sums[-1:]):
            row = tf.identity(row)
        mine = unpack(row, [(p,) + tuple(s[1:]) for s, p in zip(shapes, per)], per, 1)
        return [m[:n] for m, n in zip(mine, sizes)]
      return full, grad

    return gather(*shards)
