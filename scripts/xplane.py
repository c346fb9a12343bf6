"""The events of a tf.profiler trace: the newest `*.xplane.pb` under a log directory.

Read through tf.io.gfile, so a trace on gs:// or another TensorFlow
filesystem reads the same; used by scripts/step_profile.py and
scripts/dp_profile.py.
"""

import os


def events(logdir: str):
  """(name, start, duration) of every event of every plane; times in picoseconds."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  traces = tf.io.gfile.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
  if not traces:
    raise FileNotFoundError(f"no tf.profiler trace under {logdir}/plugins/profile")
  space = xplane_pb2.XSpace()
  with tf.io.gfile.GFile(sorted(traces)[-1], "rb") as f:
    space.ParseFromString(f.read())
  for plane in space.planes:
    names = plane.event_metadata
    for line in plane.lines:
      for event in line.events:
        yield (names[event.metadata_id].name, line.timestamp_ns * 1000 + event.offset_ps,
               event.duration_ps)
