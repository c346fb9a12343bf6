"""The parameter-server job's processes: the chief's strategy, the worker and ps servers.

A worker or ps task runs nothing of its own: it starts a gRPC server that the
chief (the coordinator) sends work and variables to, and keeps it up across
chief restarts (see `serve`).
"""

import os
import signal
import socket
import time

import tensorflow as tf

from tfpar import status
from tfpar.cluster import Cluster, ClusterError
from tfpar.config import DistConfig

# How often a server checks that the chief is there.
CHIEF_POLL_SECONDS = 2.0
# A server whose chief has been unreachable this long (never came up, or did
# not come back) exits with status 1.
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


def reachable(address: str) -> bool:
  """Whether a task's gRPC port accepts a connection (host:port)."""
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=2.0):
      return True
  except OSError:
    return False


def start_server(cluster: Cluster, threads: int, on_sigterm=None) -> str:
  """Starts this task's gRPC server for the process's life. Returns its name.

  `threads`: the fewest inter-op threads that cannot hang the cluster (TF's
  default pool has one per core; see the package docstring). SIGTERM calls
  `on_sigterm()`, by default exits 75 at once.
  """
  me = f"{cluster.task_type} {cluster.task_index}"

  def exit_now():
    print(f"tfpar: {me}: SIGTERM, exiting (a server has nothing to save)", flush=True)
    os._exit(status.PREEMPTED)  # pylint: disable=protected-access  # Servers cannot be stopped.

  signal.signal(signal.SIGTERM, lambda signum, frame: (on_sigterm or exit_now)())
  config = tf.compat.v1.ConfigProto()
  if (os.cpu_count() or 1) < threads:
    config.inter_op_parallelism_threads = threads
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster.spec), job_name=cluster.task_type,
                                task_index=cluster.task_index, protocol="grpc", config=config,
                                start=True)
  del server  # Lives until the process ends.
  return me


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

  Before, a server exited 0 about 6 s after the chief went away (three missed
  polls 2 s apart), taking "chief gone" for "job done": a chief restarted by
  Kubernetes then found its servers completed.
  """
  check_cluster(cluster)
  if cluster.task_type not in ("worker", "ps"):
    raise ClusterError(f"serve() is for worker and ps tasks, not {cluster.task_type!r}")
  me = start_server(cluster, threads=len(cluster.spec["worker"]) + 1)
  watch_chief(me, cluster.spec["chief"][0])


def watch_chief(me: str, chief: str, preempted=None, finished=None) -> None:
  """Serves on while the chief comes and goes; exits 1 once it stayed away CHIEF_WAIT_SECONDS.

  `preempted`: a threading.Event; once set, the first poll that finds the
  chief gone (it saved and exited) exits 75.
  `finished`: a callable; once the chief has been seen, the first poll that
  finds it gone and `finished()` true exits 0 (the job is done).
  """
  print(f"tfpar: {me} serving; waits for chief {chief}", flush=True)
  seen, ever_seen, last_seen = False, False, time.monotonic()
  while True:
    time.sleep(CHIEF_POLL_SECONDS)
    if reachable(chief):
      if not seen:
        print(f"tfpar: {me}: chief {chief} connected", flush=True)
      seen, ever_seen, last_seen = True, True, time.monotonic()
      continue
    if ever_seen and finished is not None and finished():
      print(f"tfpar: {me}: chief {chief} finished the run, exiting", flush=True)
      os._exit(status.OK)  # pylint: disable=protected-access
    if preempted is not None and preempted.is_set():
      print(f"tfpar: {me}: chief {chief} gone after the preemption notice, exiting", flush=True)
      os._exit(status.PREEMPTED)  # pylint: disable=protected-access
    if seen:
      print(f"tfpar: {me}: chief {chief} unreachable; serving on, for its restart", flush=True)
      seen = False
    if time.monotonic() - last_seen > CHIEF_WAIT_SECONDS:
      print(f"tfpar: {me}: chief {chief} unreachable for {CHIEF_WAIT_SECONDS:.0f} s, exiting",
            flush=True)
      os._exit(status.CRASH)  # pylint: disable=protected-access
