"""Calibrating the cost model on this host: a measured matmul rate and the step times of two runs.

Logical CPU devices share the host's cores, so the host is modelled as N
devices that take turns at its full matmul rate and memory bandwidth
(Cluster.shared): a step costs the sum of every device's work. The
matmul rate is measured (float32, no XLA, as model-parallel steps run); two
constants of the host (a fixed cost per step, a fixed cost per block and
pass on each device) are solved from the measured step times of two
reference runs, and the other plans' step times are predicted from them
(scripts/planner_calibrate.py, tests/test_planner.py).

Across worker processes on this host (`tfpar.launch`), a run's devices are
split over W workers: what crosses a worker boundary (the data-parallel
all-reduce, a pipeline stage's activation and gradient) travels over loopback
gRPC, the cost model's inter-node link. Its bandwidth is a third constant,
solved from one cross-worker reference run once the other two are known.
"""

import dataclasses
import time

import numpy as np

from tfpar.config.schema import ModelConfig
from tfpar.planner import clusters, cost


def matmul_rate(n: int = 512, repeats: int = 20) -> float:
  """Best FLOP/s of an n x n float32 matmul in a tf.function without XLA."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  a = tf.random.normal([n, n])
  matmul = tf.function(lambda x: tf.matmul(x, x))
  matmul(a).numpy()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).numpy()
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def host(devices: int, rate: float, *, op_seconds: float = 0.0, workers: int = 1,
         link_bandwidth: float = float("inf")) -> clusters.Cluster:
  """This host as `devices` logical devices that take turns on its cores at its matmul rate.

  With `workers` > 1 the devices are split evenly over that many processes, whose
  loopback link (bytes/s) is the cluster's inter-node link.
  """
  fields = dict(clusters.BUILT_IN["cpu"])
  fields.update(peak_flops={p: rate for p in ("float32", "bfloat16", "float16")},
                efficiency=clusters.Efficiency(max_efficiency=1.0, width_half=0.0, rows_half=0.0,
                                               op_seconds=op_seconds))
  if workers > 1:
    fields.update(devices_per_node=devices // workers, inter_bandwidth=link_bandwidth,
                  inter_latency=0.0)
  return clusters.Cluster(name=f"this host ({devices} logical CPUs)", devices=devices, **fields)


def plans_of(configs) -> cost.Plans:
  """Plans from (D, K, T, M, remat, global_batch[, workers]) tuples of real runs (GPipe)."""
  a = np.array([(d, k, t, c[5] // (d * mb), r) for c in configs for d, k, t, mb, r in [c[:5]]])
  return cost.Plans(D=a[:, 0], K=a[:, 1], T=a[:, 2], b=a[:, 3], remat=a[:, 4].astype(bool))


@dataclasses.dataclass(frozen=True)
class Fit:
  """The host's constants solved from measured step times.

  Attributes:
    step_seconds: fixed cost of every step whatever the plan (the Python loop,
      the optimizer's update of every variable, the input pipeline).
    op_seconds: fixed cost per block and pass on each device (op dispatch,
      small kernels).
    link_bandwidth: bytes/s between worker processes (loopback gRPC); inf
      where no cross-worker run was measured.
  """
  step_seconds: float
  op_seconds: float
  link_bandwidth: float = float("inf")


def _terms(m: ModelConfig, rate: float, configs, global_batch: int):
  """Per run: seconds of everything but the fixed costs at `rate`, block passes, and the
  seconds its cross-worker traffic takes at 1 byte/s (0 inside one process)."""
  def step(op_seconds, link_bandwidth):
    out = []
    for c in configs:
      cluster = host(c[0] * c[1] * c[2], rate, op_seconds=op_seconds,
                     workers=c[6] if len(c) > 6 else 1, link_bandwidth=link_bandwidth)
      r = cost.evaluate(m, cluster, plans_of([c]), global_batch=global_batch,
                        precision="float32", system=cost.TFPAR)
      out.append(r["step_seconds"][0])
    return np.array(out)
  # The model is linear in op_seconds and in 1 / link_bandwidth: evaluations separate the terms.
  work = step(0.0, float("inf"))
  return work, step(1.0, float("inf")) - work, step(0.0, 1.0) - work


def predict(m: ModelConfig, rate: float, configs, constants: Fit, *, global_batch: int):
  """Step seconds of every run (D, K, T, M, remat, G[, workers]) on this host with these constants."""
  work, passes, link = _terms(m, rate, configs, global_batch)
  return constants.step_seconds + passes * constants.op_seconds + work + \
      link / constants.link_bandwidth


def fit(m: ModelConfig, rate: float, configs, measured, *, references, global_batch: int,
        link_reference: int = None):
  """Solves the host's constants from the measured step seconds of the `references` runs.

  The host model: step = step_seconds + op_seconds x (block passes, summed over
  the devices that take turns) + the matmuls at the measured `rate` +
  elementwise memory traffic and copies between devices (cost.evaluate on a
  shared Cluster). Two unknowns: give two or more references that differ in
  block passes (e.g. 4 and 16 micro-batches).

  Args:
    m: the model.
    rate: the measured matmul FLOP/s (matmul_rate).
    configs: (D, K, T, M, remat, G) of each run.
    measured: each run's measured step seconds (only the references' are read).
    references: indices of the runs to solve from (inside one process).
    global_batch: G.
    link_reference: index of a cross-worker run to solve the loopback bandwidth
      from, after the other two constants (its residual time is its traffic).

  Returns:
    (predicted step seconds of every run, Fit).

  Raises:
    ValueError: the references solve to a negative constant (times taken under load).
  """
  work, passes, link = _terms(m, rate, configs, global_batch)
  measured = np.asarray(measured, dtype=float)
  refs = list(references)
  a = np.stack([np.ones_like(passes), passes], axis=1)
  (step_seconds, op_seconds), *_ = np.linalg.lstsq(a[refs], measured[refs] - work[refs],
                                                   rcond=None)
  if step_seconds < 0 or op_seconds < 0:  # Time cannot run backwards: the references disagree.
    raise ValueError(
        f"the reference runs give a negative {'step' if step_seconds < 0 else 'per-block'} cost "
        f"({step_seconds * 1e3:.1f} ms per step, {op_seconds * 1e3:.3f} ms per block and pass): "
        "their times do not fit the host model, as on a loaded machine; rerun on an idle one")
  bandwidth = float("inf")
  if link_reference is not None:
    i = link_reference
    residual = measured[i] - (step_seconds + passes[i] * op_seconds + work[i])
    bandwidth = link[i] / residual if residual > 0 and link[i] > 0 else float("inf")
  constants = Fit(step_seconds=float(step_seconds), op_seconds=float(op_seconds),
                  link_bandwidth=float(bandwidth))
  return predict(m, rate, configs, constants, global_batch=global_batch), constants
