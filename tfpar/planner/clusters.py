"""Cluster descriptions: what the planner knows about the machines a plan runs on.

A cluster is `NAME:N` for a built-in device type (N devices) or a YAML file
with every field of `Cluster` (see docs/planner.md for an example). Numbers
are per device; bandwidths are bytes/s in one direction, the rate one device
can push while all of its peers push too.

Sources of the built-in numbers:
- A100 SXM (NVIDIA A100 datasheet): 312 TFLOP/s bf16/fp16 dense, 156 TF32;
  40 or 80 GB HBM2e at 1,555 or 2,039 GB/s; 400 W TDP;
  NVLink 3 600 GB/s per GPU both directions (300 one way); 8 GPUs per node,
  one 200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s), as in Narayanan et al. 2021.
- H100 SXM5 80 GB (NVIDIA H100 Tensor Core GPU datasheet): 989 TFLOP/s bf16/fp16
  dense (1,979 with sparsity), 494 TF32; 80 GB HBM3 at 3.35 TB/s; up to 700 W
  TDP; NVLink 4 900 GB/s per GPU both directions (450 one way) through NVSwitch,
  8 GPUs per node (DGX H100); one 400 Gb/s NDR InfiniBand adapter per GPU
  (ConnectX-7, 50 GB/s; the DGX H100 user guide's eight compute-fabric ports).
- TPU v4 (Cloud TPU docs): 275 TFLOP/s bf16, 32 GiB HBM, 4,096 chips per pod
  on ICI with 1.1 PB/s all-reduce bandwidth per pod (268 GB/s per chip);
  192 W per chip at most (Jouppi et al. 2023, "TPU v4: An Optically
  Reconfigurable Supercomputer", ISCA: 170 W mean).
- TPU v5p (Cloud TPU docs): 459 TFLOP/s bf16, 95 GiB HBM, slices of up to
  6,144 chips on ICI (1,200 GB/s per chip both directions: 600 one way),
  50 Gb/s data-center network per chip between slices; no published power
  (give power_watts in a YAML cluster for energy).
Device power (power_watts) is the TDP: an upper bound of what the device
draws in a busy step; hosts, NICs and switches are not counted.
TPUs have no float32 matmul unit: float32 runs as three bf16 passes
(XLA's precision HIGH), a third of the bf16 peak. Latencies (5 us inside a
node, 10 us across) are typical NCCL/ICI figures, not measurements.
- cpu:N is one host split into N logical CPU devices that share its cores
  (a 50 GFLOP/s host; the devices take turns, see Cluster.shared): a
  placeholder for tests and small plans; tfpar.planner.calibrate builds one
  from a measured matmul rate.
"""

import dataclasses
import os
from typing import Dict, Optional

import yaml

GIB = 2 ** 30


class ClusterError(ValueError):
  """A cluster description that cannot be used; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fraction of peak a device reaches on one layer's matmuls (tfpar.planner.cost.efficiency).

  eff = max_efficiency / (1 + width_half / (h/T) + rows_half / (b*s)); plus
  `op_seconds` of fixed cost per layer and micro-batch pass (kernel launches,
  op dispatch). The GPU and TPU constants are fitted to Narayanan et al. 2021
  (`python scripts/planner_table.py --fit` searches them; docs/planner.md);
  cpu constants come from scripts/planner_calibrate.py.
  """
  max_efficiency: float = 0.66
  width_half: float = 64.0
  rows_half: float = 0.0
  op_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Cluster:
  """N identical devices, grouped in nodes.

  Attributes:
    name: shown in reports.
    kind: "gpu", "tpu" or "cpu" (which tfpar flags a plan emits).
    devices: N.
    memory_bytes: memory per device.
    memory_bandwidth: bytes/s between a device and its memory (HBM).
    peak_flops: peak FLOP/s per device by compute dtype (float32, bfloat16, float16).
    devices_per_node: devices on one fast interconnect (an NVLink node, a TPU ICI slice).
    intra_bandwidth, intra_latency: bytes/s one way and seconds, inside a node.
    inter_bandwidth, inter_latency: the same between nodes.
    efficiency: compute efficiency constants.
    shared: the devices are logical devices of one host that share its cores
      and memory bandwidth (cpu:N): each runs at the host's full rate but they
      take turns, so a step costs the sum of every device's work and a
      pipeline stage's idle time is not lost (no bubble cost).
    power_watts: a device's power (its TDP), for energy; None where unknown.
  """
  name: str
  kind: str
  devices: int
  memory_bytes: float
  memory_bandwidth: float
  peak_flops: Dict[str, float]
  devices_per_node: int
  intra_bandwidth: float
  intra_latency: float
  inter_bandwidth: float
  inter_latency: float
  efficiency: Efficiency = Efficiency()
  shared: bool = False
  power_watts: Optional[float] = None

  @property
  def nodes(self) -> int:
    return -(-self.devices // self.devices_per_node)


def _gpu(peak16, peak32, memory, hbm, intra, inter, watts):
  return dict(kind="gpu", memory_bytes=memory * GIB, memory_bandwidth=hbm, power_watts=watts,
              peak_flops={"bfloat16": peak16, "float16": peak16, "float32": peak32},
              devices_per_node=8, intra_bandwidth=intra, intra_latency=5e-6,
              inter_bandwidth=inter, inter_latency=10e-6)


def _tpu(peak16, memory, hbm, ici, dcn, slice_chips, watts):
  return dict(kind="tpu", memory_bytes=memory * GIB, memory_bandwidth=hbm, power_watts=watts,
              peak_flops={"bfloat16": peak16, "float16": peak16, "float32": peak16 / 3},
              devices_per_node=slice_chips, intra_bandwidth=ici, intra_latency=5e-6,
              inter_bandwidth=dcn, inter_latency=10e-6)


BUILT_IN = {
    "a100-40gb": _gpu(312e12, 156e12, 40, 1555e9, 300e9, 25e9, 400.0),
    "a100-80gb": _gpu(312e12, 156e12, 80, 2039e9, 300e9, 25e9, 400.0),
    "h100-80gb": _gpu(989e12, 494e12, 80, 3350e9, 450e9, 50e9, 700.0),
    "tpu-v4": _tpu(275e12, 32, 1200e9, 268e9, 6.25e9, 4096, 192.0),
    "tpu-v5p": _tpu(459e12, 95, 2765e9, 600e9, 6.25e9, 6144, None),
    "cpu": dict(kind="cpu", memory_bytes=4 * GIB, memory_bandwidth=10e9,
                peak_flops={"float32": 50e9, "bfloat16": 50e9, "float16": 50e9},
                devices_per_node=1 << 30, intra_bandwidth=5e9, intra_latency=20e-6,
                inter_bandwidth=1e9, inter_latency=100e-6,
                efficiency=Efficiency(max_efficiency=0.5, width_half=32.0, rows_half=64.0,
                                      op_seconds=2e-3),
                shared=True),
}

REQUIRED = ("devices", "memory_bytes", "memory_bandwidth", "peak_flops", "devices_per_node", "intra_bandwidth",
            "intra_latency", "inter_bandwidth", "inter_latency")


def is_file(spec: str) -> bool:
  """Does --cluster name a YAML file (read through tf.io.gfile) rather than NAME:N?"""
  return spec.endswith((".yaml", ".yml")) or os.path.sep in spec


def parse(spec: str) -> Cluster:
  """`NAME:N` (a built-in type) or a YAML file path -> Cluster.

  Raises:
    ClusterError: one line naming what is wrong and how to fix it.
  """
  if is_file(spec):
    return from_yaml(spec)
  name, _, count = spec.partition(":")
  if name not in BUILT_IN:
    raise ClusterError(f"--cluster={spec}: unknown cluster type {name!r}; use one of "
                       f"{', '.join(f'{n}:N' for n in BUILT_IN)} or a YAML file")
  try:
    n = int(count)
  except ValueError:
    n = 0
  if n <= 0:
    raise ClusterError(f"--cluster={spec}: give the device count as {name}:N with N > 0, "
                       f"e.g. {name}:64")
  fields = dict(BUILT_IN[name])
  if name in ("tpu-v4", "tpu-v5p"):
    fields["devices_per_node"] = min(fields["devices_per_node"], n)
  return Cluster(name=f"{name}:{n}", devices=n, **fields)


def from_yaml(path: str) -> Cluster:
  """A cluster from a YAML mapping holding every field of REQUIRED (and optionally kind, efficiency)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  # gfile: gs:// works too.
  if not tf.io.gfile.exists(path):
    raise ClusterError(f"--cluster={path}: no such file; pass a YAML cluster file or NAME:N")
  with tf.io.gfile.GFile(path) as f:
    try:
      raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise ClusterError(f"--cluster={path} is not valid YAML ({str(e).splitlines()[0]})") from None
  if not isinstance(raw, dict):
    raise ClusterError(f"--cluster={path} must hold a mapping of fields: {', '.join(REQUIRED)}")
  missing = [k for k in REQUIRED if k not in raw]
  if missing:
    raise ClusterError(f"--cluster={path} is missing field(s) {', '.join(missing)}: add them "
                       "(see docs/planner.md for an example)")
  optional = ("name", "kind", "efficiency", "shared", "power_watts")
  unknown = sorted(set(raw) - set(REQUIRED) - set(optional))
  if unknown:
    raise ClusterError(f"--cluster={path} has unknown field(s) {', '.join(unknown)}: the fields "
                       f"are {', '.join(REQUIRED + optional)}")
  shared = raw.get("shared", False)
  if not isinstance(shared, bool):
    raise ClusterError(f"--cluster={path}: shared={shared!r} must be true or false")
  numbers = {key: _positive(path, key, raw[key]) for key in REQUIRED if key != "peak_flops"}
  peak = raw["peak_flops"]
  if not isinstance(peak, dict) or not peak:
    raise ClusterError(f"--cluster={path}: peak_flops must map dtypes to positive FLOP/s, "
                       "e.g. {float32: 19.5e12, bfloat16: 312e12}")
  peak = {str(k): _positive(path, f"peak_flops.{k}", v) for k, v in peak.items()}
  kind = raw.get("kind", "gpu")
  if kind not in ("gpu", "tpu", "cpu"):
    raise ClusterError(f"--cluster={path}: kind={kind!r} must be gpu, tpu or cpu")
  eff = raw.get("efficiency") or {}
  known = {f.name for f in dataclasses.fields(Efficiency)}
  if not isinstance(eff, dict) or set(eff) - known:
    raise ClusterError(f"--cluster={path}: efficiency may only set {', '.join(sorted(known))}")
  try:
    eff = {k: float(v) for k, v in eff.items()}
  except (TypeError, ValueError):
    raise ClusterError(f"--cluster={path}: efficiency values must be numbers") from None
  return Cluster(name=str(raw.get("name", os.path.basename(path))), kind=kind,
                 devices=int(numbers["devices"]), memory_bytes=float(numbers["memory_bytes"]),
                 memory_bandwidth=float(numbers["memory_bandwidth"]),
                 peak_flops=peak,
                 devices_per_node=int(numbers["devices_per_node"]),
                 intra_bandwidth=float(numbers["intra_bandwidth"]),
                 intra_latency=float(numbers["intra_latency"]),
                 inter_bandwidth=float(numbers["inter_bandwidth"]),
                 inter_latency=float(numbers["inter_latency"]),
                 efficiency=Efficiency(**eff), shared=shared,
                 power_watts=(_positive(path, "power_watts", raw["power_watts"])
                              if "power_watts" in raw else None))


def _positive(path: str, key: str, value) -> float:
  """A positive number; YAML 1.1 reads 1e-5 (no dot) as a string, so strings are parsed too."""
  try:
    number = float(value) if not isinstance(value, bool) else float("nan")
  except (TypeError, ValueError):
    number = float("nan")
  if not number > 0:
    raise ClusterError(f"--cluster={path}: {key}={value!r} must be a positive number")
  return number
