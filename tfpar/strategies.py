"""One string -> one tf.distribute strategy.

`setup_devices` must run before anything initialises TensorFlow's runtime: it
splits the host CPU into logical devices (how tfpar tests multi-device code on
a laptop). `make_strategy` maps --strategy to a strategy and raises on
anything else; the loop, model and data code are the same for all of them.
"""

import os

import tensorflow as tf

from tfpar.config import rules
from tfpar.config.cluster import GPUS_ENV, Cluster
from tfpar.config.schema import ConfigError, DistConfig


def setup_devices(num_cpu_devices: int) -> None:
  """Splits the physical CPU into `num_cpu_devices` logical devices (call before TF starts).

  A process whose runtime already started with at least that many logical CPUs
  (a test session, a notebook) is left as it is; one with fewer gets a clear error.
  """
  cpu = tf.config.list_physical_devices("CPU")[0]
  configured = tf.config.get_logical_device_configuration(cpu)
  if num_cpu_devices <= max(1, len(configured or [])):
    return
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices)
  except RuntimeError:
    raise ConfigError(f"--num_cpu_devices={num_cpu_devices}: TensorFlow already started with "
                      f"{max(1, len(configured or []))} CPU device(s) in this process; split "
                      "the CPU before TensorFlow initialises") from None


def compute_devices(num_cpu_devices: int = 0):
  """The devices replicas run on: every GPU, else the first `num_cpu_devices` logical CPUs."""
  gpus = tf.config.list_logical_devices("GPU")
  if gpus:
    return [d.name for d in gpus]
  cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
  return cpus[:num_cpu_devices] if num_cpu_devices else cpus


def devices_per_worker(cfg, environ=os.environ) -> int:
  """This worker's devices: the GPUs, else --num_cpu_devices.

  Counted without starting TensorFlow's runtime (a MultiWorkerMirroredStrategy
  must configure its collectives first). A pod rendered by tfpar.k8s says how
  many GPUs it was given (GPUS_ENV): the render chose the job's policies on
  that count, and each worker decides alone whether it serves, so a pod that
  sees another count stops here (a GPU node that shows every GPU to a pod that
  asked for none, a missing device plugin).
  """
  gpus = len(tf.config.list_physical_devices("GPU"))
  given = environ.get(GPUS_ENV)
  if given is not None and given != str(gpus):
    raise ConfigError(f"this pod sees {gpus} GPU(s) but was rendered with {GPUS_ENV}={given} "
                      "(tfpar.k8s render --gpus_per_worker): render the job again with "
                      f"--gpus_per_worker={gpus}, or give the pod the GPUs it asked for")
  return gpus or max(1, cfg.dist.num_cpu_devices)


def stages_across_workers(cfg, environ=os.environ) -> bool:
  """tfpar.config.rules.stages_across_workers on this worker's devices (`devices_per_worker`)."""
  return rules.stages_across_workers(cfg, devices_per_worker(cfg, environ))


def make_strategy(dist: DistConfig, cluster: Cluster) -> tf.distribute.Strategy:
  """Builds the strategy --strategy names."""
  name = dist.strategy
  if name == "one_device":
    return tf.distribute.OneDeviceStrategy(compute_devices()[0])
  if name == "mirrored":
    devices = compute_devices(dist.num_cpu_devices)
    cross = None if tf.config.list_logical_devices("GPU") else tf.distribute.ReductionToOneDevice()
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross)
  if name == "multi_worker_mirrored":
    return _multi_worker(dist, cluster)
  if name == "parameter_server":
    from tfpar.engines.parameter_server import server as parameter_server  # pylint: disable=import-outside-toplevel
    return parameter_server.make_strategy(dist, cluster)
  if name == "tpu":
    from tfpar.parallel import tpu  # pylint: disable=import-outside-toplevel
    return tpu.make_strategy(dist)
  raise ConfigError(f"--strategy={name} is unknown: use one_device, mirrored, "
                    "multi_worker_mirrored, parameter_server or tpu")


def _multi_worker(dist: DistConfig, cluster: Cluster) -> tf.distribute.Strategy:
  if not cluster.spec:
    raise ConfigError("--strategy=multi_worker_mirrored needs TF_CONFIG: start the job with "
                      "python -m tfpar.launch --num_workers=N -- <flags>, or set TF_CONFIG")
  implementation = {
      "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
      "ring": tf.distribute.experimental.CommunicationImplementation.RING,
      "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
  }[dist.collective]
  if dist.collective == "nccl" and not tf.config.list_physical_devices("GPU"):
    raise ConfigError("--collective=nccl needs GPUs and this machine has none: use "
                      "--collective=ring or auto")
  # No timeout per collective: TensorFlow enforces one with a thread of its own that sleeps
  # out the whole timeout, so a job launching many collectives a second (zero3's gathers,
  # small steps) holds thousands of threads until the process can start no more and aborts.
  # A peer that dies or freezes fails the step through the coordination service's
  # heartbeats (docs/failures.md).
  options = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=int(dist.all_reduce_pack_mb * 2**20), implementation=implementation)
  fixed_instance_keys()
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                   communication_options=options)


def fixed_instance_keys() -> None:
  """tf.distribute's collectives take their instance keys when a step is traced, the same at
  every call, instead of fresh ones drawn at each call.

  TensorFlow keeps, for the life of the process, a record of every instance key a collective
  used (CollectiveParamResolverLocal's instance table) and the scalar tensor of every key it
  converted (the eager scalar cache, TFE_TensorHandleCache): with a fresh key per call a
  worker grows by about half a KiB per collective call, 39 KiB a step for 2 zero3 workers
  of a 4-block model (docs/failures.md). Every worker traces the same functions in the same order,
  so keys taken at tracing agree between workers, as the stage workers' own (p2p) do.
  """
  from tensorflow.python.distribute import cross_device_utils  # pylint: disable=import-outside-toplevel
  cross_device_utils.CollectiveReplicaLauncher._prefer_unique_instance_key = False  # pylint: disable=protected-access
