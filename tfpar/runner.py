"""Builds a run from a validated config: devices, strategy, task and its data, engine, loop."""

import json
import os
import re

import keras
from absl import logging as absl_logging
import tensorflow as tf

from tfpar import console
from tfpar import storage
from tfpar import strategies
from tfpar import tasks
from tfpar.cluster import Cluster, ClusterError, PeerError
from tfpar.config import Config, ConfigError
from tfpar.data import corpus as corpus_lib
from tfpar.training import loop, preemption
from tfpar.training.checkpoint import (CheckpointMismatchError, CheckpointUnreadableError,
                                       NonFiniteStateError)
from tfpar.training.engine import DataParallelEngine

# Errors that come from the user's input: one line, exit 2, no traceback.
USER_ERRORS = (ConfigError, ClusterError, corpus_lib.DataError, CheckpointMismatchError,
               CheckpointUnreadableError)
# A NaN or infinite step under --on_nonfinite=stop: one line, exit 3, nothing saved.
NONFINITE_ERRORS = (loop.NonFiniteError, NonFiniteStateError)
# What a write that found no room raises (tfpar.storage.disk_full tells it from the rest).
WRITE_ERRORS = (storage.DiskFullError, OSError, tf.errors.OpError)


def write_run_config(cfg: Config) -> None:
  """The chief records the run's flags in <model_dir>/config.json, once.

  tfpar.config.check_run compares a resume against it; tfpar.generate rebuilds
  the model from it. Written whole, then renamed: other workers may read it
  at the same moment.
  """
  path = os.path.join(cfg.train.model_dir, "config.json")
  if not storage.exists(path):
    storage.makedirs(cfg.train.model_dir)
    storage.write_atomically(path, json.dumps(cfg.to_dict(), indent=2))


def run(cfg: Config, cluster: Cluster) -> dict:
  """Runs training as this task of the cluster; returns the loop's last records.

  The caller has validated `cfg` and checked it against the run directory and
  the cluster (tfpar.config.from_flags and check_run).
  """
  tf.get_logger().setLevel("WARNING")  # tf.distribute's per-call INFO lines drown the progress.
  absl_logging.set_verbosity(absl_logging.WARNING)  # so does the checkpoint saver, at every save
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  if cfg.dist.strategy == "parameter_server" and cluster.task_type in ("worker", "ps"):
    from tfpar.parallel import parameter_server  # pylint: disable=import-outside-toplevel
    parameter_server.serve(cluster)
    return {}
  keras.mixed_precision.set_global_policy(cfg.train.precision)
  strategy = strategies.make_strategy(cfg.dist, cluster)
  preemption.watch()  # Again: multi-worker strategies install TF's own SIGTERM handler.
  is_chief = cluster.is_chief
  num_workers = cluster.num_workers if cfg.dist.strategy == "multi_worker_mirrored" else 1
  worker_index = cluster.worker_index if num_workers > 1 else 0
  task = tasks.make(cfg)
  data, sharding = task.load_data(worker_index=worker_index, num_workers=num_workers)
  if cfg.parallel.model_parallel:
    from tfpar.parallel import hybrid  # pylint: disable=import-outside-toplevel
    engine = hybrid.ModelParallelEngine(cfg, strategy, data, sharding=sharding, task=task)
  elif cfg.dist.strategy == "parameter_server":
    from tfpar.parallel import parameter_server  # pylint: disable=import-outside-toplevel
    engine = parameter_server.ParameterServerEngine(cfg, strategy, data, task=task)
    num_workers = engine.num_workers  # For the logs (the chief reads the data for all of them).
  else:
    engine = DataParallelEngine(cfg, strategy, data, sharding=sharding, task=task)
  if is_chief:
    write_run_config(cfg)  # Only now: bad data found above leaves --model_dir untouched.
    print(f"tfpar: {console.describe_run(cfg, engine.describe())} | "
          f"data: {task.describe_data(data)}, "
          f"{sharding}-level input sharding", flush=True)
  try:
    return loop.run(cfg, engine, is_chief=is_chief, worker_index=worker_index,
                    num_workers=num_workers)
  except PEER_ERRORS as e:
    if len(cluster.spec.get("worker", [])) + len(cluster.spec.get("chief", [])) < 2:
      raise
    raise PeerError(_peer_message(e, cluster, cfg.dist.collective_timeout)) from None


# What a collective or remote call raises when a peer task died, hung or was cut off.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               tf.errors.AbortedError, tf.errors.CancelledError)
_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_CAUSE = re.compile(r"abort|timed out|timeout|connect|unavailable|heartbeat|deadline|reset", re.I)


def _peer_message(error, cluster: Cluster, timeout: int) -> str:
  """One line: which peer this task waited for, what TensorFlow said, how to go on."""
  text = str(error.message if hasattr(error, "message") else error)
  peers = []
  for job, index in dict.fromkeys(_TASK.findall(text)):
    addresses = cluster.spec.get(job, [])
    if int(index) < len(addresses) and (job, int(index)) != (cluster.task_type, cluster.task_index):
      peers.append(f"{job} {index} ({addresses[int(index)]})")
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  # TensorFlow's message opens with "Graph execution error:" and a stack; the cause is further down.
  first = next((line for line in lines if _CAUSE.search(line)), lines[0] if lines else "")
  who = ", ".join(peers) or "a peer (TensorFlow did not say which)"
  return (f"{cluster.task_type} {cluster.task_index} waited for {who}, which stopped answering "
          f"(a collective waits at most --collective_timeout={timeout} s): {type(error).__name__}: {first[:200]}. The latest checkpoint is intact: restart "
          "the job (tfpar.launch --max_restarts, or the Kubernetes restart policy) to resume")
