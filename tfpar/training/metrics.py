"""Where a run reports: metrics.jsonl, TensorBoard summaries, and a console line.

Only the chief writes. `metrics.jsonl` holds one JSON object per line:
  {"kind": "train", "step", "loss", "learning_rate", "<unit>_per_sec", "step_time", ...}
  {"kind": "eval", "step", "loss", <the task's held-out metrics>}
where <unit> is the task's throughput unit (tokens_per_sec, images_per_sec) and the
held-out metrics are, e.g., "perplexity" (--task=lm) or "accuracy" (--task=classify).
A number that is not finite (a NaN or infinite loss) is written as `null`, so
that every line stays JSON that any parser reads; the console says "nan".
Every file goes through tf.io.gfile (tfpar.storage): a gs:// model dir works.
"""

import datetime
import json
import math
import os
import sys
import time

from tfpar import storage


_SHORT = {"tokens": "tok", "images": "img"}  # Units as the console line writes them.


class MetricsWriter:
  """Appends records to metrics.jsonl and TensorBoard; prints progress lines.

  Args:
    model_dir: the run directory.
    enabled: False on non-chief workers (everything becomes a no-op).
  """

  def __init__(self, model_dir: str, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(model_dir, "metrics.jsonl")
    self._writers = {}
    self._start = time.time()
    if enabled:
      import tensorflow as tf  # pylint: disable=import-outside-toplevel
      self._tf = tf
      for kind in ("train", "eval"):
        self._writers[kind] = tf.summary.create_file_writer(os.path.join(model_dir, kind))

  def drop_after(self, step: int) -> None:
    """On resume: records past the restored step describe steps that will run again.

    They move to metrics.superseded.jsonl (nothing is deleted), so that
    metrics.jsonl logs every step exactly once.
    """
    if not self.enabled or not storage.exists(self.path):
      return
    lines = [line + "\n" for line in storage.read_text(self.path).splitlines() if line.strip()]
    keep, drop = [], []
    for line in lines:
      try:
        (drop if json.loads(line).get("step", 0) > step else keep).append(line)
      except ValueError:
        keep.append(line)
    if drop:
      storage.append_lines(self.path + ".superseded", drop)
      storage.write_atomically(self.path, "".join(keep))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    storage.append_lines(self.path, [to_json(record) + "\n"])
    writer = self._writers.get(record["kind"])
    if writer is not None:
      with writer.as_default(step=record["step"]):
        for key, value in record.items():
          if key not in ("kind", "step") and isinstance(value, (int, float)):
            self._tf.summary.scalar(key, value)
      writer.flush()

  def progress(self, step: int, total: int, loss: float, rate: float, unit: str,
               step_time: float, extra: str = "") -> None:
    """One console line; `rate` is `unit`s per second (tokens -> 'tok/s', images -> 'img/s')."""
    if not self.enabled:
      return
    eta = datetime.timedelta(seconds=int(step_time * (total - step)))
    unit = _SHORT.get(unit, unit)
    line = (f"step {step:>6}/{total} | loss {loss:.4f} | {rate:>9,.0f} {unit}/s | "
            f"{step_time * 1000:7.1f} ms/step | ETA {eta}{extra}")
    print(line, flush=True)

  def say(self, text: str) -> None:
    if self.enabled:
      print(text, file=sys.stdout, flush=True)


def to_json(record: dict) -> str:
  """One JSON line; NaN and infinities become null (json.dumps would write bare NaN)."""
  clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
           for k, v in record.items()}
  return json.dumps(clean, allow_nan=False)


def perplexity(loss: float) -> float:
  return math.exp(min(loss, 50.0))
