"""Data parallelism on a TPU: `--strategy=tpu --tpu=local|NAME|grpc://ADDR`.

Every TPU core is a replica: each holds the whole model (TPUMirroredVariables)
and a G/R slice of the global batch; the gradient all-reduce in
tfpar.training.step becomes a cross-replica sum over the TPU interconnect.
The engine is the ordinary DataParallelEngine: nothing else changes.

What a TPU asks of the program (and where tfpar gives it):
  * static shapes: every batch has the same shape. The pipeline packs text
    into fixed `seq_len` windows and yields whole per-replica batches of an
    endless stream (never a short last batch, no padding), so nothing has to
    be `drop_remainder`-ed away (tfpar.data.pipeline).
  * XLA: TPUStrategy compiles the replica step itself; the same step compiles
    under `tf.function(jit_compile=True)` on CPU (tests/test_tpu.py), the best
    check available without a TPU.
  * bfloat16: `--precision=mixed_bfloat16` (configs/gpt_tpu.flags); no loss
    scaling needed, the loss and softmax stay float32.
  * few host round trips: `--steps_per_call` steps run inside one tf.function
    call.

Resolution: `local` is the TPU attached to this VM (a TPU VM); NAME a Cloud
TPU found through the Cloud TPU API (needs the VM's credentials and
metadata server); `grpc://host:8470` a TPU worker by address (older TPU Node
setups). Connecting to a `grpc://` address that does not answer blocks inside
TensorFlow with no deadline of its own, so tfpar first opens a
TCP connection itself and fails within CONNECT_TIMEOUT seconds with one line.

None of this has run on TPU hardware: see docs/strategies_ps_tpu.md.
"""

import socket
from urllib.parse import urlparse

import tensorflow as tf

from tfpar.config.schema import ConfigError, DistConfig

# Seconds to wait for a grpc:// TPU worker to accept a TCP connection.
CONNECT_TIMEOUT = 10.0


def _check_reachable(address: str) -> None:
  """Fails fast, with one line, when nothing listens at grpc://host:port."""
  parsed = urlparse(address)
  if not parsed.hostname or not parsed.port:
    raise ConfigError(f"--tpu={address} is not of the form grpc://HOST:PORT "
                      "(a TPU worker's port is usually 8470)")
  try:
    with socket.create_connection((parsed.hostname, parsed.port), timeout=CONNECT_TIMEOUT):
      pass
  except OSError as e:
    raise ConfigError(f"--tpu={address}: no TPU worker reachable ({e.strerror or e}): check "
                      "the address and that the TPU is up; on a TPU VM use --tpu=local") from None


def resolve(tpu: str) -> tf.distribute.cluster_resolver.TPUClusterResolver:
  """--tpu -> a TPUClusterResolver; ConfigError (one line) if no TPU can be found."""
  if tpu.startswith("grpc://"):
    _check_reachable(tpu)
  try:
    return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  except Exception as e:  # pylint: disable=broad-except  # Errors differ by lookup path.
    raise ConfigError(f"--tpu={tpu}: cannot resolve this TPU ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]}): on a TPU VM use --tpu=local, elsewhere "
                      "the TPU's name (with Cloud TPU API access) or grpc://ADDR") from None


def make_strategy(dist: DistConfig) -> tf.distribute.TPUStrategy:
  """Resolves, connects to and initialises the TPU; returns its TPUStrategy."""
  resolver = resolve(dist.tpu)
  try:
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except (tf.errors.OpError, ValueError, RuntimeError) as e:
    message = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
    raise ConfigError(f"--tpu={dist.tpu}: no TPU reachable ({message}): run on a TPU VM with "
                      "--tpu=local, or give a TPU name or grpc://ADDR") from None
  return tf.distribute.TPUStrategy(resolver)
