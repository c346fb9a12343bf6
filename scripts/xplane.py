"""The events of a tf.profiler trace: the newest `*.xplane.pb` under a log directory.

Read through tf.io.gfile, so a trace on gs:// or another TensorFlow
filesystem reads the same; used by scripts/step_profile.py,
scripts/dp_profile.py and (its allocator events, each on the device of the op
that made it) scripts/pipeline_memory.py and scripts/activation_memory.py.

TensorFlow's CPU allocator reports its events only when it is the BFC
allocator, chosen by TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts:
`run_child` runs a measuring script so.
"""

import json
import os
import re
import subprocess
import sys


def _space(logdir: str):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  traces = tf.io.gfile.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
  if not traces:
    raise FileNotFoundError(f"no tf.profiler trace under {logdir}/plugins/profile")
  space = xplane_pb2.XSpace()
  with tf.io.gfile.GFile(sorted(traces)[-1], "rb") as f:
    space.ParseFromString(f.read())
  return space


def events(logdir: str):
  """(name, start, duration) of every event of every plane; times in picoseconds."""
  for plane in _space(logdir).planes:
    names = plane.event_metadata
    for line in plane.lines:
      for event in line.events:
        yield (names[event.metadata_id].name, line.timestamp_ns * 1000 + event.offset_ps,
               event.duration_ps)


def memory_events(logdir: str):
  """(start, "MemoryAllocation" or "MemoryDeallocation", {stat: value}) of the trace's allocator
  events (a BFC allocator's: tf_op, addr, allocation_bytes, ...)."""
  for plane in _space(logdir).planes:
    stat_names = plane.stat_metadata
    for line in plane.lines:
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        if name in ("MemoryAllocation", "MemoryDeallocation"):
          stats = {stat_names[s.metadata_id].name: stat_names[s.ref_value].name
                   if s.HasField("ref_value") else (s.str_value or s.int64_value or s.uint64_value)
                   for s in event.stats}
          yield line.timestamp_ns * 1000 + event.offset_ps, name, stats


def op_devices(graph):
  """{op name: device} of a graph's ops; an op placed by colocation (a gradient op) takes its
  group's device."""
  out = {}
  for op in graph.get_operations():
    device = op.device
    if not device:
      groups = [g.decode()[len("loc:@"):] for g in op.colocation_groups()]
      device = graph.get_operation_by_name(groups[0]).device if groups else ""
    out[op.name] = device
  return out


def op_of(name: str, known) -> str:
  """The op of `known` (a graph's op names) that an allocation's tf_op names: Grappler's
  rewrites name the op they came from ('x/ArithmeticOptimizer/ConvertPow__inner_Pow' came
  from 'x/Pow', 'ArithmeticOptimizer/FoldTransposeIntoMatMul_MatMul' from 'MatMul'); "" if
  none."""
  name = re.sub(r"[A-Za-z]+Optimizer/[A-Za-z]+_+(inner_)?", "", name)
  while name not in known and ("/" in name or "_" in name):
    name = name.split("/", 1)[1] if "/" in name else name.split("_", 1)[1]
  return name if name in known else ""


def run_child(script: str, args) -> dict:
  """Runs `python script args` with TensorFlow's BFC allocator on the CPU (its events in the
  trace) and returns the JSON object its last line prints."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=repo)
  proc = subprocess.run([sys.executable, os.path.abspath(script)] + list(args), env=env,
                        capture_output=True, text=True, check=False)
  if proc.returncode:
    raise SystemExit(f"{os.path.basename(script)} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])
