"""`python -m tfpar.k8s render --kind=K --name=N --workers=W --image=I [...] -- <tfpar.train flags>`.

Prints ready-to-apply YAML (`... | kubectl apply -f -`). Bad render flags, or
training flags that tfpar.train would refuse, end with one line on stderr and
exit status 2, and nothing is printed. TensorFlow is never imported.
"""

import dataclasses
import re
import shlex
import sys
import types
from typing import Sequence

import yaml
from absl import flags as absl_flags

from tfpar.cli import tool
from tfpar.config import cluster as cluster_lib
from tfpar.config import config as config_lib
from tfpar.config import flags as tfpar_flags
from tfpar.config import rules
from tfpar.config.schema import ConfigError
from tfpar.k8s import manifests

USAGE = ("python -m tfpar.k8s render --kind=tfjob|jobset|indexed-job --name=NAME --workers=N "
         "--image=IMAGE [--ps=P] [--gpus_per_worker=G] [--tpu_topology=AxB --tpu_accelerator=A] "
         "[--pvc=CLAIM] -- <tfpar.train flags>")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# A container image reference, as the OCI distribution spec's grammar (docker/distribution
# reference.go) writes it: [registry[:port]/]path[:tag][@digest], the path in lower case.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
IMAGE = re.compile(rf"^(?:{_HOST}(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
                   r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*"
                   r":[0-9a-fA-F]{32,})?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


class RenderError(ValueError):
  """Render input that cannot work; the message names the flag and the fix."""


def parse(argv: Sequence[str]) -> manifests.Job:
  """`render [flags] -- [train flags]` -> a validated Job; raises RenderError."""
  argv = list(argv)
  if not argv or argv[0] != "render":
    raise RenderError(f"the only command is render: {USAGE}")
  if "--" not in argv:
    raise RenderError(f"no '--' before the tfpar.train flags: {USAGE}")
  split = argv.index("--")
  own, train_args = argv[1:split], tuple(argv[split + 1:])
  fv = tfpar_flags.define_render_flags(absl_flags.FlagValues())
  try:
    fv(["render"] + own)
  except absl_flags.Error as e:
    raise RenderError(str(e).splitlines()[0]) from None
  for required in ("kind", "name", "workers", "image"):
    if fv[required].value is None:
      raise RenderError(f"--{required} is not set: {USAGE}")
  if not DNS_LABEL.match(fv.name):
    raise RenderError(f"--name={fv.name} is not a DNS label: use lower-case letters, digits "
                      "and '-', starting with a letter")
  if not IMAGE.match(fv.image):
    raise RenderError(f"--image={fv.image} is not a container image reference: write "
                      "[REGISTRY/]NAME[:TAG][@sha256:DIGEST] with NAME in lower case, e.g. "
                      "--image=registry.example/tfpar:1")
  for flag in ("cpu", "memory"):
    if not QUANTITY.match(fv[flag].value):
      raise RenderError(f"--{flag}={fv[flag].value} is not a Kubernetes quantity: "
                        "e.g. --cpu=4 or --cpu=500m, --memory=16Gi")
  if not train_args:
    raise RenderError(f"no tfpar.train flags after '--': {USAGE}")
  cfg = _check_train_flags(train_args)
  strategy, model_dir = cfg.dist.strategy, cfg.train.model_dir
  job = manifests.Job(
      kind=fv.kind, name=fv.name, workers=fv.workers, image=fv.image, train_args=train_args,
      ps=fv.ps, gpus_per_worker=fv.gpus_per_worker, tpu_topology=fv.tpu_topology,
      tpu_accelerator=fv.tpu_accelerator, cpu=fv.cpu, memory=fv.memory, pvc=fv.pvc,
      mount_path=fv.mount_path.rstrip("/") or "/", port=fv.port, grace_seconds=fv.grace_seconds,
      max_restarts=_max_restarts(fv), peer_timeout=fv.peer_timeout)
  _check_job(job, strategy, model_dir)
  # The batch over the replicas, --ps_shards over the ps: as tfpar.train checks its TF_CONFIG.
  spec = {"worker": [""] * job.workers, **({"ps": [""] * job.ps} if job.ps else {})}
  gpus = job.gpus_per_worker or 0
  try:
    if strategy == "multi_worker_mirrored" and not cfg.parallel.model_parallel:
      rules.check_batch(cfg.train.global_batch_size, job.workers * max(1, gpus),
                             flag=f"--workers={job.workers}"
                             + (f" x --gpus_per_worker={gpus}" if gpus else ""))
    cluster_lib.check_cluster(cfg, cluster_lib.Cluster(spec=spec, task_type="worker", task_index=0))
    if strategy == "multi_worker_mirrored" and cfg.parallel.model_parallel:
      # The plan every pod computes from these flags and its GPUs (GPUS_ENV pins
      # them), judged here the same way: tfpar.strategies.stages_across_workers.
      devices = gpus or max(1, cfg.dist.num_cpu_devices)
      replicas, _ = rules.worker_layout(cfg.parallel, job.workers, devices,
                                             cfg.compression.method)
      rules.check_batch(cfg.train.global_batch_size, replicas, cfg.parallel.microbatches,
                             flag=f"--data_parallel={replicas}")
      job = dataclasses.replace(job, model_parallel=True)
  except ConfigError as e:
    raise RenderError(f"training flags with --workers={job.workers}"
                      f"{f' --ps={job.ps}' if job.ps else ''}"
                      f"{f' --gpus_per_worker={gpus}' if gpus else ''}: {e}") from None
  return job


def _check_train_flags(train_args: Sequence[str]):
  """Validates the training flags as tfpar.train would; returns their Config."""
  try:
    parsed = tfpar_flags.parse(train_args)
  except absl_flags.Error as e:
    raise RenderError(f"training flags: {str(e).splitlines()[0]}") from None
  # --data names a path inside the pod (the image, the volume, a bucket): it is
  # checked there, when tfpar.train starts, not on this machine.
  values = types.SimpleNamespace(**{name: parsed[name].value for name in parsed})
  values.data = None
  try:
    cfg = config_lib.from_flags(values)
  except ConfigError as e:
    raise RenderError(f"training flags: {e}") from None
  return cfg


def _max_restarts(fv) -> int:
  if fv.max_restarts is not None:
    return fv.max_restarts
  return 3 if fv.kind == "jobset" or (fv.kind == "tfjob" and fv.ps) else 0


def _check_job(job: manifests.Job, strategy: str, model_dir: str) -> None:
  try:
    cluster_lib.check_job_shape(strategy, job.workers, job.ps, workers_flag="--workers",
                                ps_flag="--ps")
  except cluster_lib.ClusterError as e:
    raise RenderError(str(e)) from None
  if job.max_restarts and (job.kind == "indexed-job" or (job.kind == "tfjob" and not job.ps)):
    what = "an Indexed Job" if job.kind == "indexed-job" else "a multi-worker TFJob"
    raise RenderError(f"--max_restarts={job.max_restarts}: {what} cannot restart the whole job "
                      "(a lone restarted worker waits for peers stuck in the old step): use "
                      "--kind=jobset, or --max_restarts=0")
  if (job.tpu_topology is None) != (job.tpu_accelerator is None):
    raise RenderError("--tpu_topology and --tpu_accelerator go together: e.g. "
                      "--tpu_topology=2x4 --tpu_accelerator=tpu-v5-lite-podslice")
  if job.tpu_topology is not None:
    if not TOPOLOGY.match(job.tpu_topology):
      raise RenderError(f"--tpu_topology={job.tpu_topology} is not a topology: e.g. 2x4 or 2x2x1")
    if strategy != "tpu":
      raise RenderError(f"--tpu_topology asks for TPUs, but the training flags say "
                        f"--strategy={strategy}: pass --strategy=tpu")
    if job.gpus_per_worker:
      raise RenderError("--gpus_per_worker and --tpu_topology exclude each other: pick one")
  elif strategy == "tpu":
    raise RenderError("--strategy=tpu needs TPU nodes: pass --tpu_topology and --tpu_accelerator")
  if "://" in model_dir:
    if job.pvc:
      raise RenderError(f"--pvc={job.pvc} is unused: --model_dir={model_dir} is a bucket")
  else:
    if not job.pvc:
      raise RenderError(f"--model_dir={model_dir} is a local path that pods do not share: "
                        "use a bucket (--model_dir=gs://BUCKET/DIR) or pass --pvc=CLAIM (a "
                        f"ReadWriteMany volume mounted at {job.mount_path})")
    if not model_dir.startswith(job.mount_path + "/"):
      raise RenderError(f"--model_dir={model_dir} is not on the volume --pvc={job.pvc} mounted "
                        f"at {job.mount_path}: pass --model_dir={job.mount_path}/runs/{job.name}")
  longest = max(host.partition(".")[0] for hosts in manifests.hostnames(job).values()
                for host in hosts)
  if len(longest) > 63:
    raise RenderError(f"--name={job.name} is too long: pod hostname {longest} has more than 63 "
                      "characters")


def to_yaml(job: manifests.Job, argv: Sequence[str]) -> str:
  header = f"# Rendered by: python -m tfpar.k8s {shlex.join(argv)}\n"
  return header + yaml.safe_dump_all(manifests.render(job), sort_keys=False,
                                     default_flow_style=False)


def main(argv: Sequence[str]) -> int:
  if argv and argv[0] in tool.HELP + ("help",):
    print(f"usage: {USAGE}\n\n{manifests.__doc__}")
    print(tfpar_flags.define_render_flags(absl_flags.FlagValues()).get_help())
    return 0
  try:
    job = parse(argv)
  except RenderError as e:
    return tool.error("k8s", str(e))
  sys.stdout.write(to_yaml(job, argv))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
