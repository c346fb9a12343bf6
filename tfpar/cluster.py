"""Who am I in the job, and who are my peers: TF_CONFIG (local launcher, Kubeflow TFJob).

Read without importing TensorFlow, so the entry point can decide early (and
fail with one clear line) before TF starts.
"""

import dataclasses
import json
import os
from typing import Dict, List, Optional


class ClusterError(ValueError):
  """A TF_CONFIG that cannot work; the message says what to fix."""


class PeerError(RuntimeError):
  """A peer task stopped answering within its bound; the message names whom it waited for."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """This task's place in the job.

  Attributes:
    spec: job name -> addresses ({} for a single process).
    task_type: 'chief', 'worker', 'ps', 'evaluator', or None for a single process.
    task_index: index within task_type.
  """
  spec: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
  task_type: Optional[str] = None
  task_index: int = 0

  @property
  def num_workers(self) -> int:
    """Workers that compute (chief included when it trains, as in multi-worker mirrored)."""
    return max(1, len(self.spec.get("worker", [])) + len(self.spec.get("chief", [])))

  @property
  def worker_index(self) -> int:
    """Index among computing workers, the chief first."""
    if self.task_type == "worker":
      return self.task_index + len(self.spec.get("chief", []))
    return 0

  @property
  def is_chief(self) -> bool:
    """The chief task if there is one, else worker 0 (TF's convention)."""
    if self.task_type is None:
      return True
    if "chief" in self.spec:
      return self.task_type == "chief"
    return self.task_type == "worker" and self.task_index == 0


def from_env(environ=None) -> Cluster:
  """Parses TF_CONFIG (absent: a single process)."""
  environ = os.environ if environ is None else environ
  raw = environ.get("TF_CONFIG")
  if not raw:
    return Cluster()
  try:
    config = json.loads(raw)
    spec = {k: list(v) for k, v in config.get("cluster", {}).items()}
    task = config.get("task", {})
    task_type, task_index = task.get("type"), int(task.get("index", 0))
  except (ValueError, TypeError, AttributeError) as e:
    raise ClusterError(f"TF_CONFIG is not valid JSON of the form "
                       f'{{"cluster": {{...}}, "task": {{"type": ..., "index": ...}}}}: {e}') from None
  if not spec:
    return Cluster()
  if task_type not in spec:
    raise ClusterError(f"TF_CONFIG task type {task_type!r} is not in its cluster "
                       f"{sorted(spec)}: set task.type to one of them")
  if not 0 <= task_index < len(spec[task_type]):
    raise ClusterError(f"TF_CONFIG task index {task_index} is out of range for "
                       f"{len(spec[task_type])} {task_type} task(s)")
  return Cluster(spec=spec, task_type=task_type, task_index=task_index)
