"""ps_steps.jsonl: one record per asynchronous step, written by the chief.

Each record: the step (the optimizer counter after its update), the worker
that ran it, the counter it read the weights at (`read_version`) and the one
its update produced (`write_version`), its staleness
(`write_version - read_version - 1`: updates other workers applied in
between), its loss and gradient norm, and its start and end time on the worker.
"""

import os
from typing import Dict, Iterable

from tfpar import storage
from tfpar.training.metrics import to_json


class StepLog:
  """Appends step records to `<model_dir>/ps_steps.jsonl`."""

  def __init__(self, model_dir: str):
    self.path = os.path.join(model_dir, "ps_steps.jsonl")

  def write(self, records: Iterable[Dict]) -> None:
    """Appends through tf.io.gfile (gs:// works); a NaN loss is written as null."""
    storage.makedirs(os.path.dirname(self.path) or ".")
    storage.append_lines(self.path, [to_json(r) + "\n" for r in records])
