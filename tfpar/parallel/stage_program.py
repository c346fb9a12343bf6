"""One worker's part of a pipeline step, when the stages are processes of their own.

Chunk c of a replica's pipeline (a stage, or under the interleaved schedule
one of its v chunks) runs on worker `chunk_workers[c]`. Every worker traces
the same timetable (tfpar.parallel.schedules: each device's `order`, replayed
slot by slot) and builds only its own units, in that order:

  F(c, m)  its input: the micro-batch (c = 0), chunk c-1's output where that
           runs here, else a `recv` from chunk c-1's worker under the key
           Keys.forward(c-1, m); its output is `send` on to chunk c+1's worker
           (key Keys.forward(c, m)) unless chunk c+1 runs here or c is last.
  B(c, m)  its output gradient: 1 for the last chunk's loss, chunk c+1's input
           gradient where that runs here, else a `recv` (Keys.backward(c, m));
           then `tf.gradients` of F(c, m)'s output given it, stopped at F(c, m)'s
           input: the backward split at the boundary; the input's gradient is
           sent back to chunk c-1's worker (Keys.backward(c-1, m)).

Both sides of a boundary build their halves of a transfer in the same global
order (the timetable's). Under 1F1B and interleaved each unit waits (a control
dependency) for the worker's previous unit: that order bounds the activations
a stage holds. GPipe holds every micro-batch's anyway, and its units run as
soon as their inputs exist, as GPipe does in one program (a free core takes
the next micro-batch's forward while the neighbouring stage's worker works
on another). The price: two backward units running at once each hold their
chunk's gradients before adding them (scripts/sharded_state_rss.py measures
it; 1F1B holds one unit's at a time). On NCCL, which needs every member to
post its collectives in one order, GPipe's units wait for each other too
(`ordered`). Over gRPC a receive is posted at once, whatever the unit before
it, so the data comes as soon as the peer sends it. A send is not waited
for: it completes when the peer receives, which under 1F1B may be after this
worker's next unit, and waiting for it there could deadlock two workers each
sending to the other. Collectives are matched by key, so nothing else can mix
them up.

Each weight's gradient is summed over the micro-batches as its B units come
(on its device, before the worker's next unit, as in one program's 1F1B), in
place: one accumulator variable per weight (`accumulators`, made before the
step is traced: a tf.function that makes variables is traced twice) takes
micro-batch m's gradient by assign (the first) or assign_add, so a step holds
the sum and only the gradients of the unit being added, never a second list
of sums; the additions are those of `a + b` in micro-batch order, the sums one
device computes. The gradients returned are reads of the accumulators.
The step's loss is the last chunk's sum over micro-batches (zero elsewhere).

Buckets (`buckets`): a block's gradient is final once the worker's last B unit
of its chunk has run, and within that unit the backward reaches the chunk's
blocks last to first. So the worker's weights fall into parts in the order
their gradients become final: for each of its chunks, by where the chunk's
last B unit comes, its blocks last to first (all in one part where the chunk
is one XLA program); then everything else (the token embedding, final once
the first chunk's backward is done and, tied, once its two holders have
summed it; the head's norm). Consecutive parts join one bucket until it
holds `cap` bytes (--all_reduce_pack_mb; 0: one bucket per part). The sum
among a stage's copies (p2p.Among) reduces each bucket as soon as its
gradients exist, while the backward of the blocks before them still runs.
"""

import contextlib
import math
from typing import Dict, List, Sequence

import tensorflow as tf

from tfpar.parallel import p2p, schedules
from tfpar.parallel.collectives import combine_outputs


class StageProgram:
  """Builds worker `me`'s units of one replica's pipeline step (see the module docstring).

  Args:
    pipeline: a tfpar.parallel.pipeline.Pipeline over every chunk of the
      replica, of which only this worker's chunks are built and called.
    chunk_workers: chunk c's worker (by index in the job).
    me: this worker.
    groups: the job's p2p.Groups.
    activation: (shape of one micro-batch's activation without its batch
      dimension, dtype): what crosses a boundary.
  """

  def __init__(self, pipeline, chunk_workers: Sequence[int], me: int, groups: p2p.Groups,
               activation):
    self.pipeline = pipeline
    self.chunk_workers = list(chunk_workers)
    self.me = me
    self.groups = groups
    self.activation_shape, self.activation_dtype = activation
    self.chunks = len(self.chunk_workers)
    self.mine = [c for c, w in enumerate(self.chunk_workers) if w == me]
    self.keys = p2p.Keys(self.chunks, pipeline.microbatches)
    self._sums = {}  # id(variable) -> its gradient's accumulator (module docstring)

  def _device(self, c: int) -> str:
    return self.pipeline.stage_devices[c]

  def _receive(self, c: int, m: int, rows: int, key: int, peer_chunk: int):
    shape = [rows] + list(self.activation_shape)
    # Over gRPC a receive is posted at once, whatever the unit before it (its transfer is
    # matched by key): the data comes as soon as the peer sends it. NCCL needs one order.
    with tf.device(self._device(c)), \
        (tf.control_dependencies(None) if self.groups.hint != "nccl" else contextlib.nullcontext()):
      return self.groups.recv(shape, self.activation_dtype, self.me,
                              self.chunk_workers[peer_chunk], key)

  def _send(self, tensor, c: int, key: int, peer_chunk: int):
    with tf.device(self._device(c)):
      return self.groups.send(tensor, self.me, self.chunk_workers[peer_chunk], key)

  def units(self) -> List[schedules.Unit]:
    """This worker's units, in the timetable's global order."""
    schedule = self.pipeline.schedule
    stages = self.chunks // schedule.virtual
    table = schedules.timetable(stages, self.pipeline.microbatches, schedule.virtual, schedule)
    return [u for tick in zip(*table) for u in tick if u is not None and u[1] in self.mine]

  def ordered(self) -> bool:
    """Whether each unit waits for the worker's previous one (the module docstring): under
    1F1B and interleaved (their order bounds the activations held) and on NCCL, which needs
    every member to post its collectives in one order; GPipe over gRPC, whose transfers are
    matched by key, runs its units as their inputs allow, as GPipe does in one program."""
    return not self.pipeline.schedule.greedy or self.groups.hint == "nccl"

  def buckets(self, variables, cap: float = 0) -> List[int]:
    """The bucket of each of `variables` (this worker's own), numbered in the order their
    gradients become final (the module docstring); `cap`: bytes a bucket fills up to."""
    units = self.units()
    last_b = {c: max(n for n, u in enumerate(units) if u[0] == "B" and u[1] == c)
              for c in self.mine}
    position = {id(v): i for i, v in enumerate(variables)}
    parts, seen = [], set()
    for c in sorted(self.mine, key=last_b.get):
      blocks = [[b] for b in reversed(self.pipeline.stage_blocks[c])]
      if self.pipeline.one_program(c):  # Its blocks' gradients come out together.
        blocks = [sum(blocks, [])]
      for part in blocks:
        part = [position[id(v)] for b in part
                for v in self.pipeline.model.blocks[b].trainable_variables if id(v) in position]
        parts.append(part)
        seen.update(part)
    parts.append([i for i in range(len(variables)) if i not in seen])
    out, bucket, filled = [0] * len(variables), 0, 0
    for part in (p for p in parts if p):
      if filled and filled >= cap:
        bucket, filled = bucket + 1, 0
      for i in part:
        out[i] = bucket
        filled += math.prod(variables[i].shape) * tf.as_dtype(variables[i].dtype).size
    return out

  def loss_and_grads(self, inputs, targets, variables) -> tuple:
    """(this worker's share of the loss: the last chunk's, else 0; dense gradients of
    `variables`, this worker's own, on their devices)."""
    pipe, last = self.pipeline, self.chunks - 1
    xs, ys = pipe.split(inputs), pipe.split(targets)
    rows = [int(x.shape[0]) for x in xs]
    x: Dict = {}
    out: Dict = {}
    dx: Dict = {}
    sums = self.accumulators(variables)
    added, losses, previous, sent = [False] * len(variables), [], {}, []
    ordered = self.ordered()
    for kind, c, m in self.units():
      device = self._device(c)
      with tf.device(device), tf.name_scope(f"{kind}{c}_{m}"), \
          tf.control_dependencies(previous.get(device, []) if ordered else []):
        if kind == "F":
          if c == 0:
            h = xs[m]
          elif (c - 1) in self.mine:
            h = out[c - 1, m]
          else:
            h = self._receive(c, m, rows[m], self.keys.forward(c - 1, m), c - 1)
          x[c, m] = tf.identity(h)
          out[c, m] = pipe.chunk(c)(x[c, m], ys[m] if c == last else None)
          if c < last and (c + 1) not in self.mine:
            sent.append(self._send(out[c, m], c, self.keys.forward(c, m), c + 1))
          if c == last:
            losses.append(out[c, m])
          done = [out[c, m]]
        else:
          if c == last:
            dy = tf.ones_like(out[c, m])
          elif (c + 1) in self.mine:
            dy = dx[c + 1, m]
          else:
            dy = self._receive(c, m, rows[m], self.keys.backward(c, m), c + 1)
          dy = tf.identity(dy)
          wrt = ([x[c, m]] if c else []) + list(variables)
          d = tf.gradients(out[c, m], wrt, grad_ys=dy, stop_gradients=[x[c, m]])
          if c:
            dx[c, m], d = d[0], d[1:]
            if (c - 1) not in self.mine:
              sent.append(self._send(dx[c, m], c, self.keys.backward(c - 1, m), c - 1))
          done = [dx[c, m]] if c else []
          for i, g in enumerate(d):  # Summed as they come, before the worker's next unit.
            if g is not None:
              with tf.device(variables[i].value.device):
                g = tf.convert_to_tensor(g)
                add = sums[i].assign_add if added[i] else sums[i].assign
                done.append(add(g, read_value=False))
              added[i] = True
      previous[device] = [getattr(t, "op", t) for t in done]
    # The step ends once its sends are received (a send nothing reads would be pruned).
    with tf.device(self._device(self.mine[-1])), tf.control_dependencies(sent):
      loss = tf.identity(tf.add_n(losses) if losses else tf.zeros([], tf.float32))
    grads = []
    for i, v in enumerate(variables):
      with tf.device(v.value.device):
        grads.append(sums[i].read_value() if added[i] else None)
    return loss, schedules.dense_on_devices(grads, variables)

  def accumulators(self, variables) -> list:
    """Each weight's gradient accumulator, on its device (made once; call it before tracing)."""
    for v in variables:
      if id(v) not in self._sums:
        with tf.init_scope(), tf.device(v.value.device):
          self._sums[id(v)] = tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                          name="gradient_sum")
    return [self._sums[id(v)] for v in variables]

  def eval_outputs(self, inputs, targets):
    """(the last chunk's eval outputs of the replica's batch, micro-batches combined, True), or
    ({"loss": 0}, False) on a worker without the last chunk; every forward in micro-batch order."""
    pipe, last = self.pipeline, self.chunks - 1
    xs, ys = pipe.split(inputs), pipe.split(targets)
    parts, out, previous, sent = [], {}, [], []
    for m in range(pipe.microbatches):
      for c in self.mine:
        with tf.device(self._device(c)), tf.control_dependencies(previous):
          if c == 0:
            h = xs[m]
          elif (c - 1) in self.mine:
            h = out[c - 1, m]
          else:
            h = self._receive(c, m, int(xs[m].shape[0]), self.keys.forward(c - 1, m), c - 1)
          out[c, m] = pipe.eval_chunk(c)(h, ys[m] if c == last else None)
          if c < last and (c + 1) not in self.mine:
            sent.append(self._send(out[c, m], c, self.keys.forward(c, m), c + 1))
          previous = tf.nest.flatten(out[c, m])
          if c == last:
            parts.append(out[c, m])
    if not parts:
      with tf.control_dependencies(sent):
        return {"loss": tf.zeros([])}, False
    with tf.device(self._device(last)), tf.control_dependencies(sent):
      return {k: tf.identity(v) for k, v in combine_outputs(parts).items()}, True
