"""Builds a run from a validated config: devices, strategy, task and its data, engine, loop."""

import keras
from absl import logging as absl_logging
import tensorflow as tf

from tfpar import strategies, tasks
from tfpar.cluster import Cluster, ClusterError
from tfpar.config import Config, ConfigError
from tfpar.data import corpus as corpus_lib
from tfpar.training import loop
from tfpar.training.checkpoint import CheckpointMismatchError
from tfpar.training.engine import DataParallelEngine

# Errors that come from the user's input: one line, exit 2, no traceback.
USER_ERRORS = (ConfigError, ClusterError, corpus_lib.DataError, CheckpointMismatchError)


def run(cfg: Config, cluster: Cluster, check_model_dir=None) -> dict:
  """Runs training as this task of the cluster; returns the loop's last records."""
  tf.get_logger().setLevel("WARNING")  # tf.distribute's per-call INFO lines drown the progress.
  absl_logging.set_verbosity(absl_logging.WARNING)  # so does the checkpoint saver, at every save
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  if cfg.dist.strategy == "parameter_server" and cluster.task_type in ("worker", "ps"):
    from tfpar.parallel import parameter_server  # pylint: disable=import-outside-toplevel
    parameter_server.serve(cluster)
    return {}
  keras.mixed_precision.set_global_policy(cfg.train.precision)
  strategy = strategies.make_strategy(cfg.dist, cluster)
  is_chief = cluster.is_chief
  if check_model_dir is not None:
    check_model_dir(cfg, is_chief)
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
    print(f"tfpar: {engine.describe()} | data: {task.describe_data(data)}, "
          f"{sharding}-level input sharding", flush=True)
  return loop.run(cfg, engine, is_chief=is_chief, worker_index=worker_index,
                  num_workers=num_workers)
