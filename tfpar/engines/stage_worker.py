"""One program per worker: the engine of a pipeline whose stages are worker processes.

When a plan's replica spans workers (tfpar.config.rules.worker_layout: W = K x T / G
workers per replica, D = N / W copies: tfpar.config.rules.stages_across_workers),
whatever the task, every worker of the job runs this engine in its own process, under
the job's MultiWorkerMirroredStrategy (which sets up the collective executor
and serves the loop's agreement on when to stop and save; it runs no step).
Worker w holds only the chunks the plan puts on its devices (its copy d's row
of `stage_workers`); it builds only their weights and AdamW slots, and traces
and runs only their ops (tfpar.parallel.stage_program): activations and their
gradients cross to the neighbouring stages' workers of its copy by collective
send/recv (tfpar.parallel.p2p).

The step on worker w, in the plan's schedule (GPipe, 1F1B, interleaved):

  1. its units F(c, m) and B(c, m) in the timetable's order, each backward
     starting from the output gradient it received;
  2. a tied token embedding (a model whose head reads it: `head_reads_embed`,
     the GPT): the last stage's worker holds a copy of the embedding too (as
     Megatron-LM does), and the two copies' gradients are summed between the
     first and the last stage's workers: both then apply the same update and
     stay equal. An untied model's last stage holds no embedding;
  3. D > 1: the sum of its gradients with the same stage's workers of the
     other copies, through the run's gradient exchange (plain float32, or a
     codec of tfpar.parallel.compression), whose sums are collectives among
     those workers (p2p.Among), bucket by bucket: each bucket of blocks
     (StageProgram.buckets, --all_reduce_pack_mb) summed as soon as the
     backward has finished it, while the backward of earlier blocks runs;
  4. one SUM over every worker of the job of [its copy's last stage's loss
     share, its squared gradient norm] (counted by copy 0 only, the shared
     embedding once): the step's loss and gradient norm, the numbers one
     device computes, so every worker clips by the same factor and skips
     (--on_nonfinite=skip) alike;
  5. its AdamW update of its own weights, weight by weight with the clip factor inside
     (tfpar.training.optimizer.AdamW.in_order: no clipped copy); under --optimizer_sharding=zero1/2
     (tfpar.parallel.zero.PlanZero over its own weights, sharded over the
     stage's D copies) steps 3 and 5 are instead: zero1 sums the gradient
     through the exchange, zero2 chunk by chunk keeping its own shard
     (zero.reduce_scatter), each copy updates its shard of m, v and the
     weights, and one all-gather among the copies brings back every copy's.

Input: copy d's first and last stages' workers iterate slice d of D of every
global batch (the data position follows from the step); the first stage's
worker feeds the inputs, the last the targets; a middle stage's worker reads
no data. The chief logs, writes plan.json and checkpoints.

Eval: copy d's last stage's worker computes the task's eval outputs of its
slice (tfpar.tasks.task.Task.eval_outputs: scalars are shares, summed; a
tensor of rank >= 1 holds one row per example). Every worker knows their
shapes and dtypes (the task's outputs of the head, traced on the model's
template, which holds no weights); each output is one SUM over the job: a
scalar of copy d's share (zero on the other workers), a per-example tensor
as row d of a [D, rows, ...] buffer (zeros elsewhere; exact, as x + 0 = x),
read back as [D x rows, ...]: the copies' examples in copy order, the global
batch's outputs as one device computes them, on every worker (each runs the
task's eval_metrics; the chief logs them).

Checkpoints stay canonical (tfpar.training.checkpoint) and are written in
slices: each worker writes the slices of the weights and AdamW slots it holds
(copy 0's; the embedding by the first stage) into its own bundle and restores
exactly the slices it holds, so no process holds another's state and a
checkpoint restores under any plan. ZeRO's m and v are gathered at full shape
among the stage's copies at a save and written by copy 0, and restored whole
into each copy's shard; PowerSGD's residuals and Q are slices of the canonical
flat entries (tfpar.parallel.exchange_state). The chief adds the step and the dropout
layers' RNG states (every worker holds each, the one running the layer
advances it: the largest value over the job's workers, one small collective
per state at each save).
"""

from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfpar import strategies
from tfpar.config.schema import Config
from tfpar.data import pipeline
from tfpar.engines.base import Engine, build_model
from tfpar.engines.model_parallel import (_worker_devices, _worker_index, measured_bytes,
                                          predicted_memory)
from tfpar.layout import placement as plan_lib
from tfpar.parallel import collectives, p2p, schedules, tensor, zero, zero3
from tfpar.parallel.compression import initial_q, make_exchange
from tfpar.parallel.pipeline import Pipeline
from tfpar.parallel.stage_program import StageProgram
from tfpar.parallel.zero import clip_factor
from tfpar.training import initialise
from tfpar.parallel.traffic import matrix_shape
from tfpar.training.checkpoint import (CanonicalCheckpointer, Slice, layout_slices, model_layout,
                                      relative_path)
from tfpar.training.optimizer import inner_optimizer
from tfpar.training.step import apply_or_skip


# Instance keys (p2p.Keys.extra) of the collectives among a stage's copies: a step's, a
# compressed step's (its own trace, other shapes), and ZeRO's slot gathers at a save; and of
# an eval batch's sums over the job.
COPY_KEYS, COMPRESSED_KEYS, SLOT_KEYS, EVAL_KEYS = 1 << 16, 1 << 17, 3 << 16, 1 << 18


class StageWorkerEngine(Engine):
  """This worker's stages of a plan whose stages are on different workers (module docstring).

  Args:
    cfg: the run's config.
    strategy: the job's MultiWorkerMirroredStrategy.
    data, sharding, task: as for tfpar.engines.base.Engine.
  """

  def __init__(self, cfg: Config, strategy, data, *, sharding: str = "data", task=None):
    super().__init__(cfg, data, sharding=sharding, task=task)
    self.strategy = strategy  # The loop's agreement and same-step check; not the step's.
    resolver = strategy.cluster_resolver
    local = strategies.compute_devices(cfg.dist.num_cpu_devices)
    workers = _worker_devices(resolver, local)
    self.plan = plan_lib.make_plan(cfg, [], worker_devices=workers, family=self.task.family)
    self.worker_index = me = _worker_index(resolver)
    self.num_replicas = self.plan.data_parallel
    worker_of = {plan_lib.device_key(d): w for w, devices in enumerate(workers) for d in devices}
    rows = [[worker_of[plan_lib.device_key(row[k][0])] for k, _ in self.plan.chunks]
            for row in self.plan.devices]  # rows[d][c]: the worker of copy d's chunk c
    self.copy = next(d for d, ws in enumerate(rows) if me in ws)
    row, chunk_workers = self.plan.devices[self.copy], rows[self.copy]
    self.members = sorted({w for ws in rows for w in ws})  # The whole job.
    self.first, self.last = chunk_workers[0], chunk_workers[-1]
    mine = [c for c, w in enumerate(chunk_workers) if w == me]
    self.copies = sorted(ws[mine[0]] for ws in rows)  # This stage's worker in every copy.
    self.groups = p2p.Groups(len(workers), gpu=bool(tf.config.list_logical_devices("GPU")))

    # The model: this worker's chunks only (and the embedding where the head reads it).
    with initialise.recording() as initializers:  # What each weight's slices are drawn from.
      self.model = model = self.task.build_model(tensor_shards=self.plan.tensor_parallel,
                                                 seed=cfg.train.seed)
      chunks = self.plan.chunks
      embed_device = row[chunks[mine[0]][0]][0] if mine[0] == 0 else row[chunks[mine[-1]][0]][0]
      before = {id(v) for v in model.variables}
      if 0 in mine or (len(chunks) - 1 in mine and model.head_reads_embed):
        with tf.device(embed_device):
          model.build_embed()
      embed_ids = {id(v) for v in model.variables} - before
      for c in mine:
        k, blocks = chunks[c]
        for i in blocks:
          block = model.blocks[i]
          tensor.place_shards(block, row[k], jit_compile=cfg.train.jit_compile,
                              sequence_parallel=cfg.parallel.sequence_parallel)
          with tf.device(row[k][0]):
            block.build(model.block_shape)
      if len(chunks) - 1 in mine:
        with tf.device(row[chunks[-1][0]][0]):
          model.build_head()
      model.built = True
    self.variables = list(model.trainable_variables)
    # A tied embedding's gradient is summed between its two holders; the norm counts it once.
    self.shared = [i for i, v in enumerate(self.variables) if id(v) in embed_ids] \
        if self.first != self.last and model.head_reads_embed else []
    # Counted once: by copy 0, the embedding by its first stage.
    self.counted = [i for i in range(len(self.variables))
                    if self.copy == 0 and (i not in self.shared or me == self.first)]
    self.device = row[chunks[mine[0]][0]][0]
    sharding = cfg.parallel.optimizer_sharding
    with tf.device(self.device):
      self.optimizer = self.build_optimizer(self.variables, slots=sharding == "none")
    self.shard = self.copies.index(me)  # Which 1/D of this stage's state ZeRO keeps here.
    self.exchange = self._make_exchange() if len(self.copies) > 1 else None
    self.zero = None if sharding == "none" else self._plan_zero(sharding)
    self.clip_norm = cfg.optim.clip_norm or None
    inner_optimizer(self.optimizer).global_clipnorm = None  # Clipped by the replica's norm here.
    self.pipeline = Pipeline(model, stage_blocks=[blocks for _, blocks in chunks],
                             stage_devices=[row[k][0] for k, _ in chunks],
                             microbatches=self.plan.microbatches, loss_fn=self.task.loss,
                             eval_fn=self.task.eval_outputs, remat=self.plan.remat,
                             jit_compile=cfg.train.jit_compile,
                             schedule=schedules.make(self.plan.schedule, self.plan.virtual_stages))
    self.program = StageProgram(self.pipeline, chunk_workers, me, self.groups,
                                (tuple(model.block_shape[1:]), _compute_dtype()))
    self.program.accumulators(self.variables)  # Made before the step is traced.
    self.keys = self.program.keys
    self.buckets = self.program.buckets(self.variables, cfg.dist.all_reduce_pack_mb * 2**20)
    self._initialise(initializers)
    self._gathered = None
    self.layouts = [self._state_layout()]
    if me == 0 and cfg.train.model_dir:
      print(f"tfpar: {self.plan.format()}", flush=True)
      self.plan.write(cfg.train.model_dir, measured=self.measured_bytes())

  @property
  def input_strategy(self):
    return None  # Each worker iterates its copy's slice of the global batches (`_dataset`).

  def _dataset(self, split, start_step: int, shuffle: bool):
    """Copy d's slice d of D of every global batch, read by its first and last stages' workers
    (the first the inputs, the last the targets: a vision task's images are not read or
    decoded there); a middle stage's worker, whose units take activations, reads nothing:
    zeros of the batch's shape."""
    d = self.num_replicas
    ctx = tf.distribute.InputContext(d, self.copy, d)
    shard = pipeline.shard_for_pipeline(ctx, self.cfg.train.global_batch_size)
    ds = self.task.dataset(split, shard, start_step=start_step, shuffle=shuffle,
                           inputs=self.worker_index == self.first)
    if self.worker_index in (self.first, self.last):
      return ds
    return tf.data.Dataset.from_tensors(tf.nest.map_structure(
        lambda s: tf.zeros(s.shape, s.dtype), ds.element_spec)).repeat()

  def _initialise(self, initializers):
    """This worker's weights, each slice made on its own as one device makes it
    (tfpar.training.initialise), and the whole model's canonical entries (names, shapes and
    dtypes: the checkpoint's) from a template whose weights have no storage."""
    initialise.initialise(layout_slices(model_layout(self.model)), self.cfg.train.seed,
                          initializers)
    reference = zero3.build_template(lambda: build_model(self.cfg, task=self.task,
                                                         initialised=False))
    self.parameters = int(sum(np.prod(v.shape) for v in reference.trainable_variables))
    self._template = reference  # Its head's outputs' shapes: the eval outputs' (`_eval_specs`).
    entries = {name: (tuple(int(n) for n in shards[0].shape), tf.as_dtype(shards[0].dtype))
               for name, (_, shards) in model_layout(reference).items()}
    for name in model_layout(reference, slots=lambda v: (v, v)):  # AdamW's m and v of each weight
      entries.setdefault(name, (entries[name.split("@")[0]][0], tf.float32))
    self._entries = dict(sorted(entries.items()))

  def _make_exchange(self):
    """The gradient exchange among this stage's copies (a codec's state for this worker's
    weights, PowerSGD's first Q each as the whole model's exchange draws it)."""
    compression, first_q = self.cfg.compression, None
    if compression.method == "powersgd":
      # Where each of this worker's weights lies among the whole model's (the order the
      # draws, the checkpoint's flat entries and every other plan follow).
      template = zero3.build_template(lambda: build_model(
          self.cfg, tensor_shards=self.plan.tensor_parallel, task=self.task, initialised=False))
      shapes = [tuple(int(n) for n in v.shape) for v in template.trainable_variables]
      where = {path: i for i, path in enumerate(_paths(template))}
      self._in_model = [where[path] for path in _paths(self.model)]
      q0 = initial_q(shapes, compression, self.cfg.train.seed)
      first_q = {i: q0[g] for i, g in enumerate(self._in_model) if g in q0}
      self._flat_offsets = _offsets(shapes, sorted(q0), compression.rank)
    return make_exchange(compression, self.variables, num_replicas=len(self.copies),
                         state_devices=[[v.value.device for v in self.variables]],
                         seed=self.cfg.train.seed, first_q=first_q)

  def _compression_slices(self) -> tuple:
    """(the Slices held, those written) of PowerSGD's state: this worker's matrices' parts of
    the canonical flat entries (tfpar.parallel.exchange_state), its residuals in its copy's
    row. Each copy writes its residuals and copy 0 the Qs (the same in every copy); the tied
    embedding's, the first stage."""
    if self.exchange is None or self.exchange.method != "powersgd":
      return [], []
    (q_total, q_at), (e_total, e_at) = self._flat_offsets
    held, written = [], []
    for i in sorted(self.exchange.q[0]):
      g = self._in_model[i]
      n, m = int(np.prod(self.exchange.q[0][i].shape)), int(np.prod(self.exchange.error[0][i].shape))
      q = Slice("compression/powersgd@q", (q_total,), (q_at[g],), (n,),
                _Reshaped(self.exchange.q[0][i], (n,)))
      e = Slice("compression/powersgd@error", (self.num_replicas, e_total),
                (self.copy, e_at[g]), (1, m), _Reshaped(self.exchange.error[0][i], (1, m)))
      held += [q, e]
      if i not in self.shared or self.worker_index == self.first:
        written += [q, e] if self.copy == 0 else [e]
    return held, written

  def _plan_zero(self, mode: str) -> zero.PlanZero:
    """ZeRO among this stage's D copies (tfpar.parallel.zero.PlanZero's shards and AdamW on
    a shard): one position per device, the tied embedding a position of its own (its
    gradient is counted in the norm by the first stage only)."""
    rest = [i for i in range(len(self.variables)) if i not in self.shared]
    groups = list(collectives.by_device([self.variables[i].value.device for i in rest]).values())
    groups = [[rest[j] for j in g] for g in groups] + ([list(self.shared)] if self.shared else [])
    plan = zero.PlanZero([self.optimizer], [self.variables], mode=mode, shard_ids=[self.shard],
                         num_replicas=len(self.copies), groups=groups, gather=self._gather_slot,
                         jit_compile=self.cfg.train.jit_compile)
    # Each shard's m and v: its own instance key among the copies at a save.
    self._slot_keys = {id(getattr(s, name)): 2 * g + (name == "v")
                       for g, u in enumerate(plan.updates) for s in u.shards for name in "mv"}
    return plan

  def _gather_slot(self, shard) -> tf.Tensor:
    """A ZeRO slot's [D * S] from the shard held here and its copies' (at a save)."""
    return self._gather_slot_fn(tf.convert_to_tensor(shard), SLOT_KEYS + self._slot_keys[id(shard)])

  @tf.function
  def _gather_slot_fn(self, shard, key: int):
    with tf.device(self.device):
      among = p2p.Among(self.groups, self.copies, self.keys.extra(key))
      return among.all_gather([shard], self.shard)[0]

  # --- the step -----------------------------------------------------------------
  def _replica_step(self, inputs, targets, compressed):
    loss, grads = self.program.loss_and_grads(inputs, targets, self.variables)
    me = self.worker_index
    with tf.device(self.device):
      if self.shared and me in (self.first, self.last):
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in self.shared], 0)
        summed = self.groups.sum(flat, [self.first, self.last], self.keys.extra(0))
        parts = tf.split(summed, [self.variables[i].shape.num_elements() for i in self.shared])
        for i, part in zip(self.shared, parts):
          grads[i] = tf.reshape(part, self.variables[i].shape)
      # Sums among this stage's copies: the exchange's (plain or a codec's) and ZeRO's, each
      # bucket's as soon as the backward has finished it (zero2's chunk by chunk instead).
      among = p2p.Among(self.groups, self.copies,
                        self.keys.extra(COMPRESSED_KEYS if compressed else COPY_KEYS),
                        [v.value.device for v in self.variables],
                        () if self.zero and self.zero.mode == "zero2" else self.buckets)
      if self.zero:
        return self._zero_step(loss, grads, among, compressed)
      if self.exchange is not None:
        grads = self.exchange.reduce_among(grads, among, compressed)
      loss, norm = self._loss_and_norm(loss, [grads[i] for i in self.counted])
      factor = clip_factor(norm, self.clip_norm) if self.clip_norm else None
    apply_or_skip(self.optimizer, grads, self.variables, norm, in_order=True, scale=factor,
                  skip_nonfinite=self.cfg.train.on_nonfinite == "skip")
    return loss, norm

  def _loss_and_norm(self, loss, counted, squares=()):
    """(the step's loss, the whole gradient's norm): one SUM over the job of this worker's
    loss share and the squares of its `counted` gradients (and `squares`)."""
    squares = [tf.reduce_sum(tf.square(g)) for g in counted] + list(squares)
    stats = self.groups.sum(tf.stack([tf.cast(loss, tf.float32),
                                      tf.add_n(squares) if squares else tf.zeros([])]),
                            self.members, self.keys.extra(1))
    return stats[0], tf.sqrt(stats[1])

  def _zero_step(self, loss, grads, among, compressed):
    """ZeRO-1/2 among this stage's copies: zero1 sums the gradient whole (through the
    exchange, a codec's too), zero2 chunk by chunk keeping its own (zero.reduce_scatter);
    each copy updates its shard of every position, then one all-gather brings every
    copy's new shards into its weights."""
    z, shard = self.zero, self.shard
    devices = [zero.variable_device(self.variables[g[0]]) for g in z.groups]
    layouts = [u.layout for u in z.updates]
    step = tf.convert_to_tensor(self.optimizer.iterations)
    counted = [g for g, group in enumerate(z.groups)
               if self.copy == 0 and (self.worker_index == self.first or group != self.shared)]
    if z.mode == "zero1":
      summed = self.exchange.reduce_among(grads, among, compressed) if self.exchange else grads
      loss, norm = self._loss_and_norm(loss, [summed[i] for i in self.counted])
      mine = []
      for layout, group, device in zip(layouts, z.groups, devices):
        with tf.device(device):
          mine.append(layout.slice([summed[i] for i in group], shard))
    else:
      mine, squares = [None] * len(z.groups), []
      # Every copy makes the same calls (their collectives pair up by key): the tied
      # embedding's position apart, as only some workers count its squares.
      parts = [[g for g, group in enumerate(z.groups) if group != self.shared]]
      parts += [[g for g, group in enumerate(z.groups) if group == self.shared]]
      for part in (p for p in parts if p):
        kept, part_norm = zero.reduce_scatter(
            [layouts[g] for g in part], [[grads[i] for i in z.groups[g]] for g in part],
            shard, [devices[g] for g in part], ops=among)
        for g, k in zip(part, kept):
          mine[g] = k
        if set(part) <= set(counted):
          squares.append(tf.square(part_norm))
      if self.exchange is not None:
        zero.count_scatter(self.exchange, layouts, compressed)
      loss, norm = self._loss_and_norm(loss, [], squares)
    skip = self.cfg.train.on_nonfinite == "skip"
    new = []
    for update, device, summed_shard in zip(z.updates, devices, mine):
      with tf.device(device):
        new.append(update.update_shard(0, summed_shard, norm, step, skip))
    for update, group, device, flat in zip(z.updates, z.groups, devices,
                                           among.all_gather(new, shard)):
      with tf.device(device):
        for i, value in zip(group, update.layout.unflatten(flat)):
          self.variables[i].assign(value)
    self.optimizer.iterations.assign_add(1)
    return loss, norm

  def _eval_batch(self, iterator):
    """The global batch's eval outputs on every worker: one SUM over the job per output of
    what copy d's last stage computed (its loss share; a per-example tensor as row d of a
    [D, rows, ...] buffer, zeros elsewhere, then [D x rows, ...]: the copies in order)."""
    inputs, targets = next(iterator)
    outputs, last = self.program.eval_outputs(inputs, targets)
    specs = self._eval_specs(targets)
    out = {}
    # Elsewhere than on the last stage `outputs` is a zero that waits for the sends: kept.
    with tf.device(self.device), tf.control_dependencies(tf.nest.flatten(outputs)):
      for i, (name, spec) in enumerate(sorted(specs.items())):
        value = outputs[name] if last else tf.zeros(spec.shape, spec.dtype)
        if spec.shape.rank:  # Row `copy` of [D, rows, ...].
          value = tf.pad(value[None], [[self.copy, self.num_replicas - 1 - self.copy]] +
                         [[0, 0]] * spec.shape.rank)
        value = self.groups.sum(value, self.members, self.keys.extra(EVAL_KEYS + i))
        out[name] = tf.reshape(value, [-1, *spec.shape[1:]]) if spec.shape.rank else value
    return out

  def _eval_specs(self, targets) -> Dict[str, tf.TensorSpec]:
    """The last stage's eval outputs' shapes and dtypes of one copy's batch, on any worker:
    the task's `eval_outputs` of the head traced on the model's template (no weights)."""
    rows = int(tf.nest.flatten(targets)[0].shape[0])
    h = tf.TensorSpec([rows, *self.model.block_shape[1:]], _compute_dtype())
    y = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), targets)
    head = self._template.head
    traced = tf.function(lambda h, y: self.task.eval_outputs(head(h), y)).get_concrete_function(
        h, y).structured_outputs
    return {name: tf.TensorSpec(t.shape, t.dtype) for name, t in traced.items()}

  def train(self, iterator, num_steps: int):
    self._gathered = None  # The weights move: a save gathers them again.
    return super().train(iterator, num_steps)

  # --- state --------------------------------------------------------------------
  def _own_layout(self) -> Dict:
    return model_layout(self.model, self.optimizer,
                        self.zero.checkpoint_slots if self.zero else None)

  def _state_layout(self) -> Dict:
    """Every canonical entry at full shape, as a view (`_Entry`) that assigns this worker's
    part of a full value (--init_from); of the integer entries it also reads the job's value."""
    own = self._own_layout()
    self._entries["optimizer/iterations"] = ((), tf.int64)
    return {name: (None, [_Entry(self, name, shape, dtype, own.get(name))])
            for name, (shape, dtype) in self._entries.items()}

  def checkpointer(self, directory: str, **kwargs) -> CanonicalCheckpointer:
    """Each worker writes the slices it holds and contributes (`_contributes`: copy 0's, the
    embedding by its first stage) and restores every slice it holds; no worker gathers a
    weight or slot. The chief writes the step and the dropout RNG states (`gathered`: the
    job's value of each, a collective every worker joins at each save)."""
    own = self._own_layout()
    state, compression = self._compression_slices()
    mine = layout_slices(own)
    floats = [p for p in mine if tf.as_dtype(p.variable.dtype).is_floating]
    views = [p for p in layout_slices(self.layouts[0]) if p.name in self._rng_entries()]
    step = [p for p in mine if p.name == "optimizer/iterations"]
    is_chief = kwargs.get("is_chief", True)
    # ZeRO's m and v, read at full shape by copy 0 from every copy's shard (a collective
    # among the stage's copies that the others join); every worker reads the RNG states
    # (a collective over the job) first.
    slots = [p for p in floats if isinstance(p.variable, zero.SlotView)
             and self._contributes(p.name, own, any_copy=True)]
    return CanonicalCheckpointer(
        self.layouts, directory, held=mine + state,
        write=(step + views if is_chief else [])
        + [p for p in floats if self._contributes(p.name, own)] + compression,
        joined=[] if is_chief else views + ([] if self.copy == 0 else slots),
        writers=len(self.members), **kwargs)

  def _rng_entries(self) -> List[str]:
    """The integer entries other than the step (the dropout layers' RNG states), which each
    worker holds but only the worker running the layer advances."""
    return [name for name, (_, dtype) in self._entries.items()
            if not dtype.is_floating and name != "optimizer/iterations"]

  def _contributes(self, name: str, own, any_copy: bool = False) -> bool:
    """Whether this worker's value of entry `name` is the one saved: copy 0's (or, with
    `any_copy`, whether copy 0's is), and of the embedding (held by the first and the last
    stage) the first stage's."""
    if name not in own or (self.copy != 0 and not any_copy):
      return False
    return self.worker_index == self.first or not self._is_shared(name, own)

  def _is_shared(self, name: str, own) -> bool:
    ids = {id(self.variables[i]) for i in self.shared}
    base = own.get(name.split("@")[0])
    return base is not None and any(id(v) in ids for v in base[1])

  def gathered(self) -> Dict[str, np.ndarray]:
    """The job's value of each dropout RNG state (`_rng_entries`: one collective per entry,
    every worker calls this at the same save)."""
    if self._gathered is None:
      self._gathered = {k: v.numpy() for k, v in self._gather().items()}
    return self._gathered

  @tf.function
  def _gather(self):
    """Each RNG state: the largest value held (the worker running the layer advanced it)."""
    own, out, wanted = self._own_layout(), {}, set(self._rng_entries())
    with tf.device(self.device):
      for i, (name, (shape, dtype)) in enumerate(self._entries.items()):
        if name not in wanted:
          continue
        if name in own:
          axis, shards = own[name]
          parts = [tf.convert_to_tensor(getattr(v, "value", v)) for v in shards]
          value = parts[0] if len(parts) == 1 else tf.concat(parts, axis)
        else:
          value = tf.fill(shape, dtype.min)
        out[name] = self.groups.max(value, self.members, self.keys.extra(4 + i))
    return out

  def measured_bytes(self) -> dict:
    return measured_bytes([self], self.zero.slot_variables() if self.zero else ())

  def memory_devices(self):
    return sorted({v.value.device for v in self.model.variables})

  def predicted_memory(self):
    return predicted_memory(self.plan, self.memory_devices())

  def describe(self) -> dict:
    p = self.plan
    return {"strategy": f"one program per worker, stages {p.stage_workers[self.copy]}",
            "replicas": p.data_parallel,
            "plan": f"D={p.data_parallel} x K={p.pipeline_stages} x T={p.tensor_parallel}, M={p.microbatches}, "
                    f"{p.schedule}{f' v={p.virtual_stages}' if p.virtual_stages > 1 else ''}, "
                    f"bubble {p.bubble:.1%}, remat {p.remat}, "
                    f"xla {'per stage/shard' if self.cfg.train.jit_compile else 'off'}"
                    f"{f', optimizer {self.zero.mode}' if self.zero else ''}"
                    f"{f', {self.exchange.method}' if self.exchange and self.exchange.method != 'none' else ''}",
            "parameters": self.parameters,
            "measured_bytes_per_device": {
                dev: f"params {plan_lib.kib(b['parameters'])} + "
                     f"optimizer {plan_lib.kib(b['optimizer'])}"
                for dev, b in self.measured_bytes().items()}}


def _paths(model) -> List[str]:
  """Each trainable weight's path inside `model`."""
  return [relative_path(model, v) for v in model.trainable_variables]


def _offsets(shapes, compressed: List[int], rank: int):
  """((Q's length, {i: offset}), (a residual row's length, {i: offset})) of the compressed
  matrices `compressed` of a model of `shapes` in the flat entries (tfpar.parallel.
  exchange_state): each Q n x R, each residual m x n, in variable order."""
  out = []
  for size in (lambda m, n: n * rank, lambda m, n: m * n):
    at, total = {}, 0
    for i in compressed:
      at[i], total = total, total + size(*matrix_shape(shapes[i]))
    out.append((total, at))
  return tuple(out)


class _Reshaped:
  """A variable seen at another shape: a checkpoint slice of a flat entry."""

  def __init__(self, variable, shape):
    self.variable, self.shape, self.dtype = variable, tuple(shape), variable.dtype

  @property
  def value(self):
    return tf.reshape(self.variable.read_value(), self.shape)

  def assign(self, value) -> None:
    self.variable.assign(tf.reshape(value, self.variable.shape))


def _compute_dtype():
  import keras  # pylint: disable=import-outside-toplevel
  return tf.as_dtype(keras.mixed_precision.global_policy().compute_dtype)


class _Entry:
  """One canonical entry at full shape: assigned to this worker's variable (if it holds it);
  an RNG state's is read from the job's (`StageWorkerEngine.gathered`)."""

  def __init__(self, engine: StageWorkerEngine, name: str, shape, dtype, own):
    self.engine, self.name, self.shape, self.dtype, self.own = engine, name, tuple(shape), dtype, own

  @property
  def value(self):
    return self.engine.gathered()[self.name]  # The RNG states only (`_rng_entries`).

  def assign(self, value) -> None:
    self.engine._gathered = None  # pylint: disable=protected-access
    if self.own is None:
      return
    axis, shards = self.own
    parts = [value] if len(shards) == 1 else np.split(value, len(shards), axis=axis)
    for var, part in zip(shards, parts):
      var.assign(part)


__all__: List[str] = ["StageWorkerEngine"]
