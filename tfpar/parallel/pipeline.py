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

XLA: a compiled cluster lives on one device, and this step spans K x T, so it
runs without XLA whatever --jit_compile says (per-stage jit would compile each
stage's forward alone, but then its backward, built by tf.gradients around a
compiled call, is not; left for later).
"""

from typing import List, Sequence

import tensorflow as tf

from tfpar.parallel.data_parallel import combine_outputs


class Pipeline:
  """The micro-batched forward and backward of one model copy over its stages.

  Args:
    model: a task's model (embed, blocks, head) whose weights already live
      on their stages' devices.
    stage_blocks: block indices of each stage, e.g. [(0, 1), (2, 3)].
    stage_devices: each stage's first device (its residual stream and
      unsplit weights); tensor shards are placed by tfpar.parallel.tensor.
    microbatches: M.
    loss_fn: (outputs, targets) -> a share of the GLOBAL mean loss (the task's `loss`).
    eval_fn: (outputs, targets) -> dict of eval outputs (the task's `eval_outputs`).
    remat: recompute each block's activations in the backward pass.
  """

  def __init__(self, model, *, stage_blocks: Sequence[Sequence[int]],
               stage_devices: Sequence[str], microbatches: int, loss_fn, eval_fn=None,
               remat: bool = False):
    self.model = model
    self.stage_blocks = [list(b) for b in stage_blocks]
    self.stage_devices = list(stage_devices)
    self.microbatches = microbatches
    self.loss_fn = loss_fn
    self.eval_fn = eval_fn
    self.remat = remat

  def _block_fn(self, block, training):
    fn = lambda h: block(h, training=training)
    return tf.recompute_grad(fn) if self.remat and training else fn

  def _forward(self, inputs, targets, per_microbatch, training: bool):
    """per_microbatch(outputs, targets) of every micro-batch, on the last stage."""
    model, devices = self.model, self.stage_devices
    xs, ys = _split(inputs, self.microbatches), _split(targets, self.microbatches)  # M x [B/M, ...]
    results = []
    for x, y in zip(xs, ys):
      with tf.device(devices[0]):
        h = model.embed(x, training=training)  # [B/M, S, d]
      for device, blocks in zip(devices, self.stage_blocks):
        with tf.device(device):  # The activation h crosses to this stage here.
          for i in blocks:
            h = self._block_fn(model.blocks[i], training)(h)
      with tf.device(devices[-1]):
        results.append(per_microbatch(model.head(h), y))
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
