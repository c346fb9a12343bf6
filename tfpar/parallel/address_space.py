"""A process address-space limit (`ulimit -v`, RLIMIT_AS) against what the run will map.

Under such a limit TensorFlow's allocators get NULL where they expected memory,
and some of its kernels (the initializers) do not check: the process dies of
SIGSEGV (exit 139) instead of an error. So, once TensorFlow is imported and
before its runtime starts, the limit is compared with what the plan predicts this process will hold:
weights, gradients and AdamW's two slots on each of its devices
(tfpar.layout.placement.state_bytes_per_device, at most that on every local
device), plus the address space TensorFlow maps for itself once its runtime
runs (TF_BASELINE: ~2.0 GiB measured as VmPeak after importing tensorflow and
keras and running one op, Python 3.11 / TF 2.21 on this machine). A limit
below that is bad input: one line with both figures, exit 2. Activations and
the corpus come on top and are not predicted here: a run that passes may still
meet the limit, as an OutOfMemoryError (tfpar.runner).
"""

import resource
from typing import Optional

from tfpar.config.schema import Config, ConfigError

TF_BASELINE = 2 * 2 ** 30


def limit() -> Optional[int]:
  """This process's address-space limit in bytes, or None where there is none."""
  soft = resource.getrlimit(resource.RLIMIT_AS)[0]
  return None if soft == resource.RLIM_INFINITY else soft


def local_devices(cfg: Config) -> int:
  """The devices of this process that hold model state (logical CPUs on a host)."""
  return max(1, cfg.dist.num_cpu_devices) if cfg.dist.strategy != "one_device" else 1


def check(cfg: Config) -> None:
  """ConfigError where the address-space limit is below what the run will certainly map."""
  cap = limit()
  if cap is None:
    return
  from tfpar.layout import placement as plan  # pylint: disable=import-outside-toplevel
  state = plan.state_bytes_per_device(cfg) * local_devices(cfg)
  if TF_BASELINE + state <= cap:
    return
  gib = lambda n: f"{n / 2 ** 30:.2f} GiB"  # noqa: E731
  raise ConfigError(
      f"this process may map {gib(cap)} (ulimit -v), but weights, gradients and AdamW slots take "
      f"{gib(state)} on its {local_devices(cfg)} device(s) and TensorFlow itself about "
      f"{gib(TF_BASELINE)}: raise the limit (ulimit -v), or find a plan that fits with "
      "`python -m tfpar.plan` (the same model flags and --cluster=...): more --pipeline_stages "
      "or --tensor_parallel, or a smaller model")
