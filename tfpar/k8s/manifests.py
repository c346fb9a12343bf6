"""The objects of one tfpar job on Kubernetes, as plain dicts ready for YAML.

Every kind renders the same pods (one container named `tensorflow`, tini as
PID 1 so SIGTERM reaches Python, resource requests, the model-dir volume, a
grace period to save in) and a NetworkPolicy that admits only the job's own
pods to the TF port: TensorFlow's gRPC servers are unauthenticated and listen
on every interface. What differs is who writes TF_CONFIG and who restarts:

- TFJob (`kubeflow.org/v1`): the training operator writes TF_CONFIG. It
  restarts single pods, never the group, so a multi-worker job is rendered
  with no restarts (a failure fails the TFJob); parameter-server jobs, whose
  coordinator survives a lost worker, restart pods on failure.
- JobSet (`jobset.x-k8s.io/v1alpha2`): one replicated job per task type; any
  failed Job restarts the whole JobSet (`failurePolicy.maxRestarts`), except
  exit status 2 (bad input), which fails it at once, and 75 (preempted, every
  worker saved), which restarts it without using up a restart. Pods build
  TF_CONFIG with `tfpar.config.cluster` from their index and the hostnames in
  `TFPAR_CLUSTER`.
- Indexed Job + headless Service: one Job of every task (chief, workers, ps by
  completion index); a failure fails the Job (no group restarts). With
  parameter servers the Job succeeds when the chief (index 0) does.

Pipeline stages across workers (multi_worker_mirrored with a replica's K x T
devices more than a worker's G, tfpar.config.rules.worker_layout): every worker
runs its own stages (tfpar.engines.stage_worker), so the pods are plain
workers and the job ends as any multi_worker_mirrored job does. Pods of
model-parallel multi-worker jobs get the GPU count they were rendered with
(tfpar.config.cluster.GPUS_ENV), which each decides on (and checks) exactly as
the render did.
"""

import dataclasses
import json
from typing import Dict, List, Optional, Tuple

from tfpar.config import cluster as cluster_lib
from tfpar import status

CONTAINER = "tensorflow"  # The name TFJob injects TF_CONFIG into; used for every kind.
PORT_NAME = "tfjob-port"  # The port name TFJob's operator reads the TF port from.
# tini runs as PID 1 and forwards signals: the kernel drops signals a PID 1 has
# no handler for, so a bare `python` as PID 1 would ignore SIGTERM.
ENTRYPOINT = ("tini", "--", "python", "-m", "tfpar.train")
UID = 1000  # The Dockerfile's unprivileged user.


@dataclasses.dataclass(frozen=True)
class Job:
  """What `python -m tfpar.k8s render` was asked for (validated by the CLI)."""
  kind: str
  name: str
  workers: int
  image: str
  train_args: Tuple[str, ...]
  ps: int = 0
  gpus_per_worker: int = 0
  tpu_topology: Optional[str] = None
  tpu_accelerator: Optional[str] = None
  cpu: str = "4"
  memory: str = "16Gi"
  pvc: Optional[str] = None
  mount_path: str = "/mnt/tfpar"
  port: int = 2222
  grace_seconds: int = 300
  max_restarts: int = 0
  peer_timeout: int = 300
  # Multi-worker model parallelism: pods pin their GPU count (GPUS_ENV).
  model_parallel: bool = False

  @property
  def roles(self) -> List[Tuple[str, int]]:
    """(task type, pods) in TF's order, as tfpar.config.cluster.job_roles shapes every job."""
    return cluster_lib.job_roles(self.workers, self.ps)

  @property
  def labels(self) -> Dict[str, str]:
    return {"app.kubernetes.io/name": "tfpar", "app.kubernetes.io/instance": self.name}

  @property
  def tpus_per_worker(self) -> int:
    if not self.tpu_topology:
      return 0
    chips = 1
    for dim in self.tpu_topology.split("x"):
      chips *= int(dim)
    return chips


def hostnames(job: Job) -> Dict[str, List[str]]:
  """The TF cluster spec of a JobSet or Indexed Job: task type -> `host:port` of each pod.

  JobSet pods are `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>`
  (one Job per replicated job, so jobIndex 0; the subdomain is the JobSet's
  name); Indexed Job pods are `<job>-<index>.<service>`, numbered chief,
  workers, ps.
  """
  spec: Dict[str, List[str]] = {}
  index = 0
  for role, count in job.roles:
    for i in range(count):
      host = (f"{job.name}-{role}-0-{i}" if job.kind == "jobset" else f"{job.name}-{index}")
      spec.setdefault(role, []).append(f"{host}.{job.name}:{job.port}")
      index += 1
  return spec


def _container(job: Job, role: Optional[str]) -> dict:
  requests = {"cpu": job.cpu, "memory": job.memory}
  limits = {"memory": job.memory}
  computes = role in ("worker", None)  # None: one template for every task type.
  if computes and job.gpus_per_worker:
    limits["nvidia.com/gpu"] = str(job.gpus_per_worker)
  if computes and job.tpu_topology:
    limits["google.com/tpu"] = str(job.tpus_per_worker)
  container = {
      "name": CONTAINER,
      "image": job.image,
      "command": list(ENTRYPOINT),
      "args": list(job.train_args),
      "ports": [{"name": PORT_NAME, "containerPort": job.port, "protocol": "TCP"}],
      "resources": {"requests": requests, "limits": limits},
      "securityContext": {"allowPrivilegeEscalation": False,
                          "capabilities": {"drop": ["ALL"]}},
  }
  if job.kind != "tfjob":  # The TFJob operator writes TF_CONFIG itself.
    env = [{"name": cluster_lib.CLUSTER_ENV, "value": json.dumps(hostnames(job))},
           {"name": cluster_lib.PEER_TIMEOUT_ENV, "value": str(job.peer_timeout)}]
    if job.kind == "jobset":
      env.append({"name": cluster_lib.TASK_TYPE_ENV, "value": role})
    container["env"] = env
  if job.model_parallel:  # Every pod judges the plan on the GPUs rendered (and checks them).
    container.setdefault("env", []).append({"name": cluster_lib.GPUS_ENV,
                                            "value": str(job.gpus_per_worker)})
  if job.pvc:
    container["volumeMounts"] = [{"name": "model-dir", "mountPath": job.mount_path}]
  return container


def _pod_template(job: Job, role: Optional[str]) -> dict:
  """The pods of task type `role` (None: one template for every task type)."""
  spec = {
      "containers": [_container(job, role)],
      # Time from SIGTERM (eviction, preemption) to SIGKILL: enough to save a checkpoint.
      "terminationGracePeriodSeconds": job.grace_seconds,
      # The pods never call the Kubernetes API; a token would only be exposed to
      # whoever reaches the unauthenticated TF port.
      "automountServiceAccountToken": False,
      "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                          "fsGroup": UID},
  }
  if job.kind != "tfjob":
    spec["restartPolicy"] = "Never"  # Restarts are the whole job's, never one pod's.
  if job.kind == "indexed-job":
    spec["subdomain"] = job.name  # The headless Service: pods resolve as <job>-<i>.<name>.
  if job.pvc:
    spec["volumes"] = [{"name": "model-dir",
                        "persistentVolumeClaim": {"claimName": job.pvc}}]
  if role in ("worker", None) and job.tpu_topology:
    spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": job.tpu_accelerator,
                            "cloud.google.com/gke-tpu-topology": job.tpu_topology}
  labels = dict(job.labels, **({"tfpar/task-type": role} if role else {}))
  return {"metadata": {"labels": labels}, "spec": spec}


def _metadata(job: Job, name: Optional[str] = None) -> dict:
  return {"name": name or job.name, "labels": dict(job.labels)}


def tfjob(job: Job) -> dict:
  """A Kubeflow TFJob: the operator creates the pods, their Services and TF_CONFIG."""
  multi_worker = not job.ps
  replica_names = {"chief": "Chief", "worker": "Worker", "ps": "PS"}
  replicas = {
      replica_names[role]: {
          "replicas": count,
          # A multi-worker step needs every worker: restarting one pod would leave
          # it waiting for peers stuck in the old step, so a failure ends the job.
          # Parameter-server tasks recover singly (the coordinator resends work).
          "restartPolicy": "Never" if multi_worker else "OnFailure",
          "template": _pod_template(job, role),
      } for role, count in job.roles}
  # No successPolicy: the operator's default ends the job when the chief (or,
  # without one, worker 0) completes, deleting the pods still running: what
  # parameter servers need.
  return {
      "apiVersion": "kubeflow.org/v1",
      "kind": "TFJob",
      "metadata": _metadata(job),
      "spec": {"runPolicy": {"backoffLimit": job.max_restarts, "cleanPodPolicy": "Running"},
               "tfReplicaSpecs": replicas},
  }


def _indexed_job_spec(job: Job, role: Optional[str], count: int,
                      index_0_ends: bool = False) -> dict:
  """`index_0_ends`: the Job succeeds when index 0 (the chief) does, as its servers never
  finish on their own; Kubernetes then ends the remaining pods."""
  spec = {
      "completionMode": "Indexed",
      "completions": count,
      "parallelism": count,
      "backoffLimit": 0,  # One failed pod fails the Job: the JobSet (or you) restart the group.
      # The Job's failure message then names the exit code, which the JobSet's
      # failure policy reads.
      "podFailurePolicy": {"rules": [
          {"action": "FailJob",
           "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": list(codes)}}
          for codes in (status.NOT_RESTARTABLE, (status.PREEMPTED,))]},
      "template": _pod_template(job, role),
  }
  if index_0_ends:
    spec["successPolicy"] = {"rules": [{"succeededIndexes": "0"}]}
  return spec


def jobset(job: Job) -> dict:
  """A JobSet: one Indexed Job per task type, restarted together."""
  spec = {
      "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
      "failurePolicy": {
          "maxRestarts": job.max_restarts,
          # What no restart fixes (bad input, a non-finite step, a full disk) fails
          # the set; a preempted job (every worker saved) restarts without using up
          # a restart; any other failure restarts every Job of the set. The Job
          # controller's message reads "Container tensorflow for pod NS/POD failed
          # with exit code N matching FailJob rule at index I".
          "rules": [
              {"name": name, "action": action, "onJobFailureReasons": ["PodFailurePolicy"],
               "onJobFailureMessagePatterns": [f"failed with exit code {codes} matching"]}
              for name, action, codes in (
                  ("NotRestartable", "FailJobSet",
                   "(" + "|".join(str(c) for c in status.NOT_RESTARTABLE) + ")"),
                  ("Preempted", "RestartJobSetAndIgnoreMaxRestarts", str(status.PREEMPTED)))],
      },
      # Parameter servers and workers serve until the chief is done.
      "successPolicy": ({"operator": "Any", "targetReplicatedJobs": ["chief"]} if job.ps
                        else {"operator": "All", "targetReplicatedJobs": ["worker"]}),
      "replicatedJobs": [{"name": role, "replicas": 1,
                          "template": {"spec": _indexed_job_spec(job, role, count)}}
                         for role, count in job.roles],
  }
  return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": _metadata(job), "spec": spec}


def indexed_job(job: Job) -> dict:
  """One Indexed Job holding every task; pod i is task i of chief, workers, ps."""
  total = sum(count for _, count in job.roles)
  # With parameter servers, one pod template serves every task type: they all
  # get the worker's resources.
  spec = _indexed_job_spec(job, None if job.ps else "worker", total,
                           index_0_ends=bool(job.ps))
  return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job), "spec": spec}


def headless_service(job: Job) -> dict:
  """Gives each Indexed Job pod the DNS name <job>-<index>.<name>, before it is Ready."""
  return {
      "apiVersion": "v1", "kind": "Service", "metadata": _metadata(job),
      "spec": {"clusterIP": "None",
               "publishNotReadyAddresses": True,  # Peers resolve while still starting.
               "selector": dict(job.labels),
               "ports": [{"name": PORT_NAME, "port": job.port, "targetPort": job.port,
                          "protocol": "TCP"}]},
  }


def network_policy(job: Job) -> dict:
  """Admits only this job's pods, and only to the TF port (the servers have no auth)."""
  return {
      "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
      "metadata": _metadata(job, f"{job.name}-tf-port"),
      "spec": {"podSelector": {"matchLabels": dict(job.labels)},
               "policyTypes": ["Ingress"],
               "ingress": [{"from": [{"podSelector": {"matchLabels": dict(job.labels)}}],
                            "ports": [{"protocol": "TCP", "port": job.port}]}]},
  }


def render(job: Job) -> List[dict]:
  """Every object of the job, in the order `kubectl apply` should create them."""
  if job.kind == "tfjob":
    return [network_policy(job), tfjob(job)]
  if job.kind == "jobset":
    return [network_policy(job), jobset(job)]
  return [network_policy(job), headless_service(job), indexed_job(job)]
