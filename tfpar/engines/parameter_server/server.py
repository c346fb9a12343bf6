"""The parameter-server job's processes: the chief's strategy, the worker and ps servers.

A worker or ps task runs nothing of its own: it starts a gRPC server that the
chief (the coordinator) sends work and variables to, and keeps it up across
chief restarts (see `serve`).
"""

import tensorflow as tf

from tfpar.config.cluster import Cluster, ClusterError
from tfpar.config.schema import DistConfig
from tfpar.parallel.servers import start_server, watch_chief


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


def serve(cluster: Cluster) -> None:
  """Runs this worker or ps task's gRPC server for the chief, across chief restarts.

  A restarted chief (a new coordinator) reconnects to the same servers, which
  is how TensorFlow's ClusterCoordinator recovers from a coordinator failure;
  so a server outlives its chief. TensorFlow's servers cannot be stopped and
  never return from `join()`, so the task instead watches the chief's port and
  ends only when (a) the chief has been unreachable for CHIEF_WAIT_SECONDS in a
  row (status 1, naming the chief): it is not coming back; or (b) SIGTERM
  arrives (status 75, tfpar.status.PREEMPTED: a server has nothing to save).
  When the job is done, whoever runs it ends the servers: tfpar.launch
  terminates them once the chief exits 0; on Kubernetes the job's success
  policy (the chief's completion) does.

  A server must not take "chief gone" for "job done": a chief restarted by
  Kubernetes would then find its servers completed.
  """
  check_cluster(cluster)
  if cluster.task_type not in ("worker", "ps"):
    raise ClusterError(f"serve() is for worker and ps tasks, not {cluster.task_type!r}")
  me = start_server(cluster, threads=len(cluster.spec["worker"]) + 1)
  watch_chief(me, cluster.spec["chief"][0])
