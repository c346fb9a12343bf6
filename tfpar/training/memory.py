"""The allocators' peak bytes over a steady training call, beside the plan's prediction.

TensorFlow counts the bytes each allocator hands out and the most alive at
once (`tf.config.experimental.get_memory_info`, `reset_memory_stats`): one
allocator per GPU or TPU core, and one for the host, which every logical CPU
device of a process shares (so on CPU the figure is of all of them together;
scripts/pipeline_memory.py separates stages from a profiler trace instead).
The host's default allocator misses most small allocations in its counts (a
step of a 2-layer toy: 0.5 MiB counted where its BFC allocator counts 2.4);
so CPU devices are read only when TensorFlow runs its BFC allocator there,
`TF_CPU_ALLOCATOR_USE_BFC=true` in the environment before it starts.
The loop resets the counters before its first call after the one that traced
and compiled (the peak becomes what is allocated then: `held`, the weights,
optimizer state, input buffers and whatever else the process keeps) and reads
the peak after it; `added` = peak - held is what the call's steps needed on
top: gradients, the activations the backward keeps, and temporaries. Devices
of other processes are not read (each worker's allocators are its own).

Written into `model_dir/plan.json` as `allocator_peak` (by the chief) and
logged beside the prediction for the same devices (`Engine.predicted_memory`:
weights and optimizer state, held before; gradients and activations, added).

Per process, from the kernel: `record_process` logs the process's peak
resident memory (/proc/self/status VmHWM) at start-up and at the end beside
what the plan puts in its host memory (every kind on its own CPU devices), and
the chief writes both into plan.json's `process_memory`.
"""

import os
from typing import Dict, List, Sequence

import tensorflow as tf

from tfpar.layout import placement

KINDS = ("weights", "gradients", "optimizer", "activations")


def _mib(n: float) -> str:
  return f"{n / 2 ** 20:.2f} MiB"


def allocators(devices: Sequence[str]) -> Dict[str, List[str]]:
  """{allocator: [device names]}: the host's CPU devices share 'CPU'; a GPU or TPU core has its own.

  Only devices whose counters this process can read (its own) and that count
  every allocation (CPU: under the BFC allocator only) are kept.
  """
  out: Dict[str, List[str]] = {}
  host_counts = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("true", "1")
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if spec.device_type == "CPU" and not host_counts:
      continue
    try:
      tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):  # Another process's device, or no counters.
      continue
    name = "CPU" if spec.device_type == "CPU" else f"{spec.device_type}:{spec.device_index}"
    out.setdefault(name, [])
    if device not in out[name]:
      out[name].append(device)
  return out


def reset(groups: Dict[str, List[str]]) -> Dict[str, int]:
  """Sets each allocator's peak to what it holds now; returns that ({allocator: bytes held})."""
  held = {}
  for name, devices in groups.items():
    tf.config.experimental.reset_memory_stats(devices[0])
    held[name] = int(tf.config.experimental.get_memory_info(devices[0])["current"])
  return held


def peaks(groups: Dict[str, List[str]]) -> Dict[str, int]:
  """{allocator: the most bytes alive at once since `reset`}."""
  return {name: int(tf.config.experimental.get_memory_info(devices[0])["peak"])
          for name, devices in groups.items()}


HELD, ADDED = ("weights", "optimizer"), ("gradients", "activations")


def record(model_dir: str, steps, groups: Dict[str, List[str]], held: Dict[str, int],
           peak: Dict[str, int], predicted: Dict[str, Dict[str, int]]) -> str:
  """Adds `allocator_peak` to plan.json (if the engine wrote one) and returns the log line.

  Args:
    model_dir: the run directory.
    steps: (first, last) step of the measured call.
    groups, held, peak: `allocators`, `reset` and `peaks`.
    predicted: {device name: {kind: bytes}} (KINDS), the engine's prediction per device.
  """
  entries, parts = {}, []
  for name, devices in groups.items():
    kinds = {kind: sum(predicted.get(d, {}).get(kind, 0) for d in devices) for kind in KINDS}
    added = peak[name] - held[name]
    entries[name] = {"devices": devices, "held_bytes": held[name], "peak_bytes": peak[name],
                     "added_bytes": added, "predicted": kinds,
                     "predicted_added_bytes": sum(kinds[k] for k in ADDED)}
    shared = f" ({len(devices)} devices)" if len(devices) > 1 else ""
    parts.append(f"{name}{shared} held {_mib(held[name])} (weights + optimizer predicted "
                 f"{_mib(sum(kinds[k] for k in HELD))}), added {_mib(added)} (gradients + "
                 f"activations predicted {_mib(entries[name]['predicted_added_bytes'])})")
  plan = placement.read_plan_json(model_dir)
  if plan is not None:
    plan["allocator_peak"] = {"steps": list(steps), "allocators": entries}
    placement.write_plan_json(model_dir, plan)
  first, last = steps
  during = f"step {first}" if first == last else f"steps {first}-{last}"
  return f"memory during {during}, allocator: " + "; ".join(parts)


def _status(field: str) -> int:
  """A number of /proc/self/status (its first word); 0 where there is no /proc."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


def peak_rss() -> int:
  """This process's peak resident memory in bytes, from the kernel (VmHWM); 0 without /proc."""
  return _status("VmHWM") * 1024


def threads() -> int:
  """This process's threads now (the kernel's count); 0 without /proc."""
  return _status("Threads")


def _own(device: str, worker_index: int) -> bool:
  """Whether `device` is this process's: no job or localhost named, or the task this worker is."""
  spec = tf.DeviceSpec.from_string(device)
  if spec.job in (None, "localhost"):  # A process without a cluster names its devices so.
    return True
  index = spec.task or 0
  return (spec.job == "chief" and worker_index == 0) or (
      spec.job == "worker" and index == worker_index)


def predicted_host_bytes(predicted: Dict[str, Dict[str, int]], worker_index: int = 0) -> int:
  """What the plan puts in this process's host memory: every kind (KINDS) on its CPU devices."""
  return sum(sum(kinds.get(k, 0) for k in KINDS) for device, kinds in predicted.items()
             if tf.DeviceSpec.from_string(device).device_type == "CPU"
             and _own(device, worker_index))


def record_process(model_dir: str, when: str, worker_index: int,
                   predicted: Dict[str, Dict[str, int]], write: bool) -> str:
  """The line on this process's peak resident memory beside the plan's host-side prediction;
  with `write`, also into plan.json's `process_memory` (the chief's, if it wrote one)."""
  peak, host = peak_rss(), predicted_host_bytes(predicted, worker_index)
  plan = placement.read_plan_json(model_dir) if write else None
  if plan is not None:
    plan.setdefault("process_memory", {})[f"worker {worker_index}"] = {
        "when": when, "peak_rss_bytes": peak, "predicted_host_bytes": host}
    placement.write_plan_json(model_dir, plan)
  return (f"memory {when}, process (worker {worker_index}): peak resident {_mib(peak)} (VmHWM), "
          f"{threads()} threads; "
          f"the plan puts {_mib(host)} of weights, gradients, optimizer state and activations "
          "in its host memory")
