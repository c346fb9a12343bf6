"""Search: every D x K x T x micro-batch x recompute x schedule x optimizer sharding x
sequence parallelism plan a cluster allows, ranked.

Candidates: T divides the head count and d_ff and stays inside a node (tensor
parallelism sums activations twice per sub-block: it needs the fastest link);
K <= L (and divides L where the System wants uniform stages); pipeline stages
may sit on different nodes (tfpar: a replica spanning nodes fills whole ones); D = N / (K T) divides the global batch; the
micro-batch b divides G / D; recompute none, full and selective; with K > 1
each schedule the System runs: GPipe, 1F1B, and interleaved with v virtual
stages where K v divides L and K divides M (Megatron-LM's conditions); with
D > 1 each optimizer sharding the System runs (tfpar: zero1 and zero2, zero3 only with
K = T = 1, M = 1 and full recompute (what tfpar.parallel.zero3 runs on whole replicas; its
one-host pipeline plans, tfpar.engines.hybrid_zero3, are not modelled); zero1 and zero2 a
replica inside one node or spanning nodes, not under mixed_float16, as
tfpar.config.rules allows; Megatron: zero1, its distributed optimizer); with T > 1
sequence parallelism off and on (both Systems run it). With tfpar on TPUs only data parallelism runs. The candidates of
4,096 devices number a few thousand: one vectorised pass.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from tfpar.config.schema import ModelConfig
from tfpar.layout import schedule as schedule_lib
from tfpar.planner import cost
from tfpar.planner.clusters import Cluster

MAX_MICROBATCH = 64  # Beyond this b the matmuls are as efficient as they get.
# What cost.training_run adds to the results (with --train_tokens).
RUN_KEYS = ("train_steps", "wall_seconds", "device_hours", "energy_kwh", "pue", "cost")


def divisors(n: int) -> List[int]:
  return [i for i in range(1, n + 1) if n % i == 0]


def schedules(m: ModelConfig, k: int, mb: int, system: cost.System,
              pipeline_schedule: Optional[str], virtual_stages: Optional[int]):
  """(schedule index, v) pairs for K stages and M micro-batches; a given schedule or v fixes it."""
  if k == 1:  # No pipeline: the schedule changes nothing; one entry (unless one was asked for).
    names = [pipeline_schedule or system.schedules[0]]
  else:
    names = [pipeline_schedule] if pipeline_schedule else list(system.schedules)
  out = []
  for name in names:
    if name != "interleaved":
      if virtual_stages in (None, 1):
        out.append((schedule_lib.SCHEDULES.index(name), 1))
      continue
    if k == 1 or m.num_layers % k or mb % k:
      continue
    chunks = [v for v in divisors(m.num_layers // k) if v > 1]
    for v in chunks if virtual_stages is None else [virtual_stages] if virtual_stages in chunks \
        else []:
      out.append((schedule_lib.INTERLEAVED, v))
  return out


def _options(given, every: Sequence) -> tuple:
  """The values to try: all of `every` (None), the ones given (a tuple) or the one given."""
  return tuple(every) if given is None else tuple(given) if isinstance(given, tuple) else (given,)


def candidates(m: ModelConfig, cluster: Cluster, global_batch: int, system: cost.System, *,
               data_parallel: Optional[int] = None, pipeline_stages: Optional[int] = None,
               tensor_parallel: Optional[int] = None, microbatches: Optional[int] = None,
               remat=None, pipeline_schedule: Optional[str] = None,
               virtual_stages: Optional[int] = None, optimizer_sharding=None,
               sequence_parallel: Optional[bool] = None,
               precision: Optional[str] = None) -> cost.Plans:
  """All plans using every device of the cluster; any degree given fixes that degree.

  `remat` and `optimizer_sharding`: a mode (a bool for remat: True is full), a tuple
  of modes to try, or None for all (the System's shardings). `sequence_parallel`:
  True or False fixes it (True only where T > 1), None tries both where T > 1.
  `precision` rules out tfpar's sharding under mixed_float16. tfpar refuses full
  recompute with dropout (tfpar.config.rules), so its plans for a model with dropout do not use it.
  """
  remats = [cost.remat_index(x) for x in _options(remat, cost.REMATS)]
  if system is cost.TFPAR and m.dropout > 0:  # Its recomputed blocks would draw new masks.
    remats = [r for r in remats if r != cost.remat_index("full")]
  shardings = [cost.SHARDINGS.index(x) for x in _options(optimizer_sharding, system.shardings)]
  n, dpn = cluster.devices, cluster.devices_per_node
  rows = []
  # A tensor-parallel group sits inside one node: T divides the node (or the whole host).
  t_options = [t for t in divisors(m.num_heads) if m.d_ff % t == 0 and n % t == 0 and
               (dpn % t == 0 if n > dpn else t <= n)]
  for t in t_options if tensor_parallel is None else [t for t in t_options if t == tensor_parallel]:
    for k in divisors(n // t) if pipeline_stages is None else [pipeline_stages]:
      if k > m.num_layers or (system.uniform_stages and m.num_layers % k and
                              pipeline_stages is None):
        continue  # Uneven stages (cost.System.uniform_stages) only where K is given.
      if n % (k * t):
        continue
      d = n // (k * t)
      if data_parallel is not None and d != data_parallel:
        continue
      if system is cost.TFPAR and cluster.kind == "tpu" and k * t > 1:
        continue  # tfpar's TPUStrategy path is data parallel only.
      if system is cost.TFPAR and k * t > dpn and (k * t) % dpn:
        continue  # tfpar.config.rules.worker_layout: a replica spanning workers fills whole ones.
      if global_batch % d:
        continue
      per_replica = global_batch // d
      for mb in divisors(per_replica):
        b = per_replica // mb
        if microbatches is not None and mb != microbatches:
          continue
        if microbatches is None and b > MAX_MICROBATCH:
          continue
        for sched, v in schedules(m, k, mb, system, pipeline_schedule, virtual_stages):
          for r in remats:
            for z in shardings:
              if z and not shards_optimizer(system, d, precision):
                continue
              if z == cost.ZERO3 and (k * t > 1 or mb > 1 or r != cost.FULL):
                continue  # zero3: whole data-parallel replicas; it recomputes every block.
              for sp in sequence_parallels(t, sequence_parallel):
                rows.append((d, k, t, b, r, sched, v, z, sp))
  a = np.array(rows, dtype=int).reshape(-1, 9)
  return cost.Plans(D=a[:, 0], K=a[:, 1], T=a[:, 2], b=a[:, 3], remat=a[:, 4],
                    schedule=a[:, 5], v=a[:, 6], sharding=a[:, 7], sp=a[:, 8].astype(bool))


def sequence_parallels(t: int, given: Optional[bool]) -> tuple:
  """Sequence parallelism off (0) and on (1) to try at T shards: on needs T > 1."""
  options = (0, 1) if t > 1 else (0,)
  return options if given is None else tuple(o for o in options if o == int(given))


def shards_optimizer(system: cost.System, d: int, precision: Optional[str]) -> bool:
  """Whether the System can shard the optimizer of this plan: D > 1, and for tfpar no
  mixed_float16 (tfpar.config.rules' conditions; a replica may span nodes)."""
  return d > 1 and (system.sharding_with_float16 or precision != "mixed_float16")


@dataclasses.dataclass
class Ranked:
  """Plans and their predictions, fastest fitting plan first."""
  plans: cost.Plans
  results: Dict[str, np.ndarray]
  order: np.ndarray  # indices: fitting plans by step time, then the others by memory
  seconds: float = 0.0  # how long the search took (candidates, cost model, ranking)

  def row(self, i: int) -> dict:
    """One plan as a plain dict (what --format=json prints)."""
    p, r = self.plans, self.results
    out = {"data_parallel": int(p.D[i]), "pipeline_stages": int(p.K[i]),
           "tensor_parallel": int(p.T[i]), "microbatch_size": int(p.b[i]),
           "microbatches": int(round(r["M"][i])), "remat": cost.REMATS[int(r["remat"][i])],
           "optimizer_sharding": cost.SHARDINGS[int(r["sharding"][i])],
           "sequence_parallel": bool(r["sequence_parallel"][i]),
           "pipeline_schedule": schedule_lib.SCHEDULES[int(r["schedule"][i])],
           "virtual_stages": int(r["v"][i]),
           "fits": bool(r["fits"][i]), "memory_bytes_per_device": float(r["memory_bytes"][i]),
           "memory": {k: float(r[k][i]) for k in cost.MEMORY_PARTS},
           "step_seconds": float(r["step_seconds"][i]),
           "time": {k: float(r[k][i]) for k in cost.COMPONENTS},
           "tokens_per_second": float(r["tokens_per_second"][i]),
           "tflops_per_device": float(r["tflops_per_device"][i]), "mfu": float(r["mfu"][i]),
           "bubble_fraction": float(r["bubble_fraction"][i])}
    for key in RUN_KEYS:
      if key in r:
        out[key] = float(r[key][i])
    if not out["fits"]:
      out["rejected"] = "out of memory"
    return out


def rank(m: ModelConfig, cluster: Cluster, plans: cost.Plans, *, global_batch: int,
         precision: str, system: cost.System) -> Ranked:
  results = cost.evaluate(m, cluster, plans, global_batch=global_batch, precision=precision,
                          system=system)
  fits = results["fits"]
  fitting = np.flatnonzero(fits)
  others = np.flatnonzero(~fits)
  order = np.concatenate([fitting[np.argsort(results["step_seconds"][fitting], kind="stable")],
                          others[np.argsort(results["memory_bytes"][others], kind="stable")]])
  return Ranked(plans=plans, results=results, order=order)


def why_slower(ranked: Ranked, i: int, best: int) -> str:
  """Why plan i loses to the best plan: memory, or the time component that grew most."""
  r = ranked.results
  if not r["fits"][i]:
    return f"out of memory ({r['memory_bytes'][i] / 2 ** 30:.1f} GiB per device)"
  grown = {c: r[c][i] - r[c][best] for c in cost.COMPONENTS}
  worst = max(grown, key=grown.get)
  names = {"compute": "compute (smaller matmuls or recompute)", "bubble": "pipeline bubble",
           "tensor_comm": "tensor-parallel bandwidth", "pipeline_comm": "pipeline bandwidth",
           "data_comm": "data-parallel bandwidth"}
  return (f"{r['step_seconds'][i] / r['step_seconds'][best]:.2f}x slower: {names[worst]} "
          f"+{grown[worst]:.3g} s")


def refusal(m: ModelConfig, cluster: Cluster, global_batch: int, system: cost.System,
            fixed: dict, precision: Optional[str] = None) -> str:
  """Why `candidates` found no plan with the `fixed` values: the first rule they break, and
  its fix, in one line (the rules in the order `candidates` applies them)."""
  n, dpn, heads, L = cluster.devices, cluster.devices_per_node, m.num_heads, m.num_layers
  t, k, d, mb = (fixed.get(x) for x in ("tensor_parallel", "pipeline_stages", "data_parallel",
                                         "microbatches"))
  v, schedule = fixed.get("virtual_stages"), fixed.get("pipeline_schedule")
  sharding, sp = fixed.get("optimizer_sharding"), fixed.get("sequence_parallel")
  tfpar = system is cost.TFPAR
  node = f"nodes of {dpn}" if n > dpn else f"{n} devices"

  def divisors_of(x, most=None):
    """x's divisors (up to `most`), the first 12 of them."""
    small = [i for i in range(1, math.isqrt(x) + 1) if x % i == 0]
    found = sorted(set(small + [x // i for i in small]))
    found = [i for i in found if most is None or i <= most]
    return ", ".join(str(i) for i in found[:12]) + (", ..." if len(found) > 12 else "")

  def first_broken():
    if t is not None:
      for name, size in (("--num_heads", heads), ("--d_ff", m.d_ff)):
        if size % t:
          yield (f"T divides {name}: --tensor_parallel={t} does not divide {name}={size}; use "
                 f"one of {divisors_of(math.gcd(heads, m.d_ff), dpn)}")
      if n % t or (n > dpn and dpn % t) or t > n:
        yield (f"a tensor-parallel group sits in one node: --tensor_parallel={t} does not "
               f"divide the {node} of {cluster.name}; use one of "
               f"{divisors_of(math.gcd(dpn if n > dpn else n, math.gcd(heads, m.d_ff)))}")
    if tfpar and cluster.kind == "tpu" and (t or 1) * (k or 1) > 1:
      yield ("tfpar runs only data parallelism on TPUs (--strategy=tpu): drop "
             "--pipeline_stages and --tensor_parallel, or use --system=megatron")
    if k is not None and k > L:
      yield f"K <= --num_layers: --pipeline_stages={k} is more than {L} blocks; use at most {L}"
    if d is not None and k is not None and t is not None and d * k * t != n:
      yield (f"D x K x T uses every device: {d} x {k} x {t} = {d * k * t}, not the {n} of "
             f"{cluster.name}; drop one of the three to let the planner derive it")
    for name, value in (("--pipeline_stages x --tensor_parallel", (k or 1) * (t or 1)),
                        ("--data_parallel", d)):
      if value is not None and n % value:
        yield (f"D x K x T uses every device: {name} = {value} does not divide the {n} "
               f"devices of {cluster.name}; use a divisor of {n}")
    replicas = d if d is not None else n // (k * t) if k and t else None
    if replicas is not None and global_batch % replicas:
      yield (f"D divides the batch: {replicas} data-parallel replicas do not divide "
             f"--global_batch_size={global_batch}; use a multiple of {replicas}")
    if tfpar and k and t and k * t > dpn and (k * t) % dpn:
      yield (f"a replica spanning nodes fills whole ones (tfpar.config.rules.worker_layout): "
             f"K x T = {k * t} is not a multiple of the node's {dpn}; use a multiple of {dpn}")
    if mb is not None and replicas and global_batch % replicas == 0 and \
        (global_batch // replicas) % mb:
      yield (f"M divides the per-replica batch: --microbatches={mb} does not divide "
             f"{global_batch // replicas}; use one of {divisors_of(global_batch // replicas)}")
    interleaved = schedule == "interleaved" or (v or 1) > 1
    if interleaved and k is not None:
      if k == 1:
        yield ("interleaved needs K > 1: --pipeline_stages=1 has no pipeline; use "
               "--pipeline_stages=2 or more, or drop --virtual_stages")
      elif L % k or (v and L % (k * v)):
        yield (f"interleaved needs K x --virtual_stages to divide --num_layers={L}: "
               f"{k} x {v or 'v'} does not; use a v among "
               f"{divisors_of(L // k) if L % k == 0 else 'none (K does not divide L)'}")
      elif mb is not None and mb % k:
        yield (f"interleaved needs K to divide the micro-batches: --microbatches={mb} is not "
               f"a multiple of --pipeline_stages={k}")
    if sharding not in (None, "none"):
      if replicas == 1:
        yield (f"optimizer sharding needs D > 1: --optimizer_sharding={sharding} with one "
               "data-parallel replica shards nothing; drop it or use more replicas")
      if not shards_optimizer(system, 2, precision):
        yield (f"optimizer sharding needs no mixed_float16 in tfpar (its loss scaling is not "
               f"sharded): --optimizer_sharding={sharding} with --precision={precision}; use "
               "mixed_bfloat16 or float32")
      if sharding == "zero3" and ((k or 1) * (t or 1) > 1 or (mb or 1) > 1):
        yield ("the planner models zero3 on whole data-parallel replicas only (K = T = 1, one "
               "micro-batch; tfpar also runs it on a one-host pipeline plan's copies, which the "
               "planner does not model): drop --pipeline_stages, --tensor_parallel and "
               "--microbatches")
    remat = fixed.get("remat")
    if sharding == "zero3" and remat is not None and cost.remat_index(remat) != cost.FULL:
      yield (f"zero3 recomputes every block: --remat={remat} with --optimizer_sharding=zero3; "
             "drop --remat")
    if sp and t == 1:
      yield ("sequence parallelism needs T > 1: --sequence_parallel with "
             "--tensor_parallel=1; drop one")

  for reason in first_broken():
    return reason
  given = ", ".join(f"--{key}={value}" for key, value in fixed.items() if value is not None)
  return (f"no rule alone fails, but no D x K x T plan of {cluster.name} with {given or 'any value'} "
          f"and --global_batch_size={global_batch} remains: drop one of the fixed values")
