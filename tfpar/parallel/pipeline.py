"""Pipeline parallelism: a model copy's stages over micro-batches, in one tf.function graph.

K stages hold contiguous blocks (stage 0 also the embedding, stage K-1 the
head and the loss; see tfpar.layout.placement). A replica's batch of B sequences
is cut into M micro-batches of B/M. A `Pipeline` is the forward of each
micro-batch through the stages, every stage's ops placed on its device
(`tf.device`; activations move between stages by send/recv); the order in
which micro-batches run forward and backward, and so the bubble and the
activations each stage keeps, is the schedule's (tfpar.parallel.schedules:
GPipe, 1F1B, interleaved 1F1B). Under the interleaved schedule the pipeline's
"stages" are the plan's v K chunks, chunk c on device c mod K.

Gradient accumulation: the step's loss is the sum of the M micro-batch losses,
each already divided by the GLOBAL batch's count (the task's loss, tfpar.tasks.task),
so the gradient of that sum is the sum of the micro-batch gradients (one AddN
per variable, on its device) and equals the full-batch gradient. One optimizer
update follows, after the data-parallel reduction (tfpar.engines.model_parallel).

Memory: GPipe keeps every micro-batch's activations until its backward (1F1B
at most K of them, see tfpar.parallel.schedules); with
--remat (full) each block keeps only its input and recomputes the rest in the
backward pass (tf.recompute_grad), about one extra forward of compute; with
--remat=selective only each attention's core softmax(QK^T/sqrt(d))V is
recomputed (tfpar.layers.attention), dropping its O(S^2) scores and
probabilities for a few % more compute.

XLA: a compiled cluster lives on one device and this step spans K x T, so
under --jit_compile each stage's forward of one micro-batch is ONE XLA
program, `tf.function(jit_compile=True)` called under the stage's device.
tf.gradients differentiates a call of a compiled function into a call of a
compiled forward (which also returns the intermediates the backward needs)
and a call of a compiled backward, placed with the forward: so F(k, m) and
B(k, m) each run compiled on stage k's device, and the send/recv between
stages and the gradient sums over micro-batches run outside, as the
schedule's diagram shows (tfpar.parallel.schedules). A stage of tensor-parallel blocks spans T devices: there each shard's
attention and MLP is the compiled unit (tfpar.parallel.tensor), and the
stage's embedding and head are compiled alone.
"""

from typing import Sequence

import keras
import tensorflow as tf

from tfpar.layers.attention import recompute_cores
from tfpar.layers.parallel import whole_sequence
from tfpar.models.base import ParallelModel
from tfpar.layout import placement as plan_lib
from tfpar.parallel import schedules
from tfpar.parallel.collectives import combine_outputs
from tfpar.config.schema import REMAT, remat_mode


class Pipeline:
  """The micro-batched forward and backward of one model copy over its stages.

  Args:
    model: a task's model (tfpar.models.base.ParallelModel: embed, blocks,
      head) whose weights already live on their stages' devices.
    stage_blocks: block indices of each stage, e.g. [(0, 1), (2, 3)] (of
      each chunk, in pipeline order, under the interleaved schedule).
    stage_devices: each stage's (chunk's) first device (its residual stream
      and unsplit weights); tensor shards are placed by tfpar.parallel.tensor.
    microbatches: M.
    loss_fn: (outputs, targets) -> a share of the GLOBAL mean loss (the task's `loss`).
    eval_fn: (outputs, targets) -> dict of eval outputs (the task's `eval_outputs`).
    remat: what blocks recompute in the backward pass: "none", "full" (each
      block's activations) or "selective" (each attention's core); True and
      False (as before the three modes) mean full and none.
    schedule: the order of forwards and backwards (default: GPipe).
  """

  def __init__(self, model: ParallelModel, *, stage_blocks: Sequence[Sequence[int]],
               stage_devices: Sequence[str], microbatches: int, loss_fn, eval_fn=None,
               remat="none", jit_compile: bool = False,
               schedule: schedules.Schedule = None):
    self.model = model
    self.stage_blocks = [list(b) for b in stage_blocks]
    self.stage_devices = list(stage_devices)
    self.microbatches = microbatches
    self.loss_fn = loss_fn
    self.eval_fn = eval_fn
    self.remat = remat_mode(remat)
    if self.remat not in REMAT:
      raise ValueError(f"remat={remat!r}: one of {', '.join(REMAT)}")
    selective = self.remat == "selective"  # Only under a gradient tape does it change anything.
    if not recompute_cores(model, selective) and selective:
      raise ValueError("remat='selective': the model has no SelfAttention whose core to "
                       "recompute; use remat='full'")
    self.jit_compile = jit_compile
    self.schedule = schedule or schedules.GPipe()
    self._stages = {}

  def _block_fn(self, block, training):
    if self.remat == "full" and training:
      # One tensor in and out: a sequence-parallel block's slices are joined at its end.
      return tf.recompute_grad(lambda h: whole_sequence(block(h, training=training)))
    return lambda h: block(h, training=training)

  def _stage(self, k: int, training: bool, per_microbatch):
    """Stage k's forward of one micro-batch, (x or h, y) -> h (the last stage: its result).

    Under --jit_compile a stage whose blocks are not split is ONE XLA program;
    a stage of tensor-parallel blocks compiles its embedding and its head
    alone, and tfpar.parallel.tensor compiles each block's shards.
    """
    key = (k, training, per_microbatch)
    if key in self._stages:
      return self._stages[key]
    model, last = self.model, len(self.stage_devices) - 1
    pieces = []  # ((h, y) -> h, not a block?), in order
    if k == 0:
      pieces.append((lambda x, y: model.embed(x, training=training), True))  # [B/M, S, d]
    for i in self.stage_blocks[k]:
      pieces.append((lambda h, y, fn=self._block_fn(model.blocks[i], training): fn(h), False))
    if self.stage_blocks[k]:  # Sequence-parallel slices leave the stage joined, on its device.
      pieces.append((lambda h, y: whole_sequence(h), False))
    if k == last:
      pieces.append((lambda h, y: per_microbatch(model.head(h), y), True))
    jit = lambda fn: compile_on(fn, self.stage_devices[k], model.variables)
    if not self.jit_compile:
      fns = [fn for fn, _ in pieces]
    elif self.one_program(k):
      # One program, but the head (which may read a weight of another stage:
      # the tied embedding) apart, so its foreign weights bind only there.
      head = [jit(pieces.pop()[0])] if k == last else []
      fns = ([jit(_chain([fn for fn, _ in pieces]))] if pieces else []) + head
    else:  # Tensor-parallel blocks span devices: their shards are compiled one by one.
      fns = [jit(fn) if alone else fn for fn, alone in pieces]
    self._stages[key] = _chain(fns)
    return self._stages[key]

  def one_program(self, k: int) -> bool:
    """Whether stage k's blocks run as one XLA program (--jit_compile, none split): their
    gradients then come out of one op together."""
    return self.jit_compile and not any(self.model.blocks[i].tensor_shards > 1
                                        for i in self.stage_blocks[k])

  def _forward(self, inputs, targets, per_microbatch, training: bool):
    """per_microbatch(outputs, targets) of every micro-batch, on the last stage."""
    devices = self.stage_devices
    last = len(devices) - 1
    xs, ys = self.split(inputs), self.split(targets)  # M x [B/M, ...]
    results = []
    for x, y in zip(xs, ys):
      h = x
      for k, device in enumerate(devices):
        with tf.device(device):  # The activation h crosses to this stage here.
          h = self._stage(k, training, per_microbatch)(h, y if k == last else None)
      results.append(h)
    return results

  def chunk(self, k: int):
    """Stage (chunk) k's training forward of one micro-batch, (x or h, y) -> h (the last: its loss)."""
    return self._stage(k, True, self.loss_fn)

  def eval_chunk(self, k: int):
    """Stage (chunk) k's eval forward of one micro-batch (the last: its eval outputs)."""
    return self._stage(k, False, self.eval_fn)

  def split(self, batch) -> list:
    """A batch (a tensor or a nest of them, e.g. a dict of targets) as the M micro-batches."""
    return split_batch(batch, self.microbatches)

  def loss(self, inputs, targets, training: bool = False):
    """Sum over micro-batches of the task's loss: this replica's share of the global mean."""
    losses = self._forward(inputs, targets, self.loss_fn, training)
    with tf.device(self.stage_devices[-1]):
      return tf.add_n(losses)

  def eval_outputs(self, inputs, targets):
    """The task's eval outputs of this replica's batch (micro-batches combined)."""
    parts = self._forward(inputs, targets, self.eval_fn, training=False)
    with tf.device(self.stage_devices[-1]):
      return combine_outputs(parts)

  def loss_and_grads(self, inputs, targets):
    """(loss, gradients of model.trainable_variables), gradients on their variables' devices."""
    return self.schedule.loss_and_grads(self, inputs, targets)


def compile_on(fn, device: str, variables):
  """fn(h, y) as one XLA program (tf.function(jit_compile=True)) to run on `device`.

  A compiled program can only read variables on its own device. The weights
  fn reads from other devices (the head on the last stage reads the tied token
  embedding, which lives with the embedding on stage 0) come in as arguments,
  read where they live and sent over like any activation, and are bound to
  their variables inside by keras.StatelessScope; their gradients flow back
  through those reads.
  """
  traced = tf.function(fn)
  keras_variables = {id(v.value): v for v in variables}
  here = plan_lib.device_key(device)
  compiled = {}

  def call(h, y):
    if not compiled:  # The first call (at trace time) finds the foreign weights.
      read = traced.get_concrete_function(h, y).variables
      foreign = [keras_variables[id(v)] for v in read
                 if id(v) in keras_variables and plan_lib.device_key(v.device) != here]

      def bound(h, y, values):
        with keras.StatelessScope(state_mapping=list(zip(foreign, values))):
          return fn(h, y)

      compiled["fn"] = tf.function(bound if foreign else lambda h, y, values: fn(h, y),
                                   jit_compile=True)
      compiled["foreign"] = foreign
    values = []
    for v in compiled["foreign"]:
      with tf.device(v.value.device):
        values.append(tf.identity(v.value))
    return compiled["fn"](h, y, tuple(values))

  return call


def _chain(fns):
  """(h, y) -> fns[-1](...fns[1](fns[0](h, y), y)..., y)."""
  def chained(h, y):
    for fn in fns:
      h = fn(h, y)
    return h
  return fns[0] if len(fns) == 1 else chained


def split_batch(batch, m: int) -> list:
  """A batch (a tensor or a nest of them, e.g. a dict of targets) as m micro-batches."""
  parts = [tf.split(t, m) for t in tf.nest.flatten(batch)]
  return [tf.nest.pack_sequence_as(batch, [p[i] for p in parts]) for i in range(m)]
