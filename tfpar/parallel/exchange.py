"""The gradient exchange: how data-parallel replicas combine their gradients.

R replicas each hold the whole model (or, under a model-parallel plan, the
same plan row) and a B = G/R slice of the global batch of G sequences. Each
replica's loss is already divided by the *global* count of labelled units
(tfpar.tasks.task), so its gradient g_r is its share of the mean gradient,
and the update uses

    g = sum_r g_r          (one SUM all-reduce over the R replicas)

which equals the gradient one device computes on the whole batch: the serial
twin. A `GradientExchange` is that step as an interface, in replica context:

    reduce(grads, replica, compressed) -> sum_r grads   (or an estimate of it)

`AllReduce` is the plain float32 SUM; the codecs of tfpar.parallel.compression
(fp16, bf16, PowerSGD) hand the collectives fewer bytes. Where the replicas
are worker processes each running its own stages (tfpar.engines.stage_worker),
`reduce_among(grads, ops)` does the same with the sums of `ops`
(tfpar.parallel.p2p.Among: collectives among a stage's workers). A ZeRO-style
distributed optimizer adds reduce-scatter (each replica keeps the sum of its
1/R of the gradient) and all-gather (the updated shards back to every replica)
beside `reduce`, over tfpar.parallel.collectives.

Every engine's step goes through one: the data-parallel TrainStep, the
hybrid engine's replicas (packed per device: `pack_by_device`) and the
parameter-server step (one replica: the identity). Each records the bytes it
handed to the collectives when traced (tfpar.parallel.traffic).

A codec may compress only after `warmup_steps` (PowerSGD: no residual builds
up in the first steps); `phases` splits a call of N steps into an
uncompressed and a compressed part, each its own trace (the choice is made
when tracing, not by a tf.cond around collectives).
"""

from typing import Dict, List, Optional

import tensorflow as tf

from tfpar.parallel import collectives
from tfpar.parallel.traffic import NONE, Traffic, nbytes


class GradientExchange:
  """SUMs gradients over the data-parallel replicas (see the module docstring).

  Args:
    variables: one replica's trainable variables (their shapes and devices).
    num_replicas: replicas in sync (all workers).
    state_devices: for each replica in this process, the device of each
      variable's gradient there: where a codec's state lives and, with
      `pack_by_device`, which pack it joins (default: one replica, each
      variable's own device).
    pack_by_device: concatenate the tensors of each device before reducing
      (tfpar.parallel.collectives).
  """

  method = "none"
  warmup_steps = 0
  needs_state_devices = False  # A codec with per-replica state on each gradient's device.

  def __init__(self, variables, *, num_replicas: int,
               state_devices: Optional[List[List[str]]] = None, pack_by_device: bool = False):
    self.num_replicas = num_replicas
    self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
    if state_devices is None and (pack_by_device or self.needs_state_devices):
      state_devices = [[getattr(v, "value", v).device for v in variables]]
    self.state_devices = state_devices
    self.pack_by_device = pack_by_device
    self.traffic: Dict[bool, Traffic] = {}  # compressed? -> bytes per step, set when traced.

  @property
  def stateful(self) -> bool:
    """Whether each local replica has its own state (then the engine says which replica runs)."""
    return False

  def compresses_at(self, step: int) -> bool:
    """Whether the step that starts at optimizer step `step` (0-based) is compressed."""
    return self.method != "none" and step >= self.warmup_steps

  def phases(self, step: int, num_steps: int):
    """[(steps, compressed)] for `num_steps` steps from `step`: warmup first, then compressed."""
    if self.compresses_at(step) or self.method == "none":
      return [(num_steps, self.compresses_at(step))]
    warm = min(num_steps, self.warmup_steps - step)
    return [(warm, False)] + ([(num_steps - warm, True)] if num_steps > warm else [])

  def step_traffic(self, step: int) -> Traffic:
    """Bytes one replica handed to the collectives in step `step` (1-based; once it ran)."""
    return self.traffic.get(self.compresses_at(step - 1), NONE)

  def reduce(self, grads: List[tf.Tensor], replica: int = 0,
             compressed: bool = True) -> List[tf.Tensor]:
    """Returns sum_r grads (or its compressed estimate); runs on each replica.

    Args:
      grads: this replica's dense gradients, one per variable.
      replica: which local replica this is (picks a codec's state).
      compressed: False during the warmup steps (plain float32 SUM).
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:  # Nothing to exchange.
      self.traffic[compressed] = NONE
      return list(grads)
    home = self.state_devices[replica] if self.state_devices else None
    return self._exchange([grads], [replica], InReplica(home, self.pack_by_device), compressed)

  def reduce_among(self, grads: List[tf.Tensor], ops, compressed: bool = True
                   ) -> List[tf.Tensor]:
    """`reduce` of this process's one replica, its sums made by `ops` (tfpar.parallel.p2p.
    Among: collectives among the workers that hold the same stage of every copy)."""
    return self._exchange([grads], [0], ops, compressed)

  def _dense(self, per_copy, replicas):
    """Each copy's gradients dense, with static shapes (a traced gradient's may be unknown):
    the bytes are counted from them."""
    return [[self.beside(r, i, lambda g=g, s=s: tf.ensure_shape(tf.convert_to_tensor(g), s))
             for i, (g, s) in enumerate(zip(grads, self.shapes))]
            for r, grads in zip(replicas, per_copy)]

  def _exchange(self, per_copy, replicas, ops, compressed):
    """The exchange of `per_copy` (the gradients of `replicas`), summed by `ops`."""
    per_copy = self._dense(per_copy, replicas)
    with tf.name_scope("grad_exchange"):  # What a profile (scripts/dp_profile.py) counts.
      if compressed and self.method != "none":
        out, handed = self._reduce(per_copy, list(replicas), ops)
      else:
        out, handed = ops.sum(per_copy, range(len(self.shapes))), [per_copy[0]]
    self.traffic[compressed] = Traffic(sum(nbytes(h) for h in handed), nbytes(per_copy[0]))
    return out

  def beside(self, replica: int, i: int, fn):
    """fn() placed beside replica `replica`'s gradient of variable i (where its state lives)."""
    if not self.state_devices:  # The replica's own device scope.
      return fn()
    with tf.device(self.state_devices[replica][i]):
      return fn()

  def _reduce(self, per_copy, replicas: List[int], ops):
    """(sum_r grads or its estimate, [the lists of tensors one replica handed to the collectives]).

    per_copy[c][i] is replica replicas[c]'s gradient of variable i: one
    replica (this one). `ops` sums over the replicas (InReplica, p2p.Among).
    """
    raise NotImplementedError

  def checkpoint_entries(self, strategy=None) -> dict:
    """Layout entries (tfpar.training.checkpoint) for the exchange's state: none by default."""
    del strategy
    return {}


class AllReduce(GradientExchange):
  """g = sum_r g_r in float32: the serial twin (the same sum one device computes)."""


def all_reduce_sum(grads: List[tf.Tensor], devices=None) -> List[tf.Tensor]:
  """SUMs each gradient over the replicas in sync (identity with one replica)."""
  return collectives.all_reduce(tf.distribute.ReduceOp.SUM, list(grads), devices)


class InReplica:
  """A codec's reductions from one replica's program: collectives over the replicas in sync.

  `sum(per_copy, indices)` and `peak(...)` take [this replica's tensors], tensor j
  belonging to variable indices[j]; `home` is the device of each variable's
  gradient here (packed by it when `pack`); `at(i)` places work on a sum.
  """

  def __init__(self, home: Optional[List[str]], pack: bool):
    self.home, self.pack = home, pack

  def _devices(self, indices):
    return [self.home[i] for i in indices] if self.pack else None

  def sum(self, per_copy, indices) -> List[tf.Tensor]:
    return all_reduce_sum(per_copy[0], self._devices(indices))

  def peak(self, per_copy, indices) -> List[tf.Tensor]:
    """The largest value over the replicas of each [1]-shaped tensor."""
    return collectives.all_max(per_copy[0], self._devices(indices))

  def at(self, i: int):
    return collectives.on_device(self.home[i] if self.home else None)
