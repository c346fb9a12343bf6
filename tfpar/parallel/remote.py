"""Pipeline stages on other workers: one client places every stage, the other workers serve.

Under `--strategy=multi_worker_mirrored`, when a replica's K x T devices are
more than a worker holds (tfpar.rules.worker_layout: W = K x T / G workers per
replica), the chief (worker 0) connects to the whole cluster
(`tf.config.experimental_connect_to_cluster`) and every other worker only
starts its gRPC server (`serve`). The chief's device list then names the other
workers' devices ('/job:worker/replica:0/task:1/device:CPU:0'), and the
model-parallel engine runs unchanged over them: each stage's variables are
created under `tf.device` of its worker's device, each stage's forward and
backward (compiled or not) run there, and the activations and their gradients
cross between workers as the graph's send/recv over gRPC. The D replicas are
D rows of the same plan in the chief's one program; their gradients are summed
per variable on replica 0's device for it, then applied by each copy's AdamW.
Input, logging and checkpoints are the chief's alone (it reads every weight
where it lives).

The servers keep serving while the chief comes and goes (a chief restarted by
Kubernetes reconnects to them, as TensorFlow's ClusterCoordinator documents for
its servers); SIGTERM ends a server with status 75 (it has nothing to save);
tfpar.launch ends them once the chief exits 0.
"""

import tensorflow as tf

from tfpar.cluster import Cluster
from tfpar.parallel.parameter_server.server import start_server, watch_chief


class Workers:
  """The job's workers as the chief sees them once connected (not a tf.distribute strategy).

  Every data-parallel replica runs in the chief's program, so there is no
  strategy: the engine reads the cluster from `cluster_resolver`.
  """

  def __init__(self, resolver):
    self.cluster_resolver = resolver


def connect(cluster: Cluster) -> Workers:
  """Makes this process the chief task of the cluster, able to place ops on every worker."""
  del cluster  # TF_CONFIG says the same; the resolver reads it.
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  # This process is its own task of the cluster (by default it would join as a
  # task of a new job "localhost" and wait for another process to serve its address).
  tf.config.experimental_connect_to_cluster(resolver, job_name=resolver.task_type,
                                            task_index=resolver.task_id)
  return Workers(resolver)


def chief_address(cluster: Cluster) -> str:
  return (cluster.spec.get("chief") or cluster.spec["worker"])[0]


def serve(cluster: Cluster) -> None:
  """Serves this worker's devices to the chief until SIGTERM (75) or the chief stays away (1)."""
  me = start_server(cluster, threads=cluster.num_tasks + 1)
  watch_chief(me, chief_address(cluster))
