"""A task's gRPC server, kept up for the process's life, and its watch on the chief.

TensorFlow's servers cannot be stopped and never return from `join()`; a task
that only serves (a parameter-server job's workers and ps tasks) starts one
with `start_server` and then ends on its own terms with `watch_chief`: when
the chief stayed away too long to be coming back.
"""

import os
import signal
import socket
import time

import tensorflow as tf

from tfpar import status
from tfpar.config.cluster import Cluster

# How often a server checks that the chief is there.
CHIEF_POLL_SECONDS = 2.0
# A server whose chief has been unreachable this long (never came up, or did
# not come back) exits with status 1.
CHIEF_WAIT_SECONDS = 600.0


def reachable(address: str) -> bool:
  """Whether a task's gRPC port accepts a connection (host:port)."""
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=2.0):
      return True
  except OSError:
    return False


def start_server(cluster: Cluster, threads: int) -> str:
  """Starts this task's gRPC server for the process's life. Returns its name.

  `threads`: the fewest inter-op threads that cannot hang the cluster (TF's
  default pool has one per core; see tfpar.engines.parameter_server). SIGTERM exits 75 at
  once.
  """
  me = f"{cluster.task_type} {cluster.task_index}"

  def exit_now():
    print(f"tfpar: {me}: SIGTERM, exiting (a server has nothing to save)", flush=True)
    os._exit(status.PREEMPTED)  # pylint: disable=protected-access  # Servers cannot be stopped.

  signal.signal(signal.SIGTERM, lambda signum, frame: exit_now())
  config = tf.compat.v1.ConfigProto()
  if (os.cpu_count() or 1) < threads:
    config.inter_op_parallelism_threads = threads
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster.spec), job_name=cluster.task_type,
                                task_index=cluster.task_index, protocol="grpc", config=config,
                                start=True)
  del server  # Lives until the process ends.
  return me


def watch_chief(me: str, chief: str) -> None:
  """Serves on while the chief comes and goes; exits 1 once it stayed away CHIEF_WAIT_SECONDS."""
  print(f"tfpar: {me} serving; waits for chief {chief}", flush=True)
  seen, last_seen = False, time.monotonic()
  while True:
    time.sleep(CHIEF_POLL_SECONDS)
    if reachable(chief):
      if not seen:
        print(f"tfpar: {me}: chief {chief} connected", flush=True)
      seen, last_seen = True, time.monotonic()
      continue
    if seen:
      print(f"tfpar: {me}: chief {chief} unreachable; serving on, for its restart", flush=True)
      seen = False
    if time.monotonic() - last_seen > CHIEF_WAIT_SECONDS:
      print(f"tfpar: {me}: chief {chief} unreachable for {CHIEF_WAIT_SECONDS:.0f} s, exiting",
            flush=True)
      os._exit(status.CRASH)  # pylint: disable=protected-access
