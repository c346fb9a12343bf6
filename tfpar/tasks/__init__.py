"""Tasks: what is learned. One string (--task) -> one Task, and its rules.

A task (tfpar.tasks.task.Task) holds everything the engines must not know:
the model, the loss and its global normaliser, the data, the held-out
metrics, the throughput unit and what tfpar.predict prints. The engines
(tfpar.engines.data_parallel, tfpar.engines.model_parallel,
tfpar.engines.parameter_server), tfpar.parallel and the loop only run what a
task gives them. Its TF-free half (tfpar.tasks.specs: validation, the
start-up line's words, the reader of --data) is `spec(name)`.

Nothing outside this package compares --task to a name (tests/test_config.py
scans for it): whatever differs by task is asked of the task. The modules
are imported on demand, so that the flags and the config (which need only
the names and the specs) stay free of TensorFlow.
"""

import importlib

from tfpar.config.schema import TASKS

NAMES = TASKS  # --task value NAME -> tfpar.tasks.NAME, holding its Task subclass as `TASK`.


def _known(name: str) -> None:
  if name not in NAMES:
    raise ValueError(f"unknown task {name!r}: use one of {', '.join(NAMES)}")


def get(name: str):
  """The Task class of --task=name."""
  _known(name)
  return importlib.import_module(f"tfpar.tasks.{name}").TASK


def spec(name: str):
  """The TF-free half of --task=name (a tfpar.tasks.specs.TaskSpec)."""
  _known(name)
  from tfpar.tasks import specs  # pylint: disable=import-outside-toplevel
  return specs.SPECS[name]


def make(cfg):
  """The Task of a run's config (cfg.model.task)."""
  return get(cfg.model.task)(cfg)
