"""Pipeline stages on other workers: one client places every stage, the other workers serve.

Under `--strategy=multi_worker_mirrored`, when a replica's K x T devices are
more than a worker holds (tfpar.config.rules.worker_layout: W = K x T / G workers per
replica) and `tfpar.config.rules.one_program_per_worker` says no (a task whose eval outputs
are more than its loss; every other plan runs as one program per worker,
tfpar.engines.stage_worker), the chief (worker 0) connects to the whole cluster
(`tf.config.experimental_connect_to_cluster`) and every other worker only
starts its gRPC server (`serve`). The chief's device list then names the other
workers' devices ('/job:worker/replica:0/task:1/device:CPU:0'), and the
model-parallel engine runs unchanged over them: each stage's variables are
created under `tf.device` of its worker's device, each stage's forward and
backward (compiled or not) run there, and the activations and their gradients
cross between workers as the graph's send/recv over gRPC. The D replicas are
D rows of the same plan in the chief's one program; the run's gradient exchange
sums their gradients per variable on replica 0's device for it (compressed by
--grad_compression's codec, if one is set: GradientExchange.reduce_copies), and
each copy's AdamW applies the sum.
Input, logging and checkpoints are the chief's alone (it reads every weight
where it lives).

The servers keep serving while the chief comes and goes (a chief restarted by
Kubernetes reconnects to them, as TensorFlow's ClusterCoordinator documents for
its servers). A chief whose run succeeded writes `<model_dir>/.chief-finished`
(`finish`) before it exits 0; a server that has seen the chief and then finds
it gone with that file there exits 0 within CHIEF_POLL_SECONDS, so a job of
stage servers ends cleanly wherever it runs (tfpar.launch, a JobSet, a TFJob,
an Indexed Job). Without the file, a chief that went away failed or was
restarted: the server serves on for its return (exit 1 after CHIEF_WAIT_SECONDS).

Preemption. A stage server that gets SIGTERM cannot save (the chief holds the
step) and must not vanish (the chief's next step would fail and lose the
steps since the last checkpoint). It writes `<model_dir>/.preempted-worker-I`
and serves on; the chief polls for such a file every PEER_POLL_SECONDS and
takes it as its own preemption notice (it sends itself SIGTERM: tfpar.training.
preemption saves after the current chunk and exits 75); the server exits 75
once the chief is gone. The next start resumes at the next step. A server
killed outright (SIGKILL, a lost host) fails the chief's next step (status 1,
naming the worker); a restart resumes from the latest checkpoint.
"""

import os
import signal
import threading
import time

import tensorflow as tf

from tfpar import status, storage
from tfpar.config.cluster import Cluster
from tfpar.parallel.servers import reachable, start_server, watch_chief

PEER_POLL_SECONDS = 1.0
MARKER = ".preempted-"  # <model_dir>/.preempted-worker-1: that server was sent SIGTERM
FINISHED = ".chief-finished"  # <model_dir>/.chief-finished: the chief's run succeeded


class Workers:
  """The job's workers as the chief sees them once connected (not a tf.distribute strategy).

  Every data-parallel replica runs in the chief's program, so there is no
  strategy: the engine reads the cluster from `cluster_resolver`.
  """

  def __init__(self, resolver):
    self.cluster_resolver = resolver


def connect(model_dir: str) -> Workers:
  """Makes this process the chief task of TF_CONFIG's cluster, able to place ops on every worker.

  Also relays the servers' preemption notices (see the module docstring).
  """
  # A previous attempt's notices; removed before this chief's port opens, which
  # is what a server waits for before it reads `.chief-finished` (see `serve`).
  for stale in storage.glob(os.path.join(model_dir, MARKER + "*")):
    storage.discard(stale)
  storage.discard(os.path.join(model_dir, FINISHED))
  threading.Thread(target=_relay_notices, args=(model_dir,), name="tfpar-peer-notices",
                   daemon=True).start()
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  # This process is its own task of the cluster (by default it would join as a
  # task of a new job "localhost" and wait for another process to serve its address).
  tf.config.experimental_connect_to_cluster(resolver, job_name=resolver.task_type,
                                            task_index=resolver.task_id)
  return Workers(resolver)


def finish(model_dir: str) -> None:
  """The chief's last act after a successful run: tells the servers to exit 0."""
  storage.write_atomically(os.path.join(model_dir, FINISHED), "the chief's run succeeded\n")


def chief_address(cluster: Cluster) -> str:
  return (cluster.spec.get("chief") or cluster.spec["worker"])[0]


def _relay_notices(model_dir: str) -> None:
  """The chief's thread: a server's notice becomes this process's own SIGTERM."""
  while True:
    time.sleep(PEER_POLL_SECONDS)
    found = storage.glob(os.path.join(model_dir, MARKER + "*"))
    if found:
      who = os.path.basename(found[0])[len(MARKER):].replace("-", " ")
      print(f"tfpar: {who} was sent SIGTERM: saving after this chunk of steps", flush=True)
      os.kill(os.getpid(), signal.SIGTERM)
      return


def serve(cluster: Cluster, model_dir: str) -> None:
  """Serves this worker's devices to the chief, until it finished (exit 0), stays away
  (exit 1) or, after SIGTERM, has saved and left (75)."""
  notice = threading.Event()
  marker = os.path.join(model_dir, f"{MARKER}{cluster.task_type}-{cluster.task_index}")

  chief = chief_address(cluster)

  def on_sigterm():
    if not reachable(chief):  # The chief is done (or not up): nothing to save.
      print(f"tfpar: {cluster.task_type} {cluster.task_index}: SIGTERM, chief gone, exiting",
            flush=True)
      os._exit(status.PREEMPTED)  # pylint: disable=protected-access
    if not notice.is_set():
      print(f"tfpar: {cluster.task_type} {cluster.task_index}: SIGTERM: the chief saves, this "
            "server serves until it has", flush=True)
      try:
        storage.write_atomically(marker, "SIGTERM\n")
      except (OSError, tf.errors.OpError):  # No notice possible: go, as a server always did.
        os._exit(status.PREEMPTED)  # pylint: disable=protected-access
      notice.set()

  me = start_server(cluster, threads=cluster.num_tasks + 1, on_sigterm=on_sigterm)
  watch_chief(me, chief, preempted=notice,
              finished=lambda: storage.exists(os.path.join(model_dir, FINISHED)))
