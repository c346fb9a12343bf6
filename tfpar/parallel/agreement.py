"""Every task of a job trains on the chief's config, or none does.

Two pods started with different arguments (a rolled-out flag change that
reached one of them, a hand-edited command) would otherwise train together
on a mixed config: the collectives only agree on tensor shapes, and not even
on those until the first step fails in gRPC. So, once the strategy has
connected the tasks and before any variable exists, each task publishes its
validated config (as settings: flag name -> value) in TensorFlow's
coordination service, a key-value store every task of a multi-worker job
reaches (`context.set_config_key_value`), and reads every other task's. Each
task compares the same list in the same order, so on a mismatch every task
raises the same one line, naming the first task that differs from the chief
and its first differing flag.
"""

import json
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.config.schema import Config, ConfigError, settings

_KEY = "tfpar/config/{}/{}"


def flag_values(cfg: Config) -> Dict[str, object]:
  """{flag name: value} of every setting of `cfg`, in the schema's order (JSON-safe)."""
  return {s.flag: json.loads(json.dumps(getattr(getattr(cfg, s.section), s.field.name)))
          for s in settings()}


def first_difference(tasks: Sequence[Tuple[str, Dict[str, object]]]) -> Optional[str]:
  """The one line for the first (task, flag) whose value differs from the first task's, or None.

  `tasks`: (name, flag_values) pairs, the chief first.
  """
  (chief, want), *others = tasks
  for name, got in others:
    for flag, value in want.items():
      if got.get(flag) != value:
        return (f"{name} was started with --{flag}={_show(got.get(flag))} but {chief} with "
                f"--{flag}={_show(value)}: every task of a job must run the same flags; start "
                "them all with the same command line (or flagfile)")
  return None


def _show(value) -> str:
  if isinstance(value, list):
    return ",".join(str(v) for v in value)
  return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check(cfg: Config, task_names: List[Tuple[str, int]], own: Tuple[str, int],
          timeout_s: int) -> None:
  """Publishes this task's config and compares every task's against the chief's (task_names[0]).

  Call once the strategy has started the coordination service (a
  MultiWorkerMirroredStrategy made), before building the model. Blocks until
  every task has published (at most `timeout_s` each). Raises ConfigError on a
  mismatch, the same line in every task.
  """
  from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
  ctx = context.context()
  if ctx.coordination_service is None:  # A single process: nothing to agree with.
    return
  ctx.set_config_key_value(_KEY.format(*own), json.dumps(flag_values(cfg)))
  tasks = []
  for job, index in task_names:
    raw = ctx.get_config_key_value(_KEY.format(job, index), timeout_in_ms=timeout_s * 1000)
    tasks.append((f"{job} {index}", json.loads(raw)))
  # Every task has read every config before any leaves: the chief's process holds the service.
  ctx.wait_at_barrier("tfpar/config", timeout_in_ms=timeout_s * 1000)
  line = first_difference(tasks)
  if line:
    raise ConfigError(line)
