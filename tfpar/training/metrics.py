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
from typing import Optional

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
    self.model_dir = model_dir
    self.path = os.path.join(model_dir, "metrics.jsonl")
    self._writers = {}  # TensorBoard's, made at the first record of their kind (not before:
    self._start = time.time()  # a run refused at restore must leave --model_dir as it was).
    self._tidied = False  # Torn lines set aside (drop_after, or the first write).

  def drop_after(self, step: int) -> None:
    """On resume: records past the restored step describe steps that will run again.

    They move to metrics.jsonl.superseded (nothing is deleted), so that
    metrics.jsonl logs every step exactly once. So does a line cut short (a
    pod killed mid-write leaves the file ending in half a record), with one
    warning: the next record starts on a line of its own.
    """
    self._tidy(step)

  def _tidy(self, after) -> None:
    """Moves lines that are not whole JSON records (and records past step `after`) aside."""
    self._tidied = True
    if not self.enabled or not storage.exists(self.path):
      return
    text = storage.read_text(self.path)
    keep, drop, torn = [], [], []
    for line in text.splitlines():
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        record_step = record.get("step", 0)
      except (ValueError, AttributeError):  # Cut short, or glued to a partial line.
        torn.append(line + "\n")
        continue
      (drop if after is not None and record_step > after else keep).append(line + "\n")
    if torn:
      self.say(f"warning: {self.path} held {len(torn)} line(s) cut short or not JSON (a write "
               f"interrupted): moved to {os.path.basename(self.path)}.superseded")
    if drop or torn:
      storage.append_lines(self.path + ".superseded", torn + drop)
    if drop or torn or (text and not text.endswith("\n")):  # A whole last record gets its newline.
      storage.write_atomically(self.path, "".join(keep))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    if not self._tidied:  # No drop_after in this process: never append to half a line.
      self._tidy(None)
    storage.append_lines(self.path, [to_json(record) + "\n"])
    if record["kind"] not in ("train", "eval"):
      return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    writer = self._writers.get(record["kind"])
    if writer is None:
      writer = self._writers[record["kind"]] = tf.summary.create_file_writer(
          os.path.join(self.model_dir, record["kind"]))
    with writer.as_default(step=record["step"]):
      for key, value in record.items():
        if key not in ("kind", "step") and isinstance(value, (int, float)):
          tf.summary.scalar(key, value)
    writer.flush()

  def progress(self, step: int, total: int, loss: float, rate: float, unit: str,
               step_time: float, extra: str = "", eta_step_time: Optional[float] = None) -> None:
    """One console line; `rate` is `unit`s per second (tokens -> 'tok/s', images -> 'img/s').

    The ETA comes from `eta_step_time`, the seconds per step after the first
    (compiling) call; None (only that call measured yet) prints 'ETA --'.
    """
    if not self.enabled:
      return
    eta = ("--" if eta_step_time is None
           else datetime.timedelta(seconds=int(eta_step_time * (total - step))))
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
