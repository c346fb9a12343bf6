"""The parallel plan: which device holds which part of the model, as printable data.

A plan is a D x K x T grid of devices: D data-parallel replicas (model copies),
each split into K pipeline stages, each stage split over T tensor-parallel
shards. Device (d, k, t) is the flat index d*K*T + k*T + t of the devices the
run may use; across N workers of G devices, the flat index into the workers'
devices in worker order: local device k*T + t of worker d when a replica fits
one worker (K x T <= G), else a replica spans W = K x T / G whole workers and
stage k of replica d sits on worker d*W + k*T // G (tfpar.config.rules.worker_layout:
a tensor-parallel group never leaves its worker).

Stages hold contiguous blocks. By default the blocks are balanced by parameter
count, with the embedding counted on stage 0 and the head (final LayerNorm; the
output projection is the tied embedding, which stays on stage 0) on stage K-1:
the split minimises the largest stage. `--stage_layers=3,3,2` overrides it.

Within a stage, shard t of every block's attention and MLP lives on device
(d, k, t); what cannot be split (LayerNorms, the two output biases, the
embedding, the head) lives on the stage's first device (d, k, 0). AdamW keeps
two slots per weight (m, v) beside it, and its step counter on device (d, 0, 0).
`bytes_per_device` predicts those bytes from the shapes alone; the engine
measures the real variables against it.

The schedule (--pipeline_schedule) sets the bubble, the fraction of each
device's step spent idle while the pipeline fills and drains: (K-1)/(M+K-1)
for M micro-batches under GPipe and 1F1B, (K-1)/(vM+K-1) under interleaved
1F1B with v chunks per device; there stage k holds the v chunks k, k+K, ...
of L/(vK) blocks each (`chunks`), not one contiguous run of blocks
(tfpar.layout.schedule derives both).

Activations: `activation_bytes` predicts the most each stage holds for its
backwards: one micro-batch's activations per chunk (`microbatch_activations`:
what tfpar's blocks keep for the backward, `activation_bytes_per_block` with
counts="tfpar", also the planner's for --system=tfpar; Korthikanti et al.
2022's count is Megatron-LM's; sequence parallelism splits part of it over
the T shards; and what the head keeps on the last chunk,
`head_activation_bytes`), replayed in the device's order of forwards and
backwards (tfpar.layout.schedule.held): 1F1B holds K-k micro-batches on stage k
(`in_flight`), interleaved 1F1B its warm-up's chunks. GPipe's order is the
executor's, so for it the prediction is a bound, all M micro-batches
(tfpar.layout.schedule). scripts/activation_memory.py measures, from the
allocator, what each device holds when the backward starts (held to this
prediction by tests/test_sequence_parallel.py); scripts/pipeline_memory.py
what each stage holds when a backward runs, and its peak (held to this
prediction by tests/test_schedules.py).
"""

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tfpar import families
from tfpar.config import rules
from tfpar import partitioning
from tfpar.config import schema
from tfpar.console import count
from tfpar import storage
from tfpar import tasks
from tfpar.layout import schedule as schedule_lib
from tfpar.config.schema import Config, ConfigError, ModelConfig

ACTIVATION_BYTES = {"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2}
NO_REMAT, FULL_REMAT, SELECTIVE_REMAT = (schema.REMAT.index(r) for r in ("none", "full", "selective"))
BYTES_PER_PARAM = 4  # Variables stay float32 under every precision policy (fp32 masters).
OPTIMIZER_SLOTS = 2  # AdamW: first and second moments.
STEP_COUNTER_BYTES = 8  # AdamW's int64 iteration count.


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  """Parameters of each part of the model, per tensor-parallel shard where split."""
  embedding: int  # the model's embed part (e.g. token + position tables): stage 0, device t=0
  head: int  # the model's head part (e.g. a final LayerNorm): stage K-1, device t=0
  block_unsplit: int  # a block's REPLICATED variables (LayerNorms, output biases): device t=0
  block_shard: int  # one shard of its COLUMN/ROW variables (H/T heads, d_ff/T columns)
  shards: int = 1  # T

  @property
  def block(self) -> int:
    return self.block_unsplit + self.shards * self.block_shard


def rules_of(m: ModelConfig, family: Optional[str] = None) -> partitioning.Rules:
  """The partitioning rules of `family`, by default the family m's task builds."""
  return families.rules(family or tasks.get(m.task).family_of(m))


def count_params(m: ModelConfig, tensor_parallel: int = 1, *,
                 family: Optional[str] = None) -> ParamCounts:
  """Parameter counts from the shapes alone: the model family's partitioning
  rules and shapes (tfpar.partitioning) give a block's variables and which of
  them split over the T shards, and the embedding's and head's.

  Args:
    m: the model's config.
    tensor_parallel: T.
    family: the family of the model trained (a task passed to an engine may
      build another than m.task's); default m.task's.
  """
  rules = rules_of(m, family)
  unsplit, shard = rules.block_counts(m, tensor_parallel)
  embedding, head = rules.embed_head_counts(m)
  return ParamCounts(embedding=embedding, head=head, block_unsplit=unsplit, block_shard=shard,
                     shards=tensor_parallel)


def balance_stages(num_layers: int, stages: int, block: int, first_extra: int,
                   last_extra: int) -> Tuple[int, ...]:
  """Blocks per stage (contiguous, >= 1 each) minimising the largest stage's parameters.

  Dynamic programming over (stages used, blocks placed), vectorised over the
  block counts (tfpar.plan calls it for every K of thousands of devices).
  """
  n, k_all = num_layers, stages
  # best[k, i]: smallest possible max-load placing blocks [0, i) on stages [0, k);
  # cut[k, i]: where stage k-1 starts in that placement (the first j achieving it).
  best = np.full((k_all + 1, n + 1), np.inf)
  best[0, 0] = 0
  cut = np.zeros((k_all + 1, n + 1), dtype=int)
  i = np.arange(n + 1)[:, None]
  j = np.arange(n + 1)[None, :]
  for k in range(1, k_all + 1):
    load = (i - j) * float(block) + (first_extra if k == 1 else 0) + \
        (last_extra if k == k_all else 0)  # stage k-1 holds blocks [j, i)
    cost = np.where((j < i) & (j >= k - 1), np.maximum(best[k - 1][None, :], load), np.inf)
    cut[k] = np.argmin(cost, axis=1)
    best[k] = cost[np.arange(n + 1), cut[k]]
  counts, i = [], n
  for k in range(k_all, 0, -1):
    counts.append(i - cut[k][i])
    i = cut[k][i]
  return tuple(int(c) for c in reversed(counts))


def even_stages(num_layers: int, stages: int) -> Tuple[int, ...]:
  """Blocks per stage differing by at most one: L/K each where K divides L, else the
  L mod K stages of one more block in the middle and the smaller ones at both ends (which
  also hold the embedding and the head). 70 blocks on 12 stages: 5, 6 x 10, 5, as BLOOM's
  Megatron-DeepSpeed run placed them (its partition counted the two embeddings as blocks)."""
  small, extra = divmod(num_layers, stages)
  if small == 0:
    raise ValueError(f"{stages} stages need at least {stages} blocks, not {num_layers}")
  ends = stages - extra  # Stages of `small` blocks: split between the two ends.
  head = (ends + 1) // 2
  return (small,) * head + (small + 1,) * extra + (small,) * (ends - head)


def activation_bytes_per_block(m: ModelConfig, b, t, remat, precision: str,
                               sequence_parallel=False, *, regather: bool = False,
                               counts: str = "paper"):
  """(kept, all): activations one block keeps for the backward of one micro-batch of b
  sequences under `remat` (indices into schema.REMAT: NO_REMAT, FULL_REMAT, SELECTIVE_REMAT;
  an array of them too), and all it makes in its forward, on its busiest device.

  `counts` "paper": Korthikanti et al. 2022, eq. (2) and section 4.2, in 16-bit
  values (Megatron-LM's; float32 activations double it). Of the s b h 34 that
  grow with s, 24 are split over the T tensor shards and 10 are not: the two
  LayerNorm inputs (4), the two gathered inputs of the column-parallel matmuls
  (4) and the two dropout masks (2), all on the first device, s b h (10 + 24/T).
  Sequence parallelism (`sequence_parallel`, an array too) splits the LayerNorm
  inputs and dropout masks along the sequence; keeping each shard's gathered
  input whole gives s b h (4 + 30/T), Megatron-LM (`regather`) keeps its slice
  and gathers again in the backward, s b h 34/T. The attention core adds
  5 a s^2 b / T (scores, probabilities, dropout mask), which selective
  recompute drops. Full recompute keeps only the block's input, 2 s b h
  (2 s b h / T where the stream stays split: Megatron's sequence parallelism).

  `counts` "tfpar": what tfpar's own step keeps (`tfpar_kept_per_position`, and
  the attention core's probabilities, a s^2 b / T, which selective recompute
  drops), measured from the allocator by scripts/activation_memory.py; its full
  recompute keeps the block's input whole, s b h values (tfpar joins the stream).
  """
  s, h, a = m.seq_len, m.d_model, m.num_heads
  split = np.asarray(sequence_parallel, dtype=bool)
  remat = np.asarray(remat)
  if counts == "tfpar":
    act = ACTIVATION_BYTES[precision]
    linear = s * b * tfpar_kept_per_position(m, t, split) * act
    full = linear + a * s * s * b / t * act
    block_input = s * b * h * act
  else:
    scale = ACTIVATION_BYTES[precision] / 2
    whole = np.where(split, 0.0 if regather else 4.0, 10.0)  # Of the 10, what stays whole.
    linear = s * b * h * (whole + (34 - whole) / t) * scale
    full = linear + 5 * a * s * s * b / t * scale
    block_input = 2 * s * b * h * scale / np.where(split & regather, t, 1)
  return np.select([remat == FULL_REMAT, remat == SELECTIVE_REMAT],
                   [block_input * np.ones_like(linear), linear], full), full


def tfpar_kept_per_position(m: ModelConfig, t, sequence_parallel=False):
  """Values per sequence position that one tfpar block keeps for its backward on its busiest
  device, but the attention core's a s / T (its probabilities).

  Measured from TensorFlow's allocator on the ops Grappler leaves
  (scripts/activation_memory.py: the bytes the step allocated and still holds
  when the backward starts, without XLA, float32), in the model's compute dtype:
    norms      each of the two keeps its input, its normalised product and its
               output (the column-parallel matmuls' input), and c statistics
               per position (LayerNorm c = 3: the mean, the variance and one
               product of them; RMSNorm c = 1: the mean square): 2 (3h + c). Under sequence
               parallelism inputs, products and statistics are on 1/T of the
               sequence and the outputs are gathered whole: 2h + 2 (2h + c) / T.
    attention  Q, K, V and the heads' output, 4h/T.
    MLP        a GELU MLP: the pre-activation, the tanh GELU's three intermediates its
               gradient reads and its output, 5f/T; a SwiGLU: gate, up, SiLU's
               output and the product, 4f/T (the family's `mlp_values`).
  The traced graph's gradient ops read more (the attention scores, GELU's two
  other intermediates and rotary's halves of Q and K): only the gradients of
  constants read those, Grappler prunes them, and the executor then writes the
  next op's output over them (the softmax over its scores). Megatron-LM keeps
  less (the paper's count above): fused LayerNorm and bias + GELU kernels keep
  only their inputs. Not counted: dropout masks (the measured runs use
  --dropout=0, as pretraining does).
  """
  h, f = m.d_model, m.d_ff
  split = np.asarray(sequence_parallel, dtype=bool)
  family = families.get(m.architecture)
  stats = family.norm_statistics
  norms = np.where(split, 2 * h + 2 * (2 * h + stats) / t, 2 * (3 * h + stats))
  return norms + 4 * h / t + family.mlp_values * f / t


def head_activation_bytes(m: ModelConfig, b, precision: str, counts: str = "paper", tv=1):
  """Bytes the logits stage keeps for one micro-batch's backward of the output head.

  "paper": float32 logits and their gradient, 8 b s V / T_vocab (our estimate).
  "tfpar" (measured as tfpar_kept_per_position is): the loss's float32 gradient of
  the logits, 4 b s V (written over the logits); the final norm's input, product
  and output, whole, with its statistics. (The traced graph also keeps GPT's tied
  output projection, the embedding transposed, for the backward; Grappler folds
  the transpose into the matmuls, so no copy is made.)
  """
  s, h, v = m.seq_len, m.d_model, m.vocab_size
  if counts != "tfpar":
    return 8 * b * s * v / tv
  act = ACTIVATION_BYTES[precision]
  norm = s * b * (3 * h + families.get(m.architecture).norm_statistics) * act
  return 4 * b * s * v + norm


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  blocks: Tuple[int, ...]
  parameters: int  # over all T shards of this stage
  embedding: bool
  head: bool


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
  """Where everything goes. Build it with `make_plan`; print it with `format()`.

  Attributes:
    data_parallel, pipeline_stages, tensor_parallel: D, K, T.
    microbatches: M, micro-batches per replica batch.
    per_replica_batch: sequences each replica sees per step (G / D).
    stages: the K stages, blocks and parameters.
    devices: devices[d][k][t], device names.
    remat: what blocks recompute in the backward pass: "none", "full" (all but the
      block's input) or "selective" (the attention core).
    counts: parameter counts per part.
    schedule: the pipeline schedule (tfpar.layout.schedule.SCHEDULES), --pipeline_schedule.
    virtual_stages: v, chunks per stage (interleaved; 1 otherwise).
    microbatch_activations: per chunk (the K stages, or the v K chunks in pipeline order), the
      predicted bytes one micro-batch's forward there keeps for its backward.
    sequence_parallel: the blocks' sequence split over the T shards (--sequence_parallel).
    optimizer_sharding: --optimizer_sharding: zero1/zero2 split each device's AdamW slots
      over its D data-parallel peers (tfpar.parallel.zero.PlanZero), zero3 its weights too
      (tfpar.engines.hybrid_zero3).
  """
  data_parallel: int
  pipeline_stages: int
  tensor_parallel: int
  microbatches: int
  per_replica_batch: int
  stages: Tuple[Stage, ...]
  devices: Tuple[Tuple[Tuple[str, ...], ...], ...]
  remat: str
  counts: ParamCounts
  schedule: str = "gpipe"
  virtual_stages: int = 1
  microbatch_activations: Tuple[int, ...] = ()
  sequence_parallel: bool = False
  optimizer_sharding: str = "none"

  @property
  def bubble(self) -> float:
    return schedule_lib.bubble(self.pipeline_stages, self.microbatches, self.virtual_stages)

  @property
  def in_flight(self) -> List[float]:
    """Per stage, the most micro-batches whose activations it holds at once under the schedule."""
    return [float(n) for n in schedule_lib.in_flight(
        schedule_lib.SCHEDULES.index(self.schedule), self.microbatches, self.virtual_stages,
        self.pipeline_stages)]

  @property
  def chunks(self) -> List[Tuple[int, Tuple[int, ...]]]:
    """(stage, blocks) of each chunk in pipeline order: the K stages, or (interleaved) the
    v K chunks of L/(vK) blocks, chunk c on stage c mod K."""
    k, v = self.pipeline_stages, self.virtual_stages
    out = []
    for c in range(k * v):
      blocks = self.stages[c % k].blocks
      n = len(blocks) // v
      out.append((c % k, blocks[(c // k) * n:(c // k + 1) * n]))
    return out

  def activation_bytes(self) -> Dict[str, int]:
    """Predicted {stage's first device: peak bytes of activations} (module docstring)."""
    held = schedule_lib.held(self.schedule, self.pipeline_stages, self.microbatches,
                             self.virtual_stages, self.microbatch_activations)
    return {device_key(row[k][0]): int(n) for row in self.devices for k, n in enumerate(held)}

  @property
  def anchors(self) -> List[str]:
    """Each replica's first device: its data-parallel endpoint and optimizer step counter."""
    return [row[0][0] for row in self.devices]

  @property
  def stage_workers(self) -> List[List[Optional[str]]]:
    """[d][k]: the worker holding stage k of replica d ('worker:1'); None on one host."""
    return [[device_key(shards[0]).rpartition("/")[0] or None for shards in row]
            for row in self.devices]

  def params_on(self, k: int, t: int) -> int:
    """Parameters held by device (., k, t)."""
    stage, c = self.stages[k], self.counts
    n = len(stage.blocks) * c.block_shard
    if t == 0:
      n += len(stage.blocks) * c.block_unsplit
      n += c.embedding if stage.embedding else 0
      n += c.head if stage.head else 0
    return n

  def bytes_per_device(self) -> Dict[str, Dict[str, int]]:
    """Predicted {device: {"parameters": bytes, "optimizer": bytes}} over the whole grid.

    Under --optimizer_sharding a device keeps the slots of ceil(1/D) of its parameters, and
    under zero3 (tfpar.parallel.zero3) that share of the weights too.
    """
    out = {}
    d = self.data_parallel if self.optimizer_sharding != "none" else 1
    for row in self.devices:
      for k, shards in enumerate(row):
        for t, device in enumerate(shards):
          n = self.params_on(k, t)
          p = (-(-n // d) if self.optimizer_sharding == "zero3" else n) * BYTES_PER_PARAM
          o = OPTIMIZER_SLOTS * BYTES_PER_PARAM * -(-n // d) + (
              STEP_COUNTER_BYTES if k == 0 and t == 0 else 0)
          out[device_key(device)] = {"parameters": p, "optimizer": o}
    return out

  def to_dict(self) -> dict:
    return {"data_parallel": self.data_parallel, "pipeline_stages": self.pipeline_stages,
            "tensor_parallel": self.tensor_parallel, "microbatches": self.microbatches,
            "per_replica_batch": self.per_replica_batch, "remat": self.remat,
            "sequence_parallel": self.sequence_parallel,
            "optimizer_sharding": self.optimizer_sharding,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "bubble": self.bubble, "in_flight_microbatches": self.in_flight,
            "activation_bytes_per_device": self.activation_bytes(),
            "activation_bytes_are_a_bound": self.schedule in schedule_lib.BOUND,
            "stages": [dataclasses.asdict(s) for s in self.stages],
            "devices": [[list(shards) for shards in row] for row in self.devices],
            "stage_workers": self.stage_workers,
            "bytes_per_device": self.bytes_per_device()}

  def format(self) -> str:
    """The plan as a few lines for the start-up log."""
    d, k, t, m = self.data_parallel, self.pipeline_stages, self.tensor_parallel, self.microbatches
    v = self.virtual_stages
    vm = f"{v}M" if v > 1 else "M"
    lines = [f"plan: D={d} data x K={k} pipeline x T={t} tensor = {count(d * k * t, 'device')}; "
             f"M={m} micro-batches of {self.per_replica_batch // m}; schedule {self.schedule}"
             f"{f' over v={v} chunks per stage' if v > 1 else ''}, bubble (K-1)/({vm}+K-1) = "
             f"{k - 1}/{v * m + k - 1} = {self.bubble:.1%}; remat {self.remat}"
             f"{'; sequence parallel' if self.sequence_parallel else ''}"
             + (f"; optimizer {self.optimizer_sharding} over the D replicas"
                if self.optimizer_sharding != "none" else "")]
    for s in self.stages:
      extra = (" + embedding" if s.embedding else "") + (" + head" if s.head else "")
      devs = " | ".join(" ".join(device_key(dev) for dev in row[s.index]) for row in self.devices)
      runs = ", ".join(f"{b[0]}-{b[-1]}" for i, b in self.chunks if i == s.index)
      lines.append(f"  stage {s.index}: blocks {runs}{extra}, "
                   f"{s.parameters:,} params on [{devs}]")
    flight = ", ".join(f"{n:g}" for n in self.in_flight)
    bound = "at most " if self.schedule in schedule_lib.BOUND else ""
    lines.append(f"  predicted bytes per device (activations: micro-batches in flight per stage "
                 f"{bound}{flight}):")
    activations = self.activation_bytes()
    for device, b in self.bytes_per_device().items():
      acts = f", activations {kib(activations[device])}" if device in activations else ""
      lines.append(f"    {device}: parameters {kib(b['parameters'])}, "
                   f"optimizer {kib(b['optimizer'])}{acts}")
    return "\n".join(lines)

  def write(self, model_dir: str, measured: Optional[Dict[str, Dict[str, int]]] = None) -> str:
    """plan.json; `measured`: {device: {"parameters": bytes, "optimizer": bytes}} of the real
    variables, written beside the prediction (`measured_bytes_per_device`)."""
    plan = self.to_dict()
    if measured is not None:
      plan["measured_bytes_per_device"] = measured
    return write_plan_json(model_dir, plan)


PLAN_JSON = "plan.json"


def write_plan_json(model_dir: str, record: dict) -> str:
  """Writes `record` as model_dir/plan.json (atomically; gs:// works); returns its path.

  The one writer of plan.json: the engines write their plan and its bytes at
  start-up, tfpar.training.memory adds what the allocator measured.
  """
  storage.makedirs(model_dir)
  path = os.path.join(model_dir, PLAN_JSON)
  storage.write_atomically(path, json.dumps(record, indent=2))
  return path


def read_plan_json(model_dir: str) -> Optional[dict]:
  """model_dir/plan.json, or None where no engine wrote one."""
  path = os.path.join(model_dir, PLAN_JSON)
  return json.loads(storage.read_text(path)) if storage.exists(path) else None


def device_key(device: str) -> str:
  """A short name, the same for plan and variables: 'worker:1/CPU:3', or 'CPU:3' on one host.

  '/job:worker/replica:0/task:1/device:CPU:3' -> 'worker:1/CPU:3';
  '/job:localhost/replica:0/task:0/device:CPU:3' and '/device:CPU:3' -> 'CPU:3'.
  """
  fields = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p and
                not p.startswith("device:"))
  name = device.rstrip("/").split("/")[-1].replace("device:", "").upper()
  job = fields.get("job")
  return f"{job}:{fields.get('task', 0)}/{name}" if job and job != "localhost" else name


def kib(n: int) -> str:
  return f"{n / 1024:.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:.2f} MiB"


def state_bytes_per_device(cfg: Config) -> int:
  """Bytes of weights, gradients and AdamW slots on the busiest device of one replica.

  Activations are not counted (tfpar.planner models them). Without model
  parallelism a replica is one device holding the whole model.
  """
  p = cfg.parallel
  one_replica = cfg.replace(parallel={"data_parallel": 1, "microbatches": 1})
  plan = make_plan(one_replica, [f"/device:CPU:{i}" for i in range(p.pipeline_stages *
                                                                   p.tensor_parallel)])
  return max(2 * b["parameters"] + b["optimizer"] for b in plan.bytes_per_device().values())


def make_plan(cfg: Config, devices: Sequence[str], *,
              worker_devices: Optional[Sequence[Sequence[str]]] = None,
              family: Optional[str] = None) -> ParallelPlan:
  """Builds and checks the plan.

  Args:
    cfg: the run's config (model shape and --pipeline_stages etc.).
    devices: the devices of this host the run may use (one host).
    worker_devices: across workers, each worker's devices (D = number of
      workers, each worker holding K x T devices); `devices` is then unused.
    family: the model family trained (the engine's task's), whose partitioning
      rules count the parameters; default the family of --task's.

  Raises:
    ConfigError: one line naming the flag, when the plan cannot work.
  """
  m, p = cfg.model, cfg.parallel
  k, t = p.pipeline_stages, p.tensor_parallel
  rules.check_model_split(m, p, cfg.train.precision)  # The rules config checked: the same ones.
  # Only the device counts are new here: the devices are known now.
  if worker_devices is not None:
    # One replica per worker (on its first K x T devices), or a replica over whole workers.
    d, w = rules.worker_layout(p, len(worker_devices), min(len(x) for x in worker_devices),
                                    cfg.compression.method)
    flat = [dev for x in worker_devices for dev in list(x)[:k * t // w]]
  else:
    n = len(devices)
    d = p.data_parallel or max(1, n // (k * t))
    if d * k * t != n:
      raise ConfigError(f"--data_parallel x --pipeline_stages x --tensor_parallel = {d}x{k}x{t} "
                        f"= {d * k * t} does not match the {n} device(s) this run has (GPUs, or "
                        f"--num_cpu_devices logical CPUs): set --num_cpu_devices={d * k * t}")
    flat = list(devices)
  g = cfg.train.global_batch_size
  rules.check_batch(g, d, p.microbatches, flag=f"--data_parallel={d}")
  counts = count_params(m, t, family=family)
  v = p.virtual_stages
  if p.stage_layers is not None:
    per_stage = tuple(p.stage_layers)
  elif v > 1:  # Interleaved: v K equal chunks, chunk c on stage c mod K.
    per_stage = (m.num_layers // k,) * k
  else:
    per_stage = balance_stages(m.num_layers, k, counts.block, counts.embedding, counts.head)
  size = m.num_layers // (k * v)
  runs = [[range(c * size, (c + 1) * size) for c in range(i, k * v, k)] if v > 1 else
          [range(sum(per_stage[:i]), sum(per_stage[:i + 1]))] for i in range(k)]
  b = g // d // p.microbatches
  per_block, _ = activation_bytes_per_block(m, b, t, schema.REMAT.index(p.remat),
                                            cfg.train.precision, p.sequence_parallel,
                                            counts="tfpar")
  head = head_activation_bytes(m, b, cfg.train.precision, "tfpar")
  stages = []
  for i, n_blocks in enumerate(per_stage):
    params = n_blocks * counts.block + (counts.embedding if i == 0 else 0) + \
        (counts.head if i == k - 1 else 0)
    stages.append(Stage(index=i, blocks=tuple(j for run in runs[i] for j in run),
                        parameters=params, embedding=i == 0, head=i == k - 1))
  # Per chunk (the stages, or the v K chunks); the last also keeps what the head's backward reads.
  blocks = [size] * (k * v) if v > 1 else per_stage
  activations = [n * per_block for n in blocks]
  activations[-1] += head
  grid = tuple(tuple(tuple(flat[r * k * t + s * t + j] for j in range(t)) for s in range(k))
               for r in range(d))
  return ParallelPlan(data_parallel=d, pipeline_stages=k, tensor_parallel=t,
                      microbatches=p.microbatches, per_replica_batch=g // d, stages=tuple(stages),
                      devices=grid, remat=p.remat, counts=counts,
                      schedule=p.pipeline_schedule, virtual_stages=v,
                      microbatch_activations=tuple(int(a) for a in activations),
                      sequence_parallel=p.sequence_parallel,
                      optimizer_sharding=p.optimizer_sharding)
