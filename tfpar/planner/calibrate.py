"""Calibrating the cost model on this host: a measured matmul rate and one measured step time.

Logical CPU devices share the host's cores, so the host is modelled as N
devices that each get 1/N of its matmul rate and memory bandwidth. The
matmul rate is measured (float32, no XLA, as model-parallel steps run); the
fixed cost per block and pass (`op_seconds`: op dispatch, small kernels),
which dominates tiny models on CPU, is solved from the measured step time of
one reference run. The result is a Cluster whose predictions for the other
plans can be compared with their measured step times
(scripts/planner_calibrate.py, tests/test_planner.py).
"""

import dataclasses
import time

import numpy as np

from tfpar.config import ModelConfig
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


def host(devices: int, rate: float, *, op_seconds: float = 0.0) -> clusters.Cluster:
  """This host as `devices` logical devices sharing its matmul rate."""
  fields = dict(clusters.BUILT_IN["cpu"])
  fields.update(peak_flops={p: rate / devices for p in ("float32", "bfloat16", "float16")},
                memory_bandwidth=fields["memory_bandwidth"] / devices,
                efficiency=clusters.Efficiency(max_efficiency=1.0, width_half=0.0, rows_half=0.0,
                                               op_seconds=op_seconds))
  return clusters.Cluster(name=f"this host ({devices} logical CPUs)", devices=devices, **fields)


def plans_of(configs) -> cost.Plans:
  """Plans from (D, K, T, M, remat, global_batch) tuples of real runs."""
  a = np.array([(d, k, t, g // (d * mb), r) for d, k, t, mb, r, g in configs])
  return cost.Plans(D=a[:, 0], K=a[:, 1], T=a[:, 2], b=a[:, 3], remat=a[:, 4].astype(bool))


def predict(m: ModelConfig, rate: float, configs, *, reference: int, measured_reference: float,
            global_batch: int):
  """Predicted step seconds of every run, op_seconds solved so that `reference` matches.

  Args:
    m: the model.
    rate: the host's measured matmul FLOP/s.
    configs: (D, K, T, M, remat, G) of each run; each run's cluster has D*K*T devices.
    reference: the index of the run whose measured step time fixes op_seconds.
    measured_reference: its measured step seconds.
    global_batch: G.

  Returns:
    (predicted step seconds per run, op_seconds).
  """
  def step(op_seconds):
    out = []
    for c in configs:
      n = c[0] * c[1] * c[2]
      r = cost.evaluate(m, host(n, rate, op_seconds=op_seconds), plans_of([c]),
                        global_batch=global_batch, precision="float32", system=cost.TFPAR)
      out.append(r["step_seconds"][0])
    return np.array(out)
  # The step time is linear in op_seconds: solve from two evaluations.
  zero, one = step(0.0)[reference], step(1.0)[reference]
  op_seconds = max(0.0, (measured_reference - zero) / (one - zero))
  return step(op_seconds), op_seconds


def with_op_seconds(cluster: clusters.Cluster, op_seconds: float) -> clusters.Cluster:
  return dataclasses.replace(cluster, efficiency=dataclasses.replace(cluster.efficiency,
                                                                     op_seconds=op_seconds))
