"""Who am I in the job, and who are my peers: TF_CONFIG, or a Kubernetes pod's index.

Three sources, read without importing TensorFlow, so the entry point can fail
early with one clear line before TF starts:

- `TF_CONFIG` (the local launcher, Kubeflow's TFJob operator);
- a pod of an Indexed Job or a JobSet rendered by `python -m tfpar.k8s render`:
  nobody writes TF_CONFIG there, so it is built here from the job's hostnames
  (`TFPAR_CLUSTER`, written into the manifest), the pod's task type
  (`TFPAR_TASK_TYPE`, or derived from the index) and its index
  (`JOB_COMPLETION_INDEX`, set by Kubernetes), after waiting a bounded time
  (`TFPAR_PEER_TIMEOUT` seconds) for every peer's DNS name: headless-service
  records can lag pod start by tens of seconds;
- nothing: a single process.

`tf_config` is the one builder of a TF_CONFIG string; the launcher and pods use it.
"""

import dataclasses
import json
import os
import socket
import time
from typing import Callable, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

from tfpar.config import rules
from tfpar.console import count

# Task types in the order tfpar numbers a job's tasks: the launcher's ports, an
# Indexed Job's completion indexes.
TASK_ORDER = ("chief", "worker", "ps")
CLUSTER_ENV = "TFPAR_CLUSTER"
TASK_TYPE_ENV = "TFPAR_TASK_TYPE"
PEER_TIMEOUT_ENV = "TFPAR_PEER_TIMEOUT"
INDEX_ENV = "JOB_COMPLETION_INDEX"
# The GPUs a rendered pod was given (tfpar.k8s render --gpus_per_worker; 0 on
# CPU pods): every pod and the render judge the same plan on that count
# (tfpar.strategies.stages_across_workers), and a pod that sees another exits 2.
GPUS_ENV = "TFPAR_GPUS_PER_WORKER"
DEFAULT_PEER_TIMEOUT = 300.0


class ClusterError(ValueError):
  """A TF_CONFIG that cannot work; the message says what to fix."""


class PeerError(RuntimeError):
  """A peer task stopped answering within its bound; the message names whom it waited for."""


class PeersNotFound(RuntimeError):
  """Peers' DNS names did not resolve in time: possibly transient, worth a restart."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """This task's place in the job.

  Attributes:
    spec: job name -> addresses ({} for a single process).
    task_type: 'chief', 'worker', 'ps', 'evaluator', or None for a single process.
    task_index: index within task_type.
  """
  spec: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
  task_type: Optional[str] = None
  task_index: int = 0

  @property
  def num_tasks(self) -> int:
    """Every task of the cluster (chief, workers, ps); 0 for a single process."""
    return len(tasks_in_order(self.spec))

  @property
  def num_workers(self) -> int:
    """Workers that compute (chief included when it trains, as in multi-worker mirrored)."""
    return max(1, len(self.spec.get("worker", [])) + len(self.spec.get("chief", [])))

  @property
  def worker_index(self) -> int:
    """Index among computing workers, the chief first."""
    if self.task_type == "worker":
      return self.task_index + len(self.spec.get("chief", []))
    return 0

  @property
  def is_chief(self) -> bool:
    """The chief task if there is one, else worker 0 (TF's convention)."""
    if self.task_type is None:
      return True
    if "chief" in self.spec:
      return self.task_type == "chief"
    return self.task_type == "worker" and self.task_index == 0


def check_job_shape(strategy: str, num_workers: int, num_ps: int, *,
                    workers_flag: str = "--num_workers", ps_flag: str = "--num_ps") -> None:
  """Raises ClusterError when a job of this shape cannot run `--strategy=strategy`.

  Shared by the local launcher and the Kubernetes renderer, which both decide a
  job's shape before any task starts; the message names their own flags.
  """
  if num_ps and strategy != "parameter_server":
    raise ClusterError(f"{ps_flag}={num_ps} starts parameter servers, but the training flags "
                       f"say --strategy={strategy}: pass --strategy=parameter_server")
  if not num_ps and strategy == "parameter_server":
    raise ClusterError(f"--strategy=parameter_server needs parameter servers: pass {ps_flag}=1 "
                       "(or more)")
  if num_workers > 1 and strategy not in ("multi_worker_mirrored", "parameter_server"):
    raise ClusterError(f"{workers_flag}={num_workers} with --strategy={strategy} would train "
                       "independent copies: pass --strategy=multi_worker_mirrored")


def job_roles(num_workers: int, num_ps: int) -> List[Tuple[str, int]]:
  """(task type, number of tasks) of a job, in TASK_ORDER: a chief only with parameter servers.

  With parameter servers the chief is the coordinator, a task of its own that
  dispatches steps to the workers; without them worker 0 is the chief (TF's
  convention) and a separate one would be a task that trains nothing. The
  launcher and the Kubernetes manifests both build a job from this, so that its
  ports, completion indexes and replica specs agree on one shape.
  """
  roles = [("chief", 1)] if num_ps else []
  roles.append(("worker", num_workers))
  if num_ps:
    roles.append(("ps", num_ps))
  return roles


def tasks_in_order(spec: Mapping[str, Sequence[str]]) -> List[Tuple[str, int]]:
  """(type, index) of every task, numbered as TASK_ORDER says."""
  return [(t, i) for t in TASK_ORDER for i in range(len(spec.get(t, ())))]


def tf_config(spec: Mapping[str, Sequence[str]], task_type: str, task_index: int) -> str:
  """The TF_CONFIG JSON of one task of the cluster `spec` (job name -> addresses)."""
  return json.dumps({"cluster": {k: list(v) for k, v in spec.items()},
                     "task": {"type": task_type, "index": task_index}})


def pod_tf_config(environ: Mapping[str, str]) -> Optional[Tuple[str, Dict[str, List[str]], str, int]]:
  """TF_CONFIG of a pod rendered by tfpar.k8s, from its environment; None if not such a pod.

  Returns:
    (tf_config, spec, task_type, task_index).
  """
  raw = environ.get(CLUSTER_ENV)
  if not raw:
    return None
  try:
    spec = {k: [str(a) for a in v] for k, v in json.loads(raw).items()}
  except (ValueError, TypeError, AttributeError):
    raise ClusterError(f"{CLUSTER_ENV}={raw!r} is not a JSON object of job name -> addresses: "
                       "render the manifest again with python -m tfpar.k8s render") from None
  index_raw = environ.get(INDEX_ENV)
  try:
    index = int(index_raw)
  except (TypeError, ValueError):
    raise ClusterError(f"{INDEX_ENV}={index_raw!r}: {CLUSTER_ENV} is set but this pod has no "
                       "completion index: run it in an Indexed Job or a JobSet") from None
  task_type = environ.get(TASK_TYPE_ENV)
  if task_type:
    if task_type not in spec:
      raise ClusterError(f"{TASK_TYPE_ENV}={task_type} is not a job of {CLUSTER_ENV} "
                         f"({', '.join(sorted(spec))})")
    if not 0 <= index < len(spec[task_type]):
      raise ClusterError(f"{INDEX_ENV}={index} is out of range for "
                         f"{count(len(spec[task_type]), f'{task_type} task')}")
  else:  # One Indexed Job holds every task, numbered chief, workers, ps.
    tasks = tasks_in_order(spec)
    if not 0 <= index < len(tasks):
      raise ClusterError(f"{INDEX_ENV}={index} is out of range for the "
                         f"{count(len(tasks), 'task')} of {CLUSTER_ENV}")
    task_type, index = tasks[index]
  return tf_config(spec, task_type, index), spec, task_type, index


def wait_for_peers(addresses: Sequence[str], timeout: float, *, interval: float = 2.0,
                   resolve: Callable = socket.getaddrinfo) -> None:
  """Blocks until every `host:port` resolves, or raises PeersNotFound after `timeout` s."""
  deadline = time.monotonic() + timeout
  missing = list(addresses)
  while True:
    still = []
    for address in missing:
      host, _, port = address.rpartition(":")
      try:
        resolve(host, int(port), proto=socket.IPPROTO_TCP)
      except (OSError, UnicodeError):
        still.append(address)
    missing = still
    if not missing:
      return
    if time.monotonic() >= deadline:
      raise PeersNotFound(f"peers not found in DNS after {timeout:.0f} s: {', '.join(missing)} "
                          "(are their pods scheduled, and the headless Service and "
                          "publishNotReadyAddresses in place?)")
    time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def from_env(environ: Optional[MutableMapping[str, str]] = None) -> Cluster:
  """This task's Cluster from TF_CONFIG, or from a rendered pod's environment.

  A pod's TF_CONFIG is built, its peers waited for, and the result exported as
  TF_CONFIG into `environ` (TensorFlow's cluster resolvers read it there).

  Raises:
    ClusterError: the environment cannot describe a job (bad input).
    PeersNotFound: a pod's peers did not resolve in time.
  """
  environ = os.environ if environ is None else environ
  if not environ.get("TF_CONFIG"):
    pod = pod_tf_config(environ)
    if pod is not None:
      config, spec, task_type, index = pod
      me = spec[task_type][index]
      raw_timeout = environ.get(PEER_TIMEOUT_ENV, str(DEFAULT_PEER_TIMEOUT))
      try:
        timeout = float(raw_timeout)
      except ValueError:
        raise ClusterError(f"{PEER_TIMEOUT_ENV}={raw_timeout} is not a number of seconds") from None
      wait_for_peers([a for addresses in spec.values() for a in addresses if a != me], timeout)
      environ["TF_CONFIG"] = config
  return _parse_tf_config(environ.get("TF_CONFIG"))


def _parse_tf_config(raw: Optional[str]) -> Cluster:
  if not raw:
    return Cluster()
  try:
    config = json.loads(raw)
    spec = {k: list(v) for k, v in config.get("cluster", {}).items()}
    task = config.get("task", {})
    task_type, task_index = task.get("type"), int(task.get("index", 0))
  except (ValueError, TypeError, AttributeError) as e:
    raise ClusterError(f"TF_CONFIG is not valid JSON of the form "
                       f'{{"cluster": {{...}}, "task": {{"type": ..., "index": ...}}}}: {e}') from None
  if not spec:
    return Cluster()
  if task_type not in spec:
    raise ClusterError(f"TF_CONFIG task type {task_type!r} is not in its cluster "
                       f"{sorted(spec)}: set task.type to one of them")
  if not 0 <= task_index < len(spec[task_type]):
    raise ClusterError(f"TF_CONFIG task index {task_index} is out of range for "
                       f"{len(spec[task_type])} {task_type} task(s)")
  return Cluster(spec=spec, task_type=task_type, task_index=task_index)


def check_cluster(cfg, cluster: Cluster) -> None:
  """The job's shape against the flags (a tfpar.config.Config): tfpar.train and tfpar.k8s.

  Needs no TensorFlow: tfpar.train calls it before TensorFlow starts.
  """
  t, s, p = cfg.train, cfg.dist, cfg.parallel
  tasks = cluster.num_tasks
  if s.strategy in ("one_device", "mirrored") and tasks > 1:
    # Each task would train its own copy, and only the chief's would be kept: a non-chief
    # task would train, print nothing and write nothing (the launcher refuses the same).
    me = f"{cluster.task_type} {cluster.task_index}"
    raise rules.ConfigError(f"TF_CONFIG names a cluster of {tasks} tasks (this is {me}), but "
                      f"--strategy={s.strategy} trains in one process: unset TF_CONFIG, or "
                      "pass --strategy=multi_worker_mirrored to train across them")
  if s.strategy == "multi_worker_mirrored" and not p.model_parallel:
    # One replica per worker on CPU hosts (GPU hosts have more: the engine checks again).
    rules.check_batch(t.global_batch_size, cluster.num_workers,
                flag=f"{cluster.num_workers} workers in TF_CONFIG")
  if s.strategy == "multi_worker_mirrored" and p.model_parallel:
    # Each worker's device count (GPUs, or --num_cpu_devices) is known once TensorFlow
    # starts: tfpar.layout.placement applies rules.worker_layout then. Here, what holds for any.
    workers = cluster.num_workers
    if p.data_parallel is not None and workers % p.data_parallel:
      raise rules.ConfigError(f"--data_parallel={p.data_parallel} does not divide the {workers} "
                        "workers: a replica sits in one worker or spans whole workers; drop "
                        "--data_parallel or use a divisor of the worker count")
    if p.data_parallel is not None:
      rules.check_batch(t.global_batch_size, p.data_parallel, p.microbatches,
                        flag=f"--data_parallel={p.data_parallel}")
  if s.strategy == "parameter_server":
    num_ps = len(cluster.spec.get("ps", []))
    if num_ps and s.ps_shards > num_ps:
      raise rules.ConfigError(f"--ps_shards={s.ps_shards} is more than the {num_ps} parameter "
                        f"server(s) of the job: use --ps_shards<={num_ps} or start more ps tasks")
