"""Pipeline schedules: in which order a model copy's micro-batches run forward and backward.

A `Schedule` turns a `tfpar.parallel.pipeline.Pipeline` (the placed forward
of each micro-batch through its chunks of blocks) into one replica's loss and
gradients; the plan names it (`ParallelPlan.schedule`, --pipeline_schedule)
and `make` builds it. Every schedule computes the same sum of micro-batch
gradients (so the serial twins hold whatever the order); they differ in the
bubble and in how many micro-batches' activations a stage keeps at once.

GPipe (Huang et al. 2019). Stage k runs the forward F(k, m) of every
micro-batch m, then the backward B(k, m) in reverse:

        time ->
  dev 0 F00 F01 F02 F03                     B03 B02 B01 B00
  dev 1     F10 F11 F12 F13             B13 B12 B11 B10
  dev 2         F20 F21 F22 F23     B23 B22 B21 B20
  dev 3             F30 F31 F32 F33 B33 B32 B31 B30      (K=4, M=4)

Each stage works M forward + M backward slots out of M + K - 1 forward and
M + K - 1 backward slots, so the idle fraction, the bubble, is

  bubble = (K - 1) / (M + K - 1)        e.g. K=4, M=4: 3/7 = 43%; M=16: 3/19 = 16%

and it shrinks as M grows (at the cost of M smaller matmuls). Every
micro-batch's activations stay until its backward: M of them on every stage
(--remat keeps only each block's input). tfpar's GPipe keeps at most that
(below).

How GPipe runs: there is no hand-written timetable. The step is ONE graph in
which every micro-batch's stage-k ops are placed on stage k's device; the
backward comes from one `tf.gradients` of the summed loss, which places each
gradient op with its forward op (a GradientTape in a tf.function leaves them
unplaced). TensorFlow's executor runs any op whose inputs are ready, so F(1, 0)
runs while F(0, 1) does: the dataflow overlaps the stages as the diagram does,
the same dependencies, scheduled greedily. Nothing holds a backward back
until every forward has run: B(k, 0) may start as soon as F(K-1, 0) has
reached the loss, and each micro-batch's activations are freed by its
backward. So a stage holds at most M micro-batches' activations, and how
many it really holds depends on when the threads get to which op: at K=2,
M=8 a stage held 1.7 to 4.1 micro-batches' worth over three runs
(scripts/pipeline_memory.py). The plan predicts the bound, M
(tfpar.layout.schedule.BOUND: `held` is a bound).

1F1B (PipeDream-Flush, Narayanan et al. 2021). Stage k runs K - k - 1
warm-up forwards, then alternates one forward and one backward, then drains
the backwards (tfpar.layout.schedule's `order`; drawn by its `draw(4, 6)`, one slot per F or B):

  dev 0 F00 F01 F02 F03  .   .   .  B00 F04 B01 F05 B02  .  B03  .  B04  .  B05
  dev 1  .  F10 F11 F12  .   .  B10 F13 B11 F14 B12 F15 B13  .  B14  .  B15
  dev 2  .   .  F20 F21  .  B20 F22 B21 F23 B22 F24 B23 F25 B24  .  B25
  dev 3  .   .   .  F30 B30 F31 B31 F32 B32 F33 B33 F34 B34 F35 B35

The bubble is GPipe's, (K-1)/(M+K-1), but a micro-batch's activations are
freed by its backward as soon as the last stage is reached: stage k holds at
most K - k micro-batches' activations, not M, so M >> K costs no memory.

Interleaved 1F1B (Narayanan et al. 2021, section 2.2). The blocks are cut
into v K chunks ("virtual stages") of equal size; chunk c sits on device
c mod K, so each device holds v non-contiguous chunks and a micro-batch
passes every device v times. Micro-batches go in groups of K (M must be a
multiple of K); device k runs 2 (K - k - 1) + (v - 1) K warm-up forwards,
then alternates. Here "F21" is chunk 2 (device 0's second chunk) on
micro-batch 1, each slot a chunk, 1/v of a stage (`draw(2, 4, 2)`):

  dev 0 F00 F01 F20 F21 F02 B20 F03 B21 F22 B00 F23 B01  .  B22  .  B23 B02 B03
  dev 1  .  F10 F11 F30 B30 F31 B31 F12 B10 F13 B11 F32 B32 F33 B33 B12 B13

Each device works 2 v M slots of 1/v of a stage out of 2 (v M + K - 1): the
fill and drain shrink v times,

  bubble = (K - 1) / (v M + K - 1)      i.e. (K - 1)/(v M) of the useful time,

for v times as many activation sends. Device k holds up to 2 (K - k - 1) +
(v - 1) K + 1 chunks' activations, a little more than 1F1B's K - k stages
(tfpar.layout.schedule.in_flight).

How 1F1B and interleaved run: TensorFlow's executor is greedy, so the order
is imposed in the graph. Each chunk's forward of each micro-batch is built on
its own, and its backward is its own `tf.gradients` (of the chunk's output,
given the output gradient that came back from the next chunk, stopped at the
chunk's input), placed with its forward ops. Every F and B on a device waits
(a control dependency on the input, or on the incoming gradient) for the
device's previous F or B in `order`. Each weight's gradient is added to its
running sum over micro-batches, on the weight's device, before the device's
next F or B starts (without that wait Grappler folds the adds into one AddN
at the end, and all M gradients stay alive as under GPipe's one
tf.gradients). Each unit's ops sit in a name scope "F{c}_{m}" or "B{c}_{m}"
(a profile shows the order). The sum is GPipe's up to float rounding.
tfpar.layout.schedule's `timetable` simulates the orders (one slot per F or B, with the
dataflow's dependencies): it draws the diagrams above, finds the bubble the
formulas give, and would raise on an order that deadlocks.
"""

from typing import List

from tfpar.config.schema import ConfigError
from tfpar.layout.schedule import Unit, order, timetable

# TensorFlow is imported where a schedule builds ops, not here.


class Schedule:
  """How a pipeline's forwards and backwards are ordered (see the module docstring).

  Args:
    virtual_stages: v, chunks per device (interleaved only; 1 otherwise).
  """

  name = ""
  greedy = False  # Whether a device may run its units in any order their inputs allow.

  def __init__(self, virtual_stages: int = 1):
    self.virtual = virtual_stages

  def loss_and_grads(self, pipeline, inputs, targets):
    """(this replica's loss, dense gradients of pipeline.model.trainable_variables on their devices)."""
    raise NotImplementedError

  def order(self, stages: int, microbatches: int, device: int) -> List[Unit]:
    """Device `device`'s sequence of forwards and backwards (what each worker's own program
    runs when the devices are processes: tfpar.parallel.stage_program)."""
    return order(stages, microbatches, self.virtual, device)


class GPipe(Schedule):
  """Every forward, then every backward: one tf.gradients of the summed micro-batch losses."""

  name = "gpipe"
  greedy = True  # Its activations are every micro-batch's whatever the order.

  def order(self, stages: int, microbatches: int, device: int) -> List[Unit]:
    """Every forward, then the backwards in reverse: the diagram's order, in which stages in
    processes of their own build their units (tfpar.parallel.stage_program; over gRPC
    they then run greedily, as here, on NCCL in this order)."""
    del stages
    return ([("F", device, m) for m in range(microbatches)] +
            [("B", device, m) for m in reversed(range(microbatches))])

  def loss_and_grads(self, pipeline, inputs, targets):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    loss = pipeline.loss(inputs, targets, training=True)
    variables = pipeline.model.trainable_variables
    grads = tf.gradients(loss, variables)  # Each gradient op placed with its forward op.
    return loss, dense_on_devices(grads, variables)


class OneFOneB(Schedule):
  """Each chunk's F and B of each micro-batch built apart, in `order` on every device."""

  name = "1f1b"

  def loss_and_grads(self, pipeline, inputs, targets):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    chunks, variables = len(pipeline.stage_devices), pipeline.model.trainable_variables
    k_all = chunks // self.virtual
    xs, ys = pipeline.split(inputs), pipeline.split(targets)
    x, out, dx = {}, {}, {}  # (chunk, m) -> the chunk's input, its output, its input's gradient
    grads, losses, previous = [None] * len(variables), [], {}  # previous[device]: its last F or B
    for tick in zip(*timetable(k_all, len(xs), self.virtual)):
      for kind, c, m in filter(None, tick):
        with tf.device(pipeline.stage_devices[c]), tf.name_scope(f"{kind}{c}_{m}"), \
            tf.control_dependencies(previous.get(c % k_all, [])):
          if kind == "F":  # Waits for the device's previous unit: its input does.
            x[c, m] = tf.identity(xs[m] if c == 0 else out[c - 1, m])
            out[c, m] = pipeline.chunk(c)(x[c, m], ys[m] if c == chunks - 1 else None)
            done = [out[c, m]]
          else:  # Waits for the device's previous unit: its output gradient does.
            dy = tf.identity(tf.ones_like(out[c, m]) if c == chunks - 1 else dx[c + 1, m])
            wrt = ([x[c, m]] if c else []) + variables
            d = tf.gradients(out[c, m], wrt, grad_ys=dy, stop_gradients=[x[c, m]])
            if c:
              dx[c, m], d = d[0], d[1:]
            done = [dx[c, m]] if c else []
            for i, g in enumerate(d):  # Summed as they come, before the device's next unit
              if g is not None:  # (else Grappler makes the adds one AddN of all M at the end).
                with tf.device(variables[i].value.device):
                  g = tf.convert_to_tensor(g)
                  grads[i] = g if grads[i] is None else grads[i] + g
                done.append(grads[i])
        previous[c % k_all] = [t.op for t in done]
        if kind == "F" and c == chunks - 1:
          losses.append(out[c, m])
    with tf.device(pipeline.stage_devices[-1]):
      loss = tf.add_n(losses)
    return loss, dense_on_devices(grads, variables)


class Interleaved(OneFOneB):
  """1F1B over v chunks per device (the order's micro-batch groups of K)."""

  name = "interleaved"


SCHEDULES = {s.name: s for s in (GPipe, OneFOneB, Interleaved)}


def make(name: str, virtual_stages: int = 1) -> Schedule:
  """The schedule `name` names, over `virtual_stages` chunks per device."""
  if name not in SCHEDULES:
    raise ConfigError(f"pipeline schedule {name!r} is unknown: use {', '.join(SCHEDULES)}")
  return SCHEDULES[name](virtual_stages)


def dense_on_devices(grads, variables) -> list:
  """Dense gradients (embedding lookups give IndexedSlices), each pinned to its variable's device.

  The pin also gives every gradient a device name, which the data-parallel
  all-reduce needs to place its collective.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  out = []
  for g, v in zip(grads, variables):
    with tf.device(v.value.device):
      out.append(tf.zeros(v.shape, v.dtype) if g is None else tf.identity(tf.convert_to_tensor(g)))
  return out
