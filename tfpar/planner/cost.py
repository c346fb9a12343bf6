"""The analytic cost model: memory per device and step time of a D x K x T plan.

Every formula's source is in docs/planner.md; in short, for a model of L
blocks, width h, a heads, MLP width f, sequence s, vocabulary V, global batch
G, micro-batch b, M = G / (D b) micro-batches, recompute r (0 or 1: full),
selective recompute q (0 or 1), optimizer sharding none, zero1, zero2 or zero3:

  FLOPs per sequence, forward:  layer = 2 s (4h^2 + 2hf) + 4 s^2 h,  logits = 2 s h V
  FLOPs per step:               G ((3 + r) L layer + q L 4 s^2 h + 3 logits)  (Narayanan et al.
                                2021; selective recomputes the attention core's 4 s^2 h)
  bytes per parameter:          weights + gradients + optimizer (per System); zero1 divides
                                the optimizer's by D, zero2 the summed gradient's too (tfpar
                                keeps 2 of its D shards alive, tfpar.parallel.zero.state_bytes);
                                a tfpar stage worker (a replica spanning nodes) holds its
                                gradient and the flat vector's sum (none, zero1: 2), under
                                zero2 its gradient and 2 of the sum's D shards;
                                zero3 (tfpar, K = T = 1: tfpar.parallel.zero3) divides all
                                three by D and adds one part's gathered weights, its full
                                gradient and that gradient's sum, P_part (w + 2g), P_part =
                                max(block, embedding + head) parameters; it recomputes every
                                block (r = 1)
  activations per block and micro-batch, megatron (Korthikanti et al. 2022, 16-bit values):
                                s b h (W + (34-W)/T + 5 a s / (h T))  without recompute
                                s b h (W + (34-W)/T)                  selective recompute
                                2 s b h                               with full recompute
                                W = 10 (what stays whole on a shard's device); with sequence
                                parallelism 0 (gathered again in the backward, whose full
                                recompute then keeps 2 s b h / T)
                     tfpar (what its backward reads, counted; values of act bytes):
                                s b (N + 2 a s / T), N = 2 (3h + c) + 4h/T + 7f/T (GPT);
                                with sequence parallelism 2h + 2 (2h + c)/T + 4h/T + 7f/T;
                                selective drops the 2 a s / T, full keeps s b h
                                (tfpar.layout.placement.tfpar_kept_per_position; Llama too)
  micro-batches in flight on stage k (activations kept for the backward):
                                gpipe M; 1f1b min(M, K - k);
                                interleaved (2(K-k-1) + (v-1)K + 1) / v  (Narayanan et al. 2021)
  pipeline bubble:              (K - 1) / (v M + K - 1) of the step, v = 1 unless interleaved
  stage-boundary send (per micro-batch, forward and backward, v times when interleaved):
                                b s h act bytes on the inter-node link once K T spans nodes;
                                2 transfers per micro-batch on the critical path, 4 under
                                DeepSpeed's blocking pipeline instructions
  ring all-reduce of n bytes over p devices:  2 (p-1)/p n / bw + 2 (p-1) latency
  data parallel:                the ring all-reduce of the busiest device's gradient over the
                                D replicas (tfpar sharded: and an all-gather of its new weights);
                                a tfpar replica spanning nodes runs one program per worker, its
                                copies all-reduced by collective (under zero1/zero2 too, then
                                the new weight shards all-gathered), the tied embedding summed
                                between the first and last stage; zero3:
                                each of the L + 2 parts all-gathers its weights in the forward
                                and again in the backward and sums its gradient by
                                min(D, 4) all-reduces in turn (`zero3_seconds`)
  compute efficiency:           e_max / (1 + w/(h/T) + r0/(b s))    (constants fitted)

Three Systems share the physics and differ in layout (the third, Megatron-DeepSpeed,
for the published runs of tfpar.planner.megatron): "tfpar" is what tfpar
runs (the embedding, tied output projection and LayerNorms unsplit on a
stage's first device; stages balanced by parameters, L/(K v) blocks per chunk
when interleaved; float32 variables), "megatron" is Megatron-LM as in
Narayanan et al. 2021 (vocabulary-parallel embedding on the first and last
stage; L/K blocks per stage; the scatter/gather send between stages) and is
what the published table is evaluated with. In both a tensor-parallel group
sits inside a node and pipeline stages may span nodes; both shard the
optimizer over the D copies wherever D > 1 (tfpar not under mixed_float16). A plan names its
schedule (SCHEDULES: gpipe, 1f1b, interleaved with v virtual stages).

On a shared host (Cluster.shared: logical CPU devices of one machine) the
devices take turns on the same cores: a step costs the sum of every
device's work, D M T sum_stages(compute + ops + tensor comm), and the bubble
costs nothing (another stage works meanwhile).

Everything is vectorised over candidate plans (numpy arrays), so thousands
of plans cost one pass per distinct (K, T, interleaved or not).
"""

import dataclasses
import functools
from typing import Dict, Optional, Tuple

import numpy as np

from tfpar import partitioning
from tfpar.config import schema
from tfpar.config.schema import ModelConfig
from tfpar.layout import placement as plan_lib
from tfpar.layout import schedule as schedule_lib
from tfpar.planner.clusters import Cluster

# --remat's modes (tfpar.config.schema.REMAT's order: a bool True is full) and --optimizer_sharding's.
REMATS = schema.REMAT
NO_REMAT, FULL, SELECTIVE = plan_lib.NO_REMAT, plan_lib.FULL_REMAT, plan_lib.SELECTIVE_REMAT
SHARDINGS = ("none", "zero1", "zero2", "zero3")
ZERO3 = SHARDINGS.index("zero3")

COMPUTE_DTYPE = {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
ACTIVATION_BYTES = plan_lib.ACTIVATION_BYTES


@dataclasses.dataclass(frozen=True)
class System:
  """How a framework lays a plan out (see the module docstring).

  Attributes:
    name: "tfpar" or "megatron".
    schedules: the pipeline schedules it runs (the search tries each); the first
      is the one a plan that names none gets.
    vocab_parallel: embedding and logits split over the T shards.
    uniform_stages: L/K blocks per stage; else balanced by parameters. Where K does not
      divide L (Megatron-LM refuses it; Megatron-DeepSpeed runs it), stage sizes differ by
      one block, the smaller stages at the ends (tfpar.layout.placement.even_stages): the
      search tries only K dividing L, a given K is evaluated so.
    scatter_gather: a stage boundary sends 1/T of the activation from each of the T
      shards and all-gathers it inside the node (Narayanan et al. 2021, section 4.1);
      else one device sends all of it.
    weight_bytes, grad_bytes, optimizer_bytes: bytes per parameter, by precision.
    shardings: the --optimizer_sharding modes it runs (zero1: optimizer_bytes / D per
      device; zero2: also the summed gradient, of which `zero2_gradient_shards` of the D
      shards are alive at once; zero3: weights, gradients and optimizer / D, data-parallel
      plans only, every block recomputed).
    sharding_with_float16: whether it shards the optimizer under mixed_float16 (tfpar: no,
      its loss scaling is not sharded).
    program_per_worker: tfpar's runtime for a replica whose K x T devices span nodes: one
      program per worker (tfpar.engines.stage_worker: a stage's copies summed by collective,
      under every --optimizer_sharding but zero3, the last stage's worker holding its own
      copy of the tied embedding); else (Megatron) collectives everywhere, one tied
      embedding shard per stage.
    sharding_all_reduces: a sharded step all-reduces the gradient and then all-gathers
      the new weights (tfpar: ReplicaContext has no reduce-scatter); else it
      reduce-scatters and all-gathers, the bytes of one all-reduce.
    activation_counts: whose count of the activations a block and the head keep
      (tfpar.layout.placement.activation_bytes_per_block: "paper", Korthikanti et al.'s
      count of Megatron-LM's; "tfpar", what tfpar's backward reads, measured).
    transfers_per_microbatch: stage-boundary transfers on a stage's critical path per
      micro-batch (and chunk): 2 where a send and the matching receive run as one exchange
      (Megatron-LM's batched send/recv pairs; tfpar's receives, its sends not waited for);
      4 where the activation's send and receive and the gradient's are four blocking
      instructions one after another (DeepSpeed's pipeline engine, TrainSchedule).
    regather: under sequence parallelism each shard keeps only its slice of the gathered
      input of the column-parallel matmuls and gathers it again in the backward
      (Megatron-LM); else it keeps it whole (tfpar). tfpar.layout.placement has the counts.
  """
  name: str
  schedules: Tuple[str, ...]
  vocab_parallel: bool
  uniform_stages: bool
  scatter_gather: bool
  weight_bytes: Dict[str, int]
  grad_bytes: Dict[str, int]
  optimizer_bytes: Dict[str, int]
  shardings: Tuple[str, ...] = ("none",)
  sharding_with_float16: bool = True
  program_per_worker: bool = False
  zero2_gradient_shards: int = 1
  sharding_all_reduces: bool = False
  regather: bool = False
  activation_counts: str = "paper"
  transfers_per_microbatch: int = 2


_FP32 = plan_lib.BYTES_PER_PARAM
TFPAR = System(
    name="tfpar", schedules=schedule_lib.SCHEDULES, vocab_parallel=False, uniform_stages=False,
    scatter_gather=False,
    # Variables stay float32 under every policy; their gradients are float32 too.
    weight_bytes={p: _FP32 for p in COMPUTE_DTYPE}, grad_bytes={p: _FP32 for p in COMPUTE_DTYPE},
    optimizer_bytes={p: plan_lib.OPTIMIZER_SLOTS * _FP32 for p in COMPUTE_DTYPE},
    # tfpar.parallel.zero: m and v sharded (the float32 weights stay replicated); zero2's
    # chunked sum keeps its own shard and the one in flight; over the D copies of a
    # model-parallel plan too, per device position, by collectives among a stage's copies
    # once a replica spans nodes (tfpar.engines.stage_worker).
    shardings=SHARDINGS, sharding_with_float16=False, program_per_worker=True,
    zero2_gradient_shards=2,
    sharding_all_reduces=True, activation_counts="tfpar")  # zero3: tfpar.parallel.zero3.
MEGATRON = System(
    name="megatron", schedules=schedule_lib.SCHEDULES[1:], vocab_parallel=True, uniform_stages=True,
    scatter_gather=True,
    # Mixed precision: 16-bit weights, float32 main gradients, float32 master + Adam m, v.
    weight_bytes={"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2},
    grad_bytes={"float32": 4, "mixed_bfloat16": 4, "mixed_float16": 4},
    optimizer_bytes={"float32": 8, "mixed_bfloat16": 12, "mixed_float16": 12},
    # zero1 is Megatron-LM's distributed optimizer (--use-distributed-optimizer): master
    # weights, m and v split over the data-parallel group, the gradient buffer whole.
    shardings=SHARDINGS[:2], regather=True)
# Megatron-DeepSpeed (MT-NLG 530B, BLOOM 176B): Megatron-LM's tensor parallelism and model,
# DeepSpeed's pipeline engine: 1F1B only (its TrainSchedule), stages of L/K blocks or one
# apart (its partitioner), every tensor-parallel rank sending the whole activation (no
# scatter/gather) as separate blocking send and receive instructions, ZeRO-1 over the copies.
MEGATRON_DEEPSPEED = dataclasses.replace(
    MEGATRON, name="megatron-deepspeed", schedules=(schedule_lib.SCHEDULES[1],),
    scatter_gather=False, transfers_per_microbatch=4)
SYSTEMS = {"tfpar": TFPAR, "megatron": MEGATRON}


# --- FLOPs ---------------------------------------------------------------------

def layer_flops(m: ModelConfig) -> int:
  """Forward matmul FLOPs of one block for one sequence: projections, MLP, scores and mixing.

  2 s per weight of the block's matrices (its family's partitioning rules give
  their shapes: 4h^2 + 2hf for tfpar.layers.Block), plus 4 s^2 h for attention.
  """
  s, h = m.seq_len, m.d_model
  return 2 * s * plan_lib.rules_of(m).block_matmul_params(m) + 4 * s * s * h


def logits_flops(m: ModelConfig) -> int:
  """Forward FLOPs of the output projection for one sequence."""
  return 2 * m.seq_len * m.d_model * m.vocab_size


def attention_core_flops(m: ModelConfig) -> int:
  """Forward FLOPs of one block's attention core for one sequence: QK^T and the mixing, 4 s^2 h."""
  return 4 * m.seq_len * m.seq_len * m.d_model


def remat_index(remat) -> int:
  """A --remat mode (or a bool: True is full) as its index in REMATS."""
  return REMATS.index(remat) if isinstance(remat, str) else int(bool(remat))


def step_flops(m: ModelConfig, global_batch: int, remat) -> int:
  """FLOPs of one training step: forward, backward (2x forward) and what --remat recomputes.

  `remat`: a mode of REMATS, or a bool (True: full).
  """
  mode = remat_index(remat)
  return global_batch * ((3 + int(mode == FULL)) * m.num_layers * layer_flops(m) +
                         int(mode == SELECTIVE) * m.num_layers * attention_core_flops(m) +
                         3 * logits_flops(m))


def narayanan_flops(m: ModelConfig, global_batch: int) -> float:
  """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), recompute included."""
  b, s, l, h, v = global_batch, m.seq_len, m.num_layers, m.d_model, m.vocab_size
  return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


# --- Collectives ------------------------------------------------------------------

def all_reduce_seconds(nbytes, p, bandwidth, latency):
  """Ring all-reduce: 2 (p-1) steps of n/p bytes each (reduce-scatter, then all-gather)."""
  p = np.asarray(p, dtype=float)
  return np.where(p > 1, 2 * (p - 1) / p * nbytes / bandwidth + 2 * (p - 1) * latency, 0.0)


def all_gather_seconds(nbytes, p, bandwidth, latency):
  """Ring all-gather of n bytes in total: p - 1 steps of n/p bytes."""
  p = np.asarray(p, dtype=float)
  return np.where(p > 1, (p - 1) / p * nbytes / bandwidth + (p - 1) * latency, 0.0)


def p2p_seconds(nbytes, bandwidth, latency):
  return nbytes / bandwidth + latency


# --- Memory ----------------------------------------------------------------------

activation_bytes_per_block = plan_lib.activation_bytes_per_block  # Korthikanti et al. 2022
head_activation_bytes = plan_lib.head_activation_bytes


# --- Stages ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stages:
  """The K stages of a replica under one (K, T): blocks and parameters on each's busiest device."""
  blocks: np.ndarray  # [K] blocks per stage
  params: np.ndarray  # [K] parameters on the stage's first device (t = 0)
  logits: np.ndarray  # [K] 1 on the stage computing the logits


def stages(m: ModelConfig, k: int, t: int, system: System, uniform: bool = False) -> Stages:
  """Blocks and per-device parameters of each stage, from tfpar.layout.placement's counts.

  `uniform` (an interleaved schedule's chunks) gives L/K blocks per stage whatever the System.
  """
  return _stages(m, k, t, system.name, uniform or system.uniform_stages)


@functools.lru_cache(maxsize=None)
def _stages(m: ModelConfig, k: int, t: int, system_name: str, uniform: bool) -> Stages:
  system = {**SYSTEMS, MEGATRON_DEEPSPEED.name: MEGATRON_DEEPSPEED}[system_name]
  c = plan_lib.count_params(m, t)
  if uniform:  # L/K each; sizes differing by one where K does not divide L.
    blocks = np.array(plan_lib.even_stages(m.num_layers, k))
  else:
    blocks = np.array(plan_lib.balance_stages(m.num_layers, k, c.block, c.embedding, c.head))
  params = blocks * (c.block_shard + c.block_unsplit)
  if system.vocab_parallel:
    # The embedding with its VOCAB tables split by rows (the rest, positions, whole).
    rules = plan_lib.rules_of(m)
    whole, vocab_table = partitioning.shard_counts(rules, rules.embed_shapes(m), t,
                                                   vocab_parallel=True)
    params[0] += whole + vocab_table
    params[-1] += c.head + (vocab_table if k > 1 else 0)  # Megatron's copy of the tied table.
  else:
    params[0] += c.embedding
    params[-1] += c.head
  logits = np.zeros(k)
  logits[-1] = 1
  return Stages(blocks=blocks.astype(float), params=params.astype(float), logits=logits)


# --- The model -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plans:
  """Candidate plans as parallel arrays (one entry per plan)."""
  D: np.ndarray
  K: np.ndarray
  T: np.ndarray
  b: np.ndarray  # micro-batch size (sequences)
  remat: np.ndarray  # index into REMATS (a bool array: False none, True full)
  schedule: Optional[np.ndarray] = None  # index into tfpar.layout.schedule.SCHEDULES; None: the first
  v: Optional[np.ndarray] = None  # virtual stages per device (interleaved), else 1
  sharding: Optional[np.ndarray] = None  # index into SHARDINGS; None: none
  sp: Optional[np.ndarray] = None  # sequence parallelism (bool, T > 1); None: off

  def __len__(self):
    return len(self.D)



COMPONENTS = ("compute", "bubble", "tensor_comm", "pipeline_comm", "data_comm")
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "pipeline_buffers")


def efficiency(cluster: Cluster, width, rows):
  """Fraction of peak reached on matmuls of inner width `width` (h/T) and `rows` (b s)."""
  e = cluster.efficiency
  return e.max_efficiency / (1 + e.width_half / width + e.rows_half / rows)


def evaluate(m: ModelConfig, cluster: Cluster, plans: Plans, *, global_batch: int,
             precision: str, system: System) -> Dict[str, np.ndarray]:
  """Predicted memory and time of every plan.

  Returns:
    A dict of arrays over plans: M, memory parts (bytes on the busiest device)
    and `memory_bytes`, time components (seconds per step) and `step_seconds`,
    `fits`, `tokens_per_second`, `tflops_per_device` (executed FLOPs, recompute
    included, as Narayanan et al. count), `mfu` (model FLOPs, no recompute, over peak),
    `efficiency`, `schedule` and `v`.
  """
  n = len(plans)
  out = {key: np.zeros(n) for key in COMPONENTS + MEMORY_PARTS + ("efficiency", "params_per_device")}
  D, K, T, b = (np.asarray(x, dtype=float) for x in (plans.D, plans.K, plans.T, plans.b))
  z = np.zeros(n, dtype=int) if plans.sharding is None else np.asarray(plans.sharding, dtype=int)
  rm = np.where(z == ZERO3, FULL, np.asarray(plans.remat, dtype=int))  # zero3 recomputes.
  r, q = (rm == FULL).astype(float), (rm == SELECTIVE).astype(float)
  sp = np.zeros(n, dtype=bool) if plans.sp is None else np.asarray(plans.sp, dtype=bool)
  sched = (np.full(n, schedule_lib.SCHEDULES.index(system.schedules[0])) if plans.schedule is None
           else np.asarray(plans.schedule, dtype=int))
  v = np.ones(n) if plans.v is None else np.asarray(plans.v, dtype=float)
  M = global_batch / (D * b)
  s, h = m.seq_len, m.d_model
  act = ACTIVATION_BYTES[precision]
  peak = cluster.peak_flops.get(COMPUTE_DTYPE[precision])
  if peak is None:
    raise ValueError(f"cluster {cluster.name} has no peak_flops for {COMPUTE_DTYPE[precision]}")
  eff = efficiency(cluster, h / T, b * s)
  out["efficiency"] = eff
  per_param = (system.weight_bytes[precision], system.grad_bytes[precision],
               system.optimizer_bytes[precision])
  # Bandwidth of each group: inside a node while the group's span fits in one.
  dpn = cluster.devices_per_node
  bw = lambda span: np.where(span <= dpn, cluster.intra_bandwidth, cluster.inter_bandwidth)
  lat = lambda span: np.where(span <= dpn, cluster.intra_latency, cluster.inter_latency)
  f_layer, f_logits, f_core = layer_flops(m), logits_flops(m), attention_core_flops(m)
  # Optimizer sharding over the D replicas: zero1 the optimizer state, zero2 the gradient too.
  optimizer_share = np.where(z > 0, 1 / D, 1.0)
  grad_share = np.where(z == 2, np.minimum(1.0, system.zero2_gradient_shards / D),
                        np.where(z == ZERO3, 1 / D, 1.0))
  weight_share = np.where(z == ZERO3, 1 / D, 1.0)
  # A replica spanning nodes (stages on different workers): one program per worker, a
  # stage's copies summed by collectives (`stage_worker_gradients` held).
  spanning = replica_spans_nodes(system, cluster, D, K, T)
  own_programs = one_program_per_worker(system, cluster, K, T)
  embedding = plan_lib.count_params(m).embedding
  grad_share = np.where(spanning & (z != ZERO3), stage_worker_gradients(D, z, system), grad_share)
  slot = np.zeros(n)
  interleaved = sched == schedule_lib.INTERLEAVED
  for k, t, uniform in set(zip(plans.K.tolist(), plans.T.tolist(), interleaved.tolist())):
    idx = np.flatnonzero((plans.K == k) & (plans.T == t) & (interleaved == uniform))
    st = stages(m, int(k), int(t), system, uniform=uniform)
    tv = t if system.vocab_parallel else 1
    bi, ri, mi, ei = b[idx, None], r[idx, None], M[idx, None], eff[idx, None]  # [P, 1] vs [K]
    qi, rmi, spi = q[idx, None], rm[idx, None], sp[idx, None]
    # Time of one micro-batch on each stage: matmuls, fixed per-op costs, tensor-parallel sums.
    flops = bi * (((3 + ri) * f_layer + qi * f_core) * st.blocks / t +
                  3 * st.logits * f_logits / tv)
    compute = flops / (peak * ei)
    ops = st.blocks * (2 + ri) * cluster.efficiency.op_seconds
    # Elementwise ops (LayerNorm, GELU, softmax, dropout, bias) are bound by memory
    # bandwidth: the forward writes the block's activations, the backward reads them
    # and writes as many gradients, a recompute writes them again.
    # Selective recompute writes the attention core's part again.
    # Sequence parallelism splits the elementwise ops' bytes too; its reduce-scatter and
    # all-gather move the bytes of the all-reduce they replace (tensor_comm unchanged).
    counts = dict(regather=system.regather, counts=system.activation_counts)
    kept, touched = activation_bytes_per_block(m, bi, t, rmi, precision, spi, **counts)
    core = touched - activation_bytes_per_block(m, bi, t, SELECTIVE, precision, spi, **counts)[0]
    ops = ops + st.blocks * ((3 + ri) * touched + qi * core) / cluster.memory_bandwidth
    tp = st.blocks * (4 + 2 * ri) * all_reduce_seconds(bi * s * h * act, t, bw(t), lat(t))
    rows = np.arange(len(idx))
    if cluster.shared:  # Every device's work, one after another: D replicas x T shards.
      total = lambda x: D[idx] * M[idx] * t * x.sum(axis=1)
      out["compute"][idx] = total(compute + ops)
      out["tensor_comm"][idx] = total(tp)
    else:  # The devices work at once: the busiest stage sets the pace.
      busiest = np.argmax(compute + ops + tp, axis=1)
      out["compute"][idx] = mi[:, 0] * (compute + ops)[rows, busiest]
      out["tensor_comm"][idx] = mi[:, 0] * tp[rows, busiest]
      slot[idx] = (compute + ops + tp)[rows, busiest]
    # Memory of each stage's first device; the plan needs the largest.
    # The block whose backward runs holds what its recompute rebuilt, on top.
    in_flight = schedule_lib.in_flight(sched[idx, None], mi, v[idx, None], k)
    acts = in_flight * st.blocks * kept + ri * touched + qi * core
    logits_in_flight = np.where(sched[idx, None] == schedule_lib.GPIPE, mi, 1.0)
    acts = acts + st.logits * head_activation_bytes(m, bi, precision, system.activation_counts,
                                                    tv) * logits_in_flight
    # One program per worker: the last stage's worker holds its own copy of the embedding
    # (tfpar.engines.stage_worker), weights, gradients and AdamW state.
    params = st.params[None, :] + np.where(own_programs[idx, None] & (k > 1),
                                           embedding * (np.arange(k) == k - 1), 0.0)
    state = params * (per_param[0] * weight_share[idx, None] +
                      per_param[1] * grad_share[idx, None] +
                      per_param[2] * optimizer_share[idx, None])
    worst = np.argmax(acts + state, axis=1)
    for part, bytes_per, share in zip(("weights", "gradients", "optimizer"), per_param,
                                      (weight_share[idx], grad_share[idx], optimizer_share[idx])):
      out[part][idx] = params[rows, worst] * bytes_per * share
    out["activations"][idx] = acts[rows, worst]
    out["pipeline_buffers"][idx] = np.where(k > 1, 2 * b[idx] * s * h * act, 0.0)
    # The device holding the most parameters (its gradients are the largest all-reduce).
    out["params_per_device"][idx] = params.max(axis=1)
  # zero3: one part's weights gathered whole, its full gradient and one group's rows of
  # that gradient's sum (the groups are summed in turn).
  gathered = np.where(z == ZERO3, zero3_part_params(m), 0.0)
  out["weights"] += gathered * per_param[0]
  out["gradients"] += (1 + 1 / zero3_sum_chunks(D)) * gathered * per_param[1]
  # Pipeline: activations to the next stage and gradients back, per micro-batch and
  # boundary (v boundaries per device when interleaved), on the link K x T spans.
  p2p = np.where(K > 1, system.transfers_per_microbatch *
                 stage_send_seconds(b * s * h * act, K, T, cluster, system), 0.0)
  out["pipeline_comm"] = M * v * p2p
  # On a shared host a stage's idle time is another stage's working time: no bubble cost.
  # Else the fill and drain: K - 1 chunk slots (a chunk is 1/v of a stage) and sends.
  out["bubble"] = np.zeros(n) if cluster.shared else (K - 1) * (slot / v + p2p)
  # Data parallel: the busiest device's gradients summed over the D copies by collectives
  # (and, sharded, the new weight shards brought back).
  grads = out["params_per_device"] * system.grad_bytes[precision]
  weights = out["params_per_device"] * system.weight_bytes[precision]
  out["data_comm"] = np.where(
      z == ZERO3, zero3_seconds(grads, weights, D, m.num_layers + 2, bw(D), lat(D)),
      collective_seconds(grads, weights, D, z, bw(D * K * T), lat(D * K * T), system))
  # The tied embedding's two copies (first and last stage) sum their gradients once a step:
  # Megatron-LM's vocabulary-parallel shards, tfpar's workers of one program each.
  tied = (m.vocab_size * m.d_model / T if system.vocab_parallel else
          np.where(own_programs, embedding, 0.0)) * system.grad_bytes[precision]
  out["data_comm"] = out["data_comm"] + np.where(
      (K > 1) & (tied > 0), all_reduce_seconds(tied, 2, bw(K * T), lat(K * T)), 0.0)
  out["M"] = M
  out["schedule"], out["v"], out["remat"], out["sharding"] = sched, v, rm, z
  out["sequence_parallel"] = sp
  out["step_seconds"] = sum(out[c] for c in COMPONENTS)
  out["memory_bytes"] = sum(out[p] for p in MEMORY_PARTS)
  out["fits"] = out["memory_bytes"] <= cluster.memory_bytes
  devices = D * K * T
  executed = np.select([rm == mode for mode in range(len(REMATS))],
                       [float(step_flops(m, global_batch, mode)) for mode in REMATS])
  out["tokens_per_second"] = global_batch * s / out["step_seconds"]
  out["tflops_per_device"] = executed / out["step_seconds"] / devices / 1e12
  # A shared host's devices take turns at its peak: the host is the unit of utilisation.
  units = 1 if cluster.shared else devices
  out["mfu"] = float(step_flops(m, global_batch, False)) / out["step_seconds"] / units / peak
  out["bubble_fraction"] = schedule_lib.bubble(K, M, v)
  return out


# tfpar.engines.stage_worker sums a stage's copies as one flat vector per bucket: it holds
# the vectors and their sums beside the accumulated gradients (modelled from the code, not
# measured).
PER_WORKER_SUM_GRADIENTS = 1.0


def stage_worker_gradients(D, z, system: System):
  """Gradients a stage worker holds at once (x its parameters' gradient bytes) when a stage's
  D copies sum by collectives (tfpar.engines.stage_worker), modelled from the code, not
  measured: unsharded and under zero1 the exchange sums the whole gradient, a flat vector
  per bucket (p2p.Among.sum: a CollectiveReduceV2 per bucket and device), at most
  1 + PER_WORKER_SUM_GRADIENTS;
  zero1 then cuts its shard from the sum. zero2 (`_zero_step`, zero.reduce_scatter with
  p2p.Among) sums D shard-sized chunks in turn, each sliced from the gradient, which stays
  whole through the D rounds: 1 + the sum's shards alive (its own and the one in flight,
  `zero2_gradient_shards` of D, as the data-parallel zero2 counts). The all-gathered new
  weights are transient and not counted, as for every sharded plan here."""
  D = np.asarray(D, dtype=float)
  return 1.0 + np.where(np.asarray(z) == 2, np.minimum(1.0, system.zero2_gradient_shards / D),
                        PER_WORKER_SUM_GRADIENTS)


def replica_spans_nodes(system: System, cluster: Cluster, D, K, T) -> np.ndarray:
  """Which plans have D > 1 copies of a replica whose K x T devices span nodes (tfpar: stages
  on different workers, one program per worker, tfpar.engines.stage_worker)."""
  D, span = np.asarray(D, dtype=float), np.asarray(K, dtype=float) * T
  return system.program_per_worker & (D > 1) & (span > cluster.devices_per_node)


def one_program_per_worker(system: System, cluster: Cluster, K, T) -> np.ndarray:
  """Which plans put a replica's stages on different workers, each its own program
  (tfpar.engines.stage_worker, under every sharding the planner plans there)."""
  span = np.asarray(K, dtype=float) * T
  return system.program_per_worker & (np.asarray(K) > 1) & (span > cluster.devices_per_node)


def collective_seconds(grads, weights, D, z, bandwidth, latency, system: System):
  """The data-parallel exchange of replicas in sync: one ring all-reduce of the gradient,
  and for a System that all-reduces before sharding (tfpar) an all-gather of the new weights."""
  out = all_reduce_seconds(grads, D, bandwidth, latency)
  if system.sharding_all_reduces:
    out = out + np.where(z > 0, all_gather_seconds(weights, D, bandwidth, latency), 0.0)
  return out


def zero3_part_params(m: ModelConfig) -> int:
  """Parameters of zero3's largest part (tfpar.parallel.zero3): a block, or the weights outside
  the blocks (the embedding and head both gather all of them)."""
  counts = plan_lib.count_params(m)
  return max(counts.block, counts.embedding + counts.head)


ZERO3_SUM_CHUNKS = 4  # tfpar.parallel.zero3.SUM_CHUNKS.


def zero3_sum_chunks(D):
  """How many all-reduces, one after another, make a zero3 part's summed gradient: C."""
  return np.minimum(np.asarray(D, dtype=float), ZERO3_SUM_CHUNKS)


def zero3_seconds(grads, weights, D, parts: int, bandwidth, latency):
  """zero3's exchange (tfpar.parallel.zero3): each of the `parts` parts all-gathers its weights
  in the forward and again in the backward, and sums its gradient a group of replicas' rows at
  a time (C = min(D, 4) all-reduces of 1/C of it: the replica context has no reduce-scatter,
  and this holds one group's sum at a time); the norm is one scalar all-reduce:
      2 (D-1)/D w/B + 2 (D-1)/D n/B + (2 + 2 C) (D-1) a per part + 2 (D-1) a."""
  D = np.asarray(D, dtype=float)
  return np.where(D > 1, 2 * all_gather_seconds(weights, D, bandwidth, 0.0)
                  + all_reduce_seconds(grads, D, bandwidth, 0.0)
                  + (parts * (2 + 2 * zero3_sum_chunks(D)) + 2) * (D - 1) * latency, 0.0)


def stage_send_seconds(nbytes, K, T, cluster: Cluster, system: System):
  """One stage-boundary send of an n-byte activation (or its gradient).

  Inside a node while the replica's K x T devices fit in one, else on the
  inter-node network (stages on different workers). With scatter/gather each
  of the T shards sends n/T and the receivers all-gather inside the node.
  """
  span = np.asarray(K, dtype=float) * T
  inter = span > cluster.devices_per_node
  bw = np.where(inter, cluster.inter_bandwidth, cluster.intra_bandwidth)
  lat = np.where(inter, cluster.inter_latency, cluster.intra_latency)
  if not system.scatter_gather:
    return p2p_seconds(nbytes, bw, lat)
  return p2p_seconds(nbytes / T, bw, lat) + all_gather_seconds(
      nbytes, T, cluster.intra_bandwidth, cluster.intra_latency)


def training_run(results: Dict[str, np.ndarray], devices: int, cluster: Cluster, *,
                 global_batch: int, seq_len: int, train_tokens: float, pue: float,
                 price_per_device_hour: Optional[float] = None) -> Dict[str, np.ndarray]:
  """Wall-clock time, device-hours, energy and cost of training on train_tokens tokens.

  steps = ceil(tokens / (G s)); wall = steps x step seconds; device-hours =
  devices x wall / 3600; energy = device-hours x the device's power (its TDP,
  Cluster.power_watts) x PUE, in kWh; cost = device-hours x price.
  """
  steps = np.ceil(train_tokens / (global_batch * seq_len))
  wall = steps * results["step_seconds"]
  device_hours = devices * wall / 3600
  out = {"train_steps": np.full(len(wall), steps), "wall_seconds": wall,
         "device_hours": device_hours,
         "energy_kwh": device_hours * cluster.power_watts / 1000 * pue,
         "pue": np.full(len(wall), pue)}
  if price_per_device_hour is not None:
    out["cost"] = device_hours * price_per_device_hour
  return out
