"""The published runs the cost model is calibrated against.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21), Table 1: A100 80 GB, sequence 2048,
vocabulary 51,200, mixed precision, Adam, full activation recompute, 8 GPUs
per node, data-parallel size = GPUs / (TP x PP). The achieved TFLOP/s per GPU
count narayanan_flops (recompute included). The micro-batch size and the
schedule of each row are those of the script that ran the table,
Megatron-LM's examples/sc21/run_table_1.sh: 1F1B where PP = 2 or 64,
interleaved with --num-layers-per-virtual-pipeline-stage 5, 5, 3 and 1 (v = 3,
2, 2, 3) for the 76B, 145B, 310B and 530B rows.

`python scripts/planner_table.py` prints the docs/planner.md table from here.
"""

import dataclasses
from typing import List

from tfpar.config.schema import ModelConfig
from tfpar.planner import clusters, cost, report, search

SEQ_LEN, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class Row:
  params_billion: float
  heads: int
  hidden: int
  layers: int
  tp: int
  pp: int
  gpus: int
  batch: int
  tflops: float  # achieved per GPU
  microbatch: int  # micro-batch size (sequences)
  layers_per_chunk: int = 0  # --num-layers-per-virtual-pipeline-stage; 0: plain 1F1B

  @property
  def virtual_stages(self) -> int:
    return self.layers // (self.pp * self.layers_per_chunk) if self.layers_per_chunk else 1

  @property
  def schedule(self) -> str:
    return "interleaved" if self.virtual_stages > 1 else "1f1b"

  @property
  def model(self) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, num_layers=self.layers,
                       d_model=self.hidden, num_heads=self.heads, d_ff=4 * self.hidden)

  @property
  def dp(self) -> int:
    return self.gpus // (self.tp * self.pp)


TABLE_1 = [Row(*r) for r in [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
]]
PRECISION = "mixed_float16"


@dataclasses.dataclass(frozen=True)
class Comparison:
  row: Row
  published: dict  # the planner's evaluation of the published D x K x T (best micro-batch)
  picked: dict  # the planner's own choice for the same model, GPUs and batch

  @property
  def predicted_tflops(self) -> float:
    """Per-GPU TFLOP/s as the paper counts them (narayanan_flops over the predicted step)."""
    return cost.narayanan_flops(self.row.model, self.row.batch) / \
        self.published["step_seconds"] / self.row.gpus / 1e12


def compare(row: Row, efficiency: clusters.Efficiency = None, search_own: bool = True) -> Comparison:
  """Evaluates the published plan (its micro-batch and schedule) and (search_own) searches the
  planner's own.

  `efficiency` replaces the cluster's constants (scripts/planner_table.py --fit).
  """
  cluster = clusters.parse(f"a100-80gb:{row.gpus}")
  if efficiency is not None:
    cluster = dataclasses.replace(cluster, efficiency=efficiency)
  kwargs = dict(global_batch=row.batch, precision=PRECISION, system=cost.MEGATRON)
  published = search.candidates(row.model, cluster, row.batch, cost.MEGATRON,
                                data_parallel=row.dp, pipeline_stages=row.pp,
                                tensor_parallel=row.tp, remat="full", optimizer_sharding="none",
                                sequence_parallel=False,
                                microbatches=row.batch // (row.dp * row.microbatch),
                                pipeline_schedule=row.schedule if row.pp > 1 else None,
                                virtual_stages=row.virtual_stages)
  ranked_published = search.rank(row.model, cluster, published, **kwargs)
  published_best = ranked_published.row(ranked_published.order[0])
  if not search_own:
    return Comparison(row=row, published=published_best, picked=published_best)
  # Megatron-LM as the paper ran it: full recompute or none, no distributed optimizer, no
  # sequence parallelism (Korthikanti et al. came a year later).
  free = search.candidates(row.model, cluster, row.batch, cost.MEGATRON, remat=("none", "full"),
                           optimizer_sharding="none", sequence_parallel=False)
  ranked_free = search.rank(row.model, cluster, free, **kwargs)
  return Comparison(row=row, published=published_best, picked=ranked_free.row(ranked_free.order[0]))


def compare_all(efficiency: clusters.Efficiency = None, search_own: bool = True) -> List[Comparison]:
  return [compare(row, efficiency, search_own) for row in TABLE_1]


def table(comparisons: List[Comparison]) -> str:
  """The docs/planner.md table: published, predicted, picked."""
  lines = ["| params (B) | GPUs | batch | published TP x PP, micro-batch, schedule | published TFLOP/s | predicted "
           "TFLOP/s (published plan) | error | GiB/GPU | step s | picked D x K x T, micro-batch, "
           "recompute, schedule | picked step s | speed-up | picked GiB/GPU |",
           "|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
  for c in comparisons:
    r, p, k = c.row, c.published, c.picked
    err = c.predicted_tflops / r.tflops - 1
    lines.append(
        f"| {r.params_billion} | {r.gpus} | {r.batch} | {r.tp} x {r.pp}, {r.microbatch}, "
        f"{report.schedule(p)} | {r.tflops:.0f} | "
        f"{c.predicted_tflops:.1f} | {err:+.1%} | {p['memory_bytes_per_device'] / 2 ** 30:.1f} | "
        f"{p['step_seconds']:.2f} | "
        f"{k['data_parallel']} x {k['pipeline_stages']} x {k['tensor_parallel']}, "
        f"{k['microbatch_size']}, {'on' if k['remat'] == 'full' else 'off'}, "
        f"{report.schedule(k)} | "
        f"{k['step_seconds']:.2f} | "
        f"{p['step_seconds'] / k['step_seconds']:.2f}x | "
        f"{k['memory_bytes_per_device'] / 2 ** 30:.1f} |")
  return "\n".join(lines)


# --- Published runs outside the calibration set ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Published:
  """A published training run the constants were not fitted to, as its authors report it."""
  name: str
  source: str
  layers: int
  hidden: int
  heads: int
  vocab: int
  tp: int
  pp: int
  gpus: int
  batch: int
  microbatch: int
  step_seconds: float  # reported seconds per step (iteration)
  tflops: float  # reported per GPU, recompute included (Narayanan et al.'s count)
  precision: str = "mixed_float16"
  inter_bandwidth: float = 0.0  # bytes/s one way per GPU between nodes; 0: a100-80gb's

  @property
  def model(self) -> ModelConfig:
    return ModelConfig(vocab_size=self.vocab, seq_len=SEQ_LEN, num_layers=self.layers,
                       d_model=self.hidden, num_heads=self.heads, d_ff=4 * self.hidden)

  @property
  def dp(self) -> int:
    return self.gpus // (self.tp * self.pp)

  @property
  def cluster(self) -> clusters.Cluster:
    cluster = clusters.parse(f"a100-80gb:{self.gpus}")
    if self.inter_bandwidth:
      cluster = dataclasses.replace(cluster, inter_bandwidth=self.inter_bandwidth)
    return cluster


# Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", section
# 2.4: batch 1920 on 280, 350 and 420 DGX A100 nodes of Selene (the Table 1 machine), 8-way
# tensor and 35-way pipeline parallelism, micro-batch 1 (GPT-2's vocabulary, padded as Megatron
# pads it for T = 8). BLOOM 176B (BigScience 2022), Megatron-DeepSpeed on 48 nodes of Jean Zay:
# TP 4, PP 12, micro-batch 2, batch 2048, bf16, full recompute, 70 blocks on 12 stages (its
# 'type:transformer|embedding' partition: 5, 6 x 10, 5), four 100 Gb/s Omni-Path links per node
# of 8 GPUs (bigscience-workshop/bigscience train/tr11-176B-ml: the slurm script; chronicles.md:
# 105.22 s per step, 149.02 TFLOPs at batch 2048).
PUBLISHED = [
    Published("MT-NLG 530B, 280 nodes", "Smith et al. 2022", 105, 20480, 128, 51200, 8, 35,
              2240, 1920, 1, 60.1, 126),
    Published("MT-NLG 530B, 350 nodes", "Smith et al. 2022", 105, 20480, 128, 51200, 8, 35,
              2800, 1920, 1, 50.2, 121),
    Published("MT-NLG 530B, 420 nodes", "Smith et al. 2022", 105, 20480, 128, 51200, 8, 35,
              3360, 1920, 1, 44.4, 113),
    Published("BLOOM 176B, 48 nodes", "BigScience 2022", 70, 14336, 112, 250880, 4, 12, 384,
              2048, 2, 105.22, 149.02, precision="mixed_bfloat16", inter_bandwidth=4 * 100e9 / 8 / 8),
]


def predict_published(run: Published, system: cost.System = cost.MEGATRON_DEEPSPEED) -> dict:
  """The planner's evaluation of a published run's own layout (1F1B, full recompute, the
  distributed optimizer): the plan's row, with `stage_blocks` added."""
  m, cluster = run.model, run.cluster
  plans = search.candidates(m, cluster, run.batch, system, data_parallel=run.dp,
                            pipeline_stages=run.pp, tensor_parallel=run.tp, remat="full",
                            optimizer_sharding="zero1", sequence_parallel=False,
                            microbatches=run.batch // (run.dp * run.microbatch),
                            pipeline_schedule="1f1b")
  ranked = search.rank(m, cluster, plans, global_batch=run.batch, precision=run.precision,
                       system=system)
  row = ranked.row(ranked.order[0])
  row["stage_blocks"] = [int(x) for x in cost.stages(m, run.pp, run.tp, system).blocks]
  row["narayanan_tflops"] = cost.narayanan_flops(m, run.batch) / row["step_seconds"] / \
      run.gpus / 1e12
  return row


def published_table(system: cost.System = cost.MEGATRON_DEEPSPEED) -> str:
  """The docs/planner.md table of published runs: reported against predicted."""
  lines = ["| run | source | GPUs | TP x PP x DP, micro-batch | stages (blocks) | reported s/step "
           "| predicted s/step | reported TFLOP/s | predicted TFLOP/s | predicted / reported "
           "throughput | GiB/GPU |",
           "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
  for run in PUBLISHED:
    row = predict_published(run, system)
    blocks = row["stage_blocks"]
    shown = (f"{blocks[0]} x {run.pp}" if len(set(blocks)) == 1 else
             ", ".join(str(b) for b in blocks[:2]) + f", ..., {blocks[-1]}")
    lines.append(
        f"| {run.name} | {run.source} | {run.gpus} | {run.tp} x {run.pp} x {run.dp}, "
        f"{run.microbatch} | {shown} | {run.step_seconds:.1f} | {row['step_seconds']:.1f} | "
        f"{run.tflops:.0f} | {row['narayanan_tflops']:.1f} | "
        f"{run.step_seconds / row['step_seconds']:.3f} | "
        f"{row['memory_bytes_per_device'] / 2 ** 30:.1f} |")
  return "\n".join(lines)
