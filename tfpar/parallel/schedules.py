"""Pipeline schedules: in which order a model copy's micro-batches run forward and backward.

A `Schedule` turns a `tfpar.parallel.pipeline.Pipeline` (the placed forward
of each micro-batch through K stages) into one replica's loss and
gradients; the plan names it (`ParallelPlan.schedule`) and `make` builds it.
Every schedule computes the same sum of micro-batch gradients (so the serial
twins hold whatever the order); they differ in the bubble and in how many
micro-batches' activations a stage keeps at once. GPipe is the one today;
1F1B (PipeDream-Flush) and interleaved 1F1B (Narayanan et al. 2021) are
further `Schedule`s.

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
micro-batch's activations stay until its backward (--remat keeps only each
block's input).

How it runs: there is no hand-written timetable. The step is ONE graph in
which every micro-batch's stage-k ops are placed on stage k's device; the
backward comes from one `tf.gradients` of the summed loss, which places each
gradient op with its forward op (a GradientTape in a tf.function leaves them
unplaced). TensorFlow's executor runs any op whose inputs are ready, so F(1, 0)
runs while F(0, 1) does: the dataflow overlaps the stages as the diagram does,
the same dependencies, scheduled greedily.
"""

from tfpar.config import ConfigError

# TensorFlow is imported where a schedule builds ops, not here: the plan (and
# `python -m tfpar.plan`, before TensorFlow starts) reads a schedule's bubble.


class Schedule:
  """How a pipeline's forwards and backwards are ordered (see the module docstring)."""

  name = ""

  def bubble(self, stages: int, microbatches: int) -> float:
    """The idle fraction of each stage's step."""
    raise NotImplementedError

  def loss_and_grads(self, pipeline, inputs, targets):
    """(this replica's loss, dense gradients of pipeline.model.trainable_variables on their devices)."""
    raise NotImplementedError


class GPipe(Schedule):
  """Every forward, then every backward: one tf.gradients of the summed micro-batch losses."""

  name = "gpipe"

  def bubble(self, stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)

  def loss_and_grads(self, pipeline, inputs, targets):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    loss = pipeline.loss(inputs, targets, training=True)
    variables = pipeline.model.trainable_variables
    grads = tf.gradients(loss, variables)  # Each gradient op placed with its forward op.
    return loss, dense_on_devices(grads, variables)


SCHEDULES = {s.name: s for s in (GPipe,)}


def make(name: str) -> Schedule:
  """The schedule `name` names."""
  if name not in SCHEDULES:
    raise ConfigError(f"pipeline schedule {name!r} is unknown: use {', '.join(SCHEDULES)}")
  return SCHEDULES[name]()


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
