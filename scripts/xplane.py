"""The events of a tf.profiler trace: the newest `*.xplane.pb` under a log directory.

Read through tf.io.gfile, so a trace on gs:// or another TensorFlow
filesystem reads the same; used by scripts/step_profile.py,
scripts/dp_profile.py and (its allocator events) scripts/pipeline_memory.py.
"""

import os


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
