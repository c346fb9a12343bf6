"""Builds a run from a validated config: devices, strategy, data, engine, loop."""

import json
import os

import keras
from absl import logging as absl_logging
import tensorflow as tf

from tfpar import console
from tfpar import storage
from tfpar import strategies
from tfpar.cluster import Cluster, ClusterError
from tfpar.config import Config, ConfigError
from tfpar.data import corpus as corpus_lib
from tfpar.data import pipeline
from tfpar.training import loop
from tfpar.training.checkpoint import (CheckpointMismatchError, CheckpointUnreadableError,
                                       NonFiniteStateError)
from tfpar.training.engine import DataParallelEngine

# Errors that come from the user's input: one line, exit 2, no traceback.
USER_ERRORS = (ConfigError, ClusterError, corpus_lib.DataError, CheckpointMismatchError,
               CheckpointUnreadableError)
# A NaN or infinite step under --on_nonfinite=stop: one line, exit 3, nothing saved.
NONFINITE_ERRORS = (loop.NonFiniteError, NonFiniteStateError)


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
  is_chief = cluster.is_chief
  num_workers = cluster.num_workers if cfg.dist.strategy == "multi_worker_mirrored" else 1
  worker_index = cluster.worker_index if num_workers > 1 else 0
  files = corpus_lib.list_files(cfg.data.data)
  sharding = pipeline.choose_sharding(cfg.data.input_sharding, len(files), num_workers)
  corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                eval_fraction=cfg.data.eval_fraction,
                                tfrecord_key=cfg.data.tfrecord_key, worker_index=worker_index,
                                num_workers=num_workers, sharding=sharding)
  if cfg.parallel.model_parallel:
    from tfpar.parallel import hybrid  # pylint: disable=import-outside-toplevel
    engine = hybrid.ModelParallelEngine(cfg, strategy, corpus, sharding=sharding)
  elif cfg.dist.strategy == "parameter_server":
    from tfpar.parallel import parameter_server  # pylint: disable=import-outside-toplevel
    engine = parameter_server.ParameterServerEngine(cfg, strategy, corpus)
    num_workers = engine.num_workers  # For the logs (the chief reads the data for all of them).
  else:
    engine = DataParallelEngine(cfg, strategy, corpus, sharding=sharding)
  if is_chief:
    write_run_config(cfg)  # Only now: bad data found above leaves --model_dir untouched.
    share = "" if len(corpus.files) == len(files) else f" of {len(files)} (this worker's share)"
    print(f"tfpar: {console.describe_run(cfg, engine.describe())} | "
          f"data: {len(corpus.files)}{share} files, "
          f"{len(corpus.train):,} train / {len(corpus.eval):,} held-out bytes, "
          f"{sharding}-level input sharding", flush=True)
  return loop.run(cfg, engine, is_chief=is_chief, worker_index=worker_index,
                  num_workers=num_workers)
