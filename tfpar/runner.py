"""Builds a run from a validated config: devices, strategy, task and its data, engine, loop."""

import os
import re
from typing import NamedTuple

import keras
from absl import logging as absl_logging
import tensorflow as tf

from tfpar import console
from tfpar import engines
from tfpar.config import rules
from tfpar.config import rundir
from tfpar import storage
from tfpar import strategies
from tfpar import tasks
from tfpar import tokenizer
from tfpar.config.cluster import Cluster, ClusterError, PeerError, tasks_in_order
from tfpar.config.schema import Config, ConfigError
from tfpar.data import corpus as corpus_lib
from tfpar.parallel import address_space, agreement
from tfpar.training import loop, preemption
from tfpar.training.checkpoint import (CheckpointMismatchError, CheckpointUnreadableError,
                                       NonFiniteStateError)


def describe_run(cfg, info: dict) -> str:
  """One sentence saying what runs, from the config and an engine's describe() dict."""
  skip = ("strategy", "replicas", "parameters", "measured_bytes_per_device")
  extra = [f"{key.replace('_', ' ')} {value}" for key, value in info.items() if key not in skip]
  mode = cfg.train.xla_auto_clustering
  if mode != "none":
    extra.append(f"XLA auto-clustering of the {mode} ops" + (
        "" if console.xla_auto_clustering_active(mode) else
        " asked for but off (TF_XLA_FLAGS was not set before TensorFlow started here)"))
  if cfg.train.host_allocator != "bfc":
    extra.append(f"host allocator {cfg.train.host_allocator}" + (
        "" if console.host_allocator_active(cfg.train.host_allocator) else
        " asked for but off (no glibc mallopt here)"))
  how = info["strategy"] + (": " + ", ".join(extra) if extra else "")
  m, t = cfg.model, cfg.train
  spec = tasks.spec(m.task)
  model, batch = spec.model_name(m), spec.batch(m, t.global_batch_size)
  return (f"training a {m.num_layers}-layer {model} of {info['parameters']:,} "
          f"parameters for {console.count(t.train_steps, 'step')} of {batch}, "
          f"on {console.count(info['replicas'], 'replica')} ({how})")


class OutOfMemoryError(RuntimeError):
  """The model, its optimizer state and activations do not fit a device under this plan."""


# Errors that come from the user's input: one line, exit 2, no traceback.
USER_ERRORS = (ConfigError, ClusterError, corpus_lib.DataError, CheckpointMismatchError,
               CheckpointUnreadableError, OutOfMemoryError, tokenizer.TokenizerError)
# A NaN or infinite step under --on_nonfinite=stop: one line, exit 3, nothing saved.
NONFINITE_ERRORS = (loop.NonFiniteError, NonFiniteStateError)
# What a write that found no room raises (tfpar.storage.disk_full tells it from the rest).
WRITE_ERRORS = (storage.DiskFullError, OSError, tf.errors.OpError)


def write_run_files(cfg: Config, class_names, engine=None) -> None:
  """config.json, the run's copy of its tokenizer (tfpar.generate decodes with it), and
  what the engine writes beside them (the data-parallel engine's plan.json)."""
  rundir.write_config(cfg, class_names)  # The one config.json writer.
  tokenizer.copy_into(cfg.model.tokenizer, cfg.train.model_dir)
  if engine is not None:
    engine.write_files(cfg.train.model_dir)


def run(cfg: Config, cluster: Cluster) -> dict:
  """Runs training as this task of the cluster; returns the loop's last records.

  The caller has validated `cfg` and checked it against the run directory and
  the cluster (tfpar.config.from_flags and check_run).

  Raises:
    OutOfMemoryError: a device ran out of memory (building the model, or in a
      step): a restart would too, so it is bad input with a way to a plan that fits.
  """
  try:
    return _run(cfg, cluster)
  except tf.errors.ResourceExhaustedError as e:
    raise OutOfMemoryError(_out_of_memory_message(cfg, e)) from None


def _host_memory() -> int:
  """This process's memory: the host's RAM, or less under a ulimit -v (RLIMIT_AS)."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  cap = address_space.limit()
  return total if cap is None else min(total, cap)


def _out_of_memory_message(cfg: Config, error) -> str:
  """One line: what TensorFlow failed to allocate, what the plan needs, how to find one that fits."""
  from tfpar.layout import placement as plan_lib  # pylint: disable=import-outside-toplevel
  text = " ".join(str(getattr(error, "message", error)).split())
  oom = re.search(r"OOM when allocating tensor with shape\[[^\]]*\] and type \w+", text)
  needed = plan_lib.state_bytes_per_device(cfg)
  p = cfg.parallel
  where = (f"{p.pipeline_stages} stage(s) x {p.tensor_parallel} tensor shard(s)"
           if p.model_parallel else "a whole model per replica")
  host = ""
  if "device:CPU" in text:  # The host's memory, which this process can read (a GPU's: in `text`).
    host = f"; this process may use {_host_memory() / 2 ** 30:.1f} GiB of host memory"
  return (f"out of memory ({oom.group(0) if oom else text[:200]}): with {where}, weights, "
          f"gradients and AdamW slots alone take {needed / 2 ** 30:.2f} GiB on the busiest device "
          f"(activations come on top){host}. Find a plan that fits with `python -m tfpar.plan` "
          "(the same model flags and --cluster=...), or use more --pipeline_stages or "
          "--tensor_parallel, --remat, or a smaller --global_batch_size or model")


class Built(NamedTuple):
  """What `build` makes: the task, this worker's data, the engine holding model and optimizer."""
  task: object
  data: object
  sharding: str  # 'data' or 'file' (tfpar.data.pipeline.choose_sharding).
  engine: object
  worker_index: int
  num_workers: int  # Workers reading input (the parameter server's: its engine's).


def build(cfg: Config, cluster: Cluster, *, across: bool = False) -> Built:
  """The strategy, task, data and engine of this process, which drives the replicas (a
  single process, a chief, or a multi_worker_mirrored worker); devices already set up.

  Args:
    across: pipeline stages on other workers: each worker runs its own stages
      (tfpar.engines.stage_worker) and reads its copy's slice of the input.
  """
  keras.mixed_precision.set_global_policy(cfg.train.precision)
  strategy = strategies.make_strategy(cfg.dist, cluster)
  if cfg.dist.strategy == "multi_worker_mirrored":  # Before any variable: the chief's config.
    agreement.check(cfg, [t for t in tasks_in_order(cluster.spec) if t[0] != "ps"],
                    (cluster.task_type, cluster.task_index), cfg.dist.collective_timeout)
  preemption.watch()  # Again: multi-worker strategies install TF's own SIGTERM handler.
  num_workers = cluster.num_workers if cfg.dist.strategy == "multi_worker_mirrored" else 1
  worker_index = cluster.worker_index if num_workers > 1 else 0
  task = tasks.make(cfg)
  data, sharding = task.load_data(worker_index=0 if across else worker_index,
                                  num_workers=1 if across else num_workers)
  engine = engines.make(cfg, strategy, data, sharding=sharding, task=task)
  if cfg.dist.strategy == "parameter_server":
    num_workers = engine.num_workers  # For the logs (the chief reads the data for all of them).
  return Built(task, data, sharding, engine, worker_index, num_workers)


def _run(cfg: Config, cluster: Cluster) -> dict:
  tf.get_logger().setLevel("WARNING")  # tf.distribute's per-call INFO lines drown the progress.
  absl_logging.set_verbosity(absl_logging.WARNING)  # so does the checkpoint saver, at every save
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  if cfg.dist.strategy == "parameter_server" and cluster.task_type in ("worker", "ps"):
    from tfpar.engines.parameter_server import server as parameter_server  # pylint: disable=import-outside-toplevel
    parameter_server.serve(cluster)
    return {}
  # Every task of a model-parallel job checks its layout here, before any server starts.
  devices = strategies.devices_per_worker(cfg)
  across = rules.check_worker_job(cfg, cluster.num_workers, devices)
  built = build(cfg, cluster, across=across)  # Across: one program per worker.
  task, data, sharding, engine = built.task, built.data, built.sharding, built.engine
  is_chief, worker_index, num_workers = cluster.is_chief, built.worker_index, built.num_workers
  if is_chief:
    print(f"tfpar: {describe_run(cfg, engine.describe())} | "
          f"data: {task.describe_data(data)}, "
          f"{sharding}-level input sharding", flush=True)
    report = engine.bytes_report()
    if report:
      print(f"tfpar: {report}", flush=True)
  try:
    # config.json once the checkpoint (if any) restored: bad data or a checkpoint of another
    # model, found before, leaves --model_dir as it was.
    result = loop.run(cfg, engine, is_chief=is_chief, worker_index=worker_index,
                      num_workers=num_workers,
                      on_restored=(lambda: write_run_files(cfg, task.class_names(data), engine))
                      if is_chief else None)
  except PEER_ERRORS as e:
    if len(cluster.spec.get("worker", [])) + len(cluster.spec.get("chief", [])) < 2:
      raise
    raise PeerError(_peer_message(e, cluster)) from None
  return result


# What a collective or remote call raises when a peer task died, hung or was cut off.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               tf.errors.AbortedError, tf.errors.CancelledError)
_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_CAUSE = re.compile(r"abort|timed out|timeout|connect|unavailable|heartbeat|deadline|reset", re.I)
# Lines of TensorFlow's message that say where, not what: the header, the stack, graph nodes.
_BOILERPLATE = re.compile(r"Graph execution error|<stack traces unavailable>|Detected at node|"
                          r"File \"|\[\[|Additional GRPC error information|\[Op:")


def _peer_message(error, cluster: Cluster) -> str:
  """One line: which peer this task waited for, what TensorFlow said, how to go on."""
  text = str(error.message if hasattr(error, "message") else error)
  peers = []
  for job, index in dict.fromkeys(_TASK.findall(text)):
    addresses = cluster.spec.get(job, [])
    if int(index) < len(addresses) and (job, int(index)) != (cluster.task_type, cluster.task_index):
      peers.append(f"{job} {index} ({addresses[int(index)]})")
  # TensorFlow's message opens with "Graph execution error:" and a stack (or "<stack traces
  # unavailable>"); the cause, e.g. "recvmsg:Connection reset by peer", is further down.
  lines = [line.strip() for line in text.splitlines()
           if line.strip() and not _BOILERPLATE.match(line.strip())]
  first = next((line for line in lines if _CAUSE.search(line)), lines[0] if lines else "")
  who = ", ".join(peers) or "a peer (TensorFlow did not say which)"
  return (f"{cluster.task_type} {cluster.task_index} waited for {who}, which stopped answering: "
          f"{type(error).__name__}: {first[:200]}. The latest checkpoint is intact: restart the job "
          "(tfpar.launch --max_restarts, or the Kubernetes restart policy) to resume")
