"""Pipeline parallelism: GPipe over micro-batches, in one tf.function graph.

K stages hold contiguous blocks (stage 0 also the embedding, stage K-1 the
head and the loss; see tfpar.parallel.plan). A replica's batch of B sequences
is cut into M micro-batches of B/M. Stage k runs the forward F(k, m) of every
micro-batch m, then the backward B(k, m) in reverse:

        time ->
  dev 0 F00 F01 F02 F03                     B03 B02 B01 B00
  dev 1     F10 F11 F12 F13             B13 B12 B11 B10
  dev 2         F20 F21 F22 F23     B23 B22 B21 B20
  dev 3             F30 F31 F32 F33 B33 B32 B31 B30      (K=4, M=4)

Each stage works M forward + M backward slots out of M + K - 1 forward and
M + K - 1 backward slots, so the idle fraction, the bubble, is

  bubble = (K - 1) / (M + K - 1)        e.g. K=4, M=4: 3/7 = 43%; M=16: 3/19 = 16%

and it shrinks as M grows (at the cost of M smaller matmuls).

How it runs: there is no hand-written timetable. The step is ONE graph in
which every micro-batch's stage-k ops are placed on stage k's device
(`tf.device`); the backward comes from `tf.gradients`, which places each
gradient op with its forward op (a GradientTape in a tf.function leaves them
unplaced). TensorFlow's executor runs any op whose inputs are ready, so F(1, 0)
runs while F(0, 1) does: the dataflow overlaps the stages as the diagram does,
the same dependencies, scheduled greedily. Activations move between stages by
send/recv.

Gradient accumulation: the step's loss is the sum of the M micro-batch losses,
each already divided by the GLOBAL batch's count (the task's loss, tfpar.tasks.task),
so the gradient of that sum is the sum of the micro-batch gradients (one AddN
per variable, on its device) and equals the full-batch gradient. One optimizer
update follows, after the data-parallel reduction (tfpar.parallel.hybrid).

Memory: GPipe keeps every micro-batch's activations until its backward; with
--remat each block keeps only its input and recomputes the rest in the
backward pass (tf.recompute_grad), about one extra forward of compute.

XLA: a compiled cluster lives on one device and this step spans K x T, so
under --jit_compile each stage's forward of one micro-batch is ONE XLA
program, `tf.function(jit_compile=True)` called under the stage's device.
tf.gradients differentiates a call of a compiled function into a call of a
compiled forward (which also returns the intermediates the backward needs)
and a call of a compiled backward, placed with the forward: so F(k, m) and
B(k, m) each run compiled on stage k's device, and the send/recv between
stages and the gradient sums over micro-batches run outside, as the diagram
shows. A stage of tensor-parallel blocks spans T devices: there each shard's
attention and MLP is the compiled unit (tfpar.parallel.tensor), and the
stage's embedding and head are compiled alone.
"""

from typing import List, Sequence

import keras
import tensorflow as tf

from tfpar.models.base import ParallelModel
from tfpar.parallel import plan as plan_lib
from tfpar.parallel.data_parallel import combine_outputs


class Pipeline:
  """The micro-batched forward and backward of one model copy over its stages.

  Args:
    model: a task's model (tfpar.models.base.ParallelModel: embed, blocks,
      head) whose weights already live on their stages' devices.
    stage_blocks: block indices of each stage, e.g. [(0, 1), (2, 3)].
    stage_devices: each stage's first device (its residual stream and
      unsplit weights); tensor shards are placed by tfpar.parallel.tensor.
    microbatches: M.
    loss_fn: (outputs, targets) -> a share of the GLOBAL mean loss (the task's `loss`).
    eval_fn: (outputs, targets) -> dict of eval outputs (the task's `eval_outputs`).
    remat: recompute each block's activations in the backward pass.
  """

  def __init__(self, model: ParallelModel, *, stage_blocks: Sequence[Sequence[int]],
               stage_devices: Sequence[str], microbatches: int, loss_fn, eval_fn=None,
               remat: bool = False, jit_compile: bool = False):
    self.model = model
    self.stage_blocks = [list(b) for b in stage_blocks]
    self.stage_devices = list(stage_devices)
    self.microbatches = microbatches
    self.loss_fn = loss_fn
    self.eval_fn = eval_fn
    self.remat = remat
    self.jit_compile = jit_compile
    self._stages = {}

  def _block_fn(self, block, training):
    fn = lambda h: block(h, training=training)
    return tf.recompute_grad(fn) if self.remat and training else fn

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
    if k == last:
      pieces.append((lambda h, y: per_microbatch(model.head(h), y), True))
    jit = lambda fn: compile_on(fn, self.stage_devices[k], model.variables)
    if not self.jit_compile:
      fns = [fn for fn, _ in pieces]
    elif not any(model.blocks[i].tensor_shards > 1 for i in self.stage_blocks[k]):
      # One program, but the head (which may read a weight of another stage:
      # the tied embedding) apart, so its foreign weights bind only there.
      head = [jit(pieces.pop()[0])] if k == last else []
      fns = ([jit(_chain([fn for fn, _ in pieces]))] if pieces else []) + head
    else:  # Tensor-parallel blocks span devices: their shards are compiled one by one.
      fns = [jit(fn) if alone else fn for fn, alone in pieces]
    self._stages[key] = _chain(fns)
    return self._stages[key]

  def _forward(self, inputs, targets, per_microbatch, training: bool):
    """per_microbatch(outputs, targets) of every micro-batch, on the last stage."""
    devices = self.stage_devices
    last = len(devices) - 1
    xs, ys = _split(inputs, self.microbatches), _split(targets, self.microbatches)  # M x [B/M, ...]
    results = []
    for x, y in zip(xs, ys):
      h = x
      for k, device in enumerate(devices):
        with tf.device(device):  # The activation h crosses to this stage here.
          h = self._stage(k, training, per_microbatch)(h, y if k == last else None)
      results.append(h)
    return results

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
    loss = self.loss(inputs, targets, training=True)
    variables = self.model.trainable_variables
    grads = tf.gradients(loss, variables)  # Each gradient op placed with its forward op.
    return loss, _dense(grads, variables)


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


def _split(batch, m: int) -> list:
  """A batch (a tensor or a nest of them, e.g. a dict of targets) as m micro-batches."""
  parts = [tf.split(t, m) for t in tf.nest.flatten(batch)]
  return [tf.nest.pack_sequence_as(batch, [p[i] for p in parts]) for i in range(m)]


def _dense(grads, variables) -> List[tf.Tensor]:
  """Dense gradients (embedding lookups give IndexedSlices), each pinned to its variable's device.

  The pin also gives every gradient a device name, which the data-parallel
  all-reduce needs to place its collective.
  """
  out = []
  for g, v in zip(grads, variables):
    with tf.device(v.value.device):
      out.append(tf.zeros(v.shape, v.dtype) if g is None else tf.identity(tf.convert_to_tensor(g)))
  return out
