"""The parameter-server job's processes: the chief's strategy, the worker and ps servers.

A worker or ps task runs nothing of its own: it starts a gRPC server that the
chief (the coordinator) sends work and variables to, and keeps it up until the
chief is gone (see `serve`).
"""

import os
import socket
import time

import tensorflow as tf

from tfpar.cluster import Cluster, ClusterError
from tfpar.config import DistConfig

# How often, and how many times in a row, a server checks that the chief is
# still there before it exits (the ps and worker servers have no other end).
CHIEF_POLL_SECONDS = 2.0
CHIEF_MISSES_TO_EXIT = 3
# A server that never sees its chief gives up after this long.
CHIEF_WAIT_SECONDS = 600.0


def check_cluster(cluster: Cluster) -> None:
  spec = cluster.spec
  missing = [job for job in ("chief", "worker", "ps") if not spec.get(job)]
  if missing:
    raise ClusterError(
        f"--strategy=parameter_server needs TF_CONFIG with a chief, workers and ps tasks "
        f"(missing: {', '.join(missing)}): start the job with python -m tfpar.launch "
        "--num_workers=N --num_ps=P -- --strategy=parameter_server ...")
  if len(spec["chief"]) != 1:
    raise ClusterError(f"TF_CONFIG has {len(spec['chief'])} chief tasks: parameter_server "
                       "needs exactly one (the coordinator)")


def make_strategy(dist: DistConfig, cluster: Cluster) -> tf.distribute.Strategy:
  """The ParameterServerStrategy of this job, seen from the chief (coordinator)."""
  check_cluster(cluster)
  if cluster.task_type != "chief":
    raise ClusterError(f"the {cluster.task_type} task of a parameter_server job serves; only "
                       "the chief builds the strategy")
  partitioner = None
  if dist.ps_shards > 1:
    # Every variable of rank >= 1 is cut in ps_shards along axis 0 (fewer when
    # axis 0 is shorter). A MinSizePartitioner would leave small variables
    # whole; with the fixed count the layout is predictable and tested.
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(dist.ps_shards)
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  return tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)


def _chief_reachable(address: str) -> bool:
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=2.0):
      return True
  except OSError:
    return False


def serve(cluster: Cluster) -> None:
  """Runs this worker or ps task's gRPC server until the chief goes away.

  TensorFlow's servers never return from `join()` and cannot be stopped, so
  instead of joining, the task watches the chief's port and exits (status 0)
  once the chief, seen before, has been unreachable CHIEF_MISSES_TO_EXIT times
  in a row; status 1 if it never appears within CHIEF_WAIT_SECONDS.
  """
  check_cluster(cluster)
  if cluster.task_type not in ("worker", "ps"):
    raise ClusterError(f"serve() is for worker and ps tasks, not {cluster.task_type!r}")
  config = tf.compat.v1.ConfigProto()
  # TF's default pool has one inter-op thread per core; fewer than
  # num_workers + 1 can hang the cluster (see the module docstring).
  min_threads = len(cluster.spec["worker"]) + 1
  if (os.cpu_count() or 1) < min_threads:
    config.inter_op_parallelism_threads = min_threads
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster.spec), job_name=cluster.task_type,
                                task_index=cluster.task_index, protocol="grpc", config=config,
                                start=True)
  del server  # Lives until the process ends.
  chief = cluster.spec["chief"][0]
  print(f"tfpar: {cluster.task_type} {cluster.task_index} serving; waits for chief {chief}",
        flush=True)
  seen, misses, start = False, 0, time.monotonic()
  while True:
    time.sleep(CHIEF_POLL_SECONDS)
    if _chief_reachable(chief):
      seen, misses = True, 0
    elif seen:
      misses += 1
      if misses >= CHIEF_MISSES_TO_EXIT:
        print(f"tfpar: {cluster.task_type} {cluster.task_index}: chief gone, exiting", flush=True)
        os._exit(0)  # pylint: disable=protected-access  # Servers cannot be stopped otherwise.
    elif time.monotonic() - start > CHIEF_WAIT_SECONDS:
      print(f"tfpar: {cluster.task_type} {cluster.task_index}: chief {chief} never came up in "
            f"{CHIEF_WAIT_SECONDS:.0f}s, exiting", flush=True)
      os._exit(1)  # pylint: disable=protected-access
