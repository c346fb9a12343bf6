"""Collectives between the worker processes of one pipeline: point to point and among a few.

Each worker process runs its own program (tfpar.engines.stage_worker). What
crosses between two of them goes by TensorFlow's collective ops with explicit
group and instance keys, so any subset of the job's tasks can talk without the
rest:

  send / recv   CollectiveBcastSendV2 / CollectiveBcastRecvV2 in a group of 2:
                an activation to the next stage's worker, its gradient back;
  sum           CollectiveReduceV2 (SUM) among the workers of a group: the
                tied embedding's gradient between the first and the last stage,
                a stage's gradients over its D copies (`Among`: plain, through
                a codec, or chunk by chunk for ZeRO-2), the loss and the
                squared gradient norm over every stage, an eval batch's
                outputs over the job;
  gather        CollectiveGatherV2 among a stage's copies: ZeRO's updated
                weight shards, and its m and v shards at a save.

Keys. A group is a set of workers (by index in the job, chief first); its
`group_key` is fixed by that set alone, so every member computes the same one
without asking (`Groups.key`): the sets used are pairs (neighbouring stages,
the first and last stage), a stage's copies, and the whole job. Keys start at GROUP_BASE, far above the few that a
MultiWorkerMirroredStrategy hands out from 1 for its own collectives. Within
a group each transfer of a step has its own `instance_key`, the same on both
sides (`instance`): a step's ops may be pending at once and are matched by
key, not by arrival. A step traced once reuses its keys every step.

Setup. The ops need the process's collective executor configured for the
job, which creating a `tf.distribute.MultiWorkerMirroredStrategy` does (it
starts the task's server and names the group leader); the first op of a group
resolves the group through that leader. On GPUs `communication_hint="nccl"`
makes them NCCL's point-to-point and all-reduce kernels; on CPUs they go over
gRPC. No op has a timeout (`timeout_seconds`): TensorFlow would hold a thread
for each one launched, for the whole timeout (tfpar.strategies); a peer that
dies or freezes ends the step through the coordination service's heartbeats,
with an error naming its task.
"""

from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from tfpar.parallel import collectives

GROUP_BASE = 1 << 20  # Above MultiWorkerMirroredStrategy's own group keys (1, 2, ...).


class Groups:
  """Group keys of sets of workers, the same on every worker of a job of `num_workers`."""

  def __init__(self, num_workers: int, *, gpu: bool = False):
    self.num_workers = num_workers
    self.hint = "nccl" if gpu else "auto"

  def key(self, members: Sequence[int]) -> int:
    """A set's key: a pair (a < b) a * N + b, the whole job one key, any other set (a stage's
    copies: each worker is in one such set) its first member's; all above GROUP_BASE and
    within an int32 for N up to 46,000 workers."""
    members = sorted(set(members))
    n = self.num_workers
    if not members or members[0] < 0 or members[-1] >= n:
      raise ValueError(f"workers {members} are not all in a job of {n}")
    if len(members) == 2:
      return GROUP_BASE + members[0] * n + members[1]
    if len(members) == n:
      return GROUP_BASE + n * n
    return GROUP_BASE + n * n + 1 + members[0]

  def send(self, tensor: tf.Tensor, me: int, peer: int, instance: int) -> tf.Operation:
    """Sends `tensor` to worker `peer` (who calls `recv` with the same `instance`)."""
    if tensor.dtype == tf.bfloat16:  # Not a type the op takes: its 16 bits as float16's.
      tensor = tf.bitcast(tensor, tf.float16)
    return tf.raw_ops.CollectiveBcastSendV2(
        input=tensor, group_size=2, group_key=self.key((me, peer)), instance_key=instance,
        communication_hint=self.hint)

  def recv(self, shape, dtype, me: int, peer: int, instance: int) -> tf.Tensor:
    """What worker `peer` sends with the same `instance` (its shape and dtype known here)."""
    wire = tf.float16 if dtype == tf.bfloat16 else dtype
    out = tf.raw_ops.CollectiveBcastRecvV2(
        group_size=2, group_key=self.key((me, peer)), instance_key=instance,
        shape=tf.constant(list(shape), tf.int32), T=wire, communication_hint=self.hint)
    return tf.bitcast(out, dtype) if wire != dtype else out

  def sum(self, tensor: tf.Tensor, members: Sequence[int], instance: int) -> tf.Tensor:
    """The SUM of `tensor` over the workers `members` (every one of them calls it)."""
    return self._reduce(tensor, members, instance, "Add")

  def max(self, tensor: tf.Tensor, members: Sequence[int], instance: int) -> tf.Tensor:
    """The elementwise largest `tensor` over the workers `members`."""
    return self._reduce(tensor, members, instance, "Max")

  def gather(self, tensor: tf.Tensor, members: Sequence[int], instance: int) -> tf.Tensor:
    """Every member's `tensor` concatenated along axis 0 (CollectiveGatherV2), in the group's
    rank order: a caller that needs another order sends its position along."""
    members = sorted(set(members))
    if len(members) == 1:
      return tf.identity(tensor)
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=len(members), group_key=self.key(members),
        instance_key=instance, ordering_token=[], communication_hint=self.hint)

  def _reduce(self, tensor, members, instance, merge_op):
    """A bfloat16 or float16 tensor is reduced in float32 and rounded back (of two members,
    the narrow sum itself): the op takes no bfloat16, and a float16 sum among a stage's
    copies on CPUs did not complete. An integer or boolean type the op does not take
    (uint8, bool, ...) is reduced as int64 and cast back."""
    members = sorted(set(members))
    if len(members) == 1:
      return tf.identity(tensor)
    dtype = tensor.dtype
    if dtype in (tf.bfloat16, tf.float16):
      tensor = tf.cast(tensor, tf.float32)
    elif dtype not in (tf.float32, tf.float64, tf.int32, tf.int64):
      tensor = tf.cast(tensor, tf.int64)
    out = tf.raw_ops.CollectiveReduceV2(
        input=tensor, group_size=len(members), group_key=self.key(members),
        instance_key=instance, ordering_token=[], merge_op=merge_op, final_op="Id",
        communication_hint=self.hint)
    return tf.cast(out, dtype) if dtype != out.dtype else out


class Keys:
  """Instance keys of one step's transfers, the same on both sides of every boundary.

  F(c, m)'s output goes to chunk c+1 under `forward(c, m)`, B(c, m)'s input
  gradient to chunk c-1 under `backward(c, m)`; `extra(i)` numbers the step's
  other collectives (after every transfer's key).
  """

  def __init__(self, chunks: int, microbatches: int):
    self.chunks, self.microbatches = chunks, microbatches

  def forward(self, chunk: int, microbatch: int) -> int:
    return 1 + 2 * (chunk * self.microbatches + microbatch)

  def backward(self, chunk: int, microbatch: int) -> int:
    return 2 + 2 * (chunk * self.microbatches + microbatch)

  def extra(self, i: int) -> int:
    return 1 + 2 * self.chunks * self.microbatches + i


def owners(chunk_workers: Sequence[int]) -> Dict[int, Tuple[int, ...]]:
  """{worker: its chunks} of one replica whose chunk c runs on worker chunk_workers[c]."""
  out: Dict[int, list] = {}
  for c, w in enumerate(chunk_workers):
    out.setdefault(w, []).append(c)
  return {w: tuple(cs) for w, cs in out.items()}


class Among:
  """Reductions among the workers `members` (a stage's copies), each from its own program.

  The interface tfpar.parallel.exchange's codecs and tfpar.parallel.zero's reduce-scatter
  sum through (exchange.InReplica's: `sum`, `peak`, `at`), plus `all_gather`. Each call
  is one collective per (device, dtype) of the tensors it gets, the tensors of one such
  pack concatenated; the calls take consecutive instance keys from `first_key`, which
  matches them up because every member traces the same calls in the same order.

  Buckets. Given `buckets` (each variable's bucket, numbered in the order the backward
  finishes them: StageProgram.buckets), `sum` packs and reduces each bucket on its own,
  bucket 0 first: a bucket's collectives read only its own gradients, so the executor
  starts them while the backward of the buckets after it still runs (the overlap of
  each bucket's reduction with the backward). Each bucket's sum waits for the previous
  bucket's (a control dependency), so every member starts them in one order, as NCCL
  needs; they share one link anyway. Every element is the same sum over the same
  members; only the vector it travels in changes.

  Args:
    groups: the job's Groups.
    members: the workers, this one among them.
    first_key: the first instance key (a step's collectives among `members` take the keys
      from here on; a second trace of other shapes starts elsewhere).
    home: the device of each variable's gradient here (`at`).
    buckets: the bucket of each variable (by the `indices` that `sum` gets); none: one.
  """

  def __init__(self, groups: Groups, members: Sequence[int], first_key: int,
               home: Sequence[str] = (), buckets: Sequence[int] = ()):
    self.groups, self.members = groups, sorted(set(members))
    self.next_key, self.home, self.buckets = first_key, list(home), list(buckets)

  def _key(self) -> int:
    self.next_key += 1
    return self.next_key - 1

  def _packed(self, tensors: List[tf.Tensor], reduce) -> List[tf.Tensor]:
    packs, vectors = collectives.pack(tensors, [t.device for t in tensors])
    reduced = []
    for (device, _), vector in zip(packs, vectors):
      with collectives.on_device(device):
        reduced.append(reduce(vector, self._key()))
    return collectives.unpack(packs, reduced, tensors)

  def sum(self, per_copy, indices) -> List[tf.Tensor]:
    """The SUM over `members` of each of this worker's tensors (`per_copy`: [its list], tensor
    j variable indices[j]'s), bucket by bucket."""
    tensors, out, done = list(per_copy[0]), [None] * len(per_copy[0]), []

    def add(x, key):
      with tf.control_dependencies(done):  # After the previous bucket's: one order everywhere.
        return self.groups.sum(x, self.members, key)

    if not self.buckets:
      return self._packed(tensors, add)
    of = [self.buckets[i] for i in indices]
    for bucket in sorted(set(of)):
      js = [j for j, b in enumerate(of) if b == bucket]
      summed = self._packed([tensors[j] for j in js], add)
      for j, s in zip(js, summed):
        out[j] = s
      done[:] = [s.op for s in summed]
    return out

  def peak(self, per_copy, indices) -> List[tf.Tensor]:
    """The largest value over `members` of each [1]-shaped tensor."""
    del indices
    return self._packed(list(per_copy[0]),
                        lambda x, key: self.groups.max(x, self.members, key))

  def at(self, i: int):
    return collectives.on_device(self.home[i] if self.home else None)

  def all_gather(self, tensors: List[tf.Tensor], shard: int) -> List[tf.Tensor]:
    """[D * S_j] per tensor: this member's [S_j] (its `shard` of D) and every other
    member's, in shard order; one collective, each row led by its shard."""
    if len(self.members) == 1:
      return list(tensors)
    sizes = [int(t.shape.num_elements()) for t in tensors]
    with collectives.on_device(tensors[0].device):
      row = tf.concat([tf.constant([float(shard)])] +
                      [tf.cast(t, tf.float32) for t in tensors], 0)[None]
      rows = self.groups.gather(row, self.members, self._key())
      rows = tf.gather(rows, tf.argsort(rows[:, 0]))
      parts = tf.split(rows[:, 1:], sizes, axis=1)
      return [tf.reshape(p, [-1]) for p in parts]
