"""Tasks: what is learned. One string (--task) -> one Task, and its rules.

A task (tfpar.tasks.task.Task) holds everything the engines must not know:
the model, the loss and its global normaliser, the data, the held-out
metrics, the throughput unit and what tfpar.predict prints. The engines
(tfpar.training.engine, tfpar.parallel.hybrid,
tfpar.engines.parameter_server), tfpar.parallel and the loop only run what a
task gives them. Its TF-free half (tfpar.tasks.specs: validation, the
start-up line's words, the reader of --data) is `spec(name)`.

Nothing outside this package compares --task to a name (tests/test_config.py
scans for it): whatever differs by task is asked of the task. The modules
are imported on demand, so that the flags and the config (which need only
the names and the specs) stay free of TensorFlow.
"""

import importlib

# --task value -> module holding its Task subclass as `TASK`.
_MODULES = {
    "lm": "tfpar.tasks.lm",
    "classify": "tfpar.tasks.classify",
    "detect": "tfpar.tasks.detect",
    "segment": "tfpar.tasks.segment",
}
NAMES = tuple(_MODULES)


def _known(name: str) -> None:
  if name not in _MODULES:
    raise ValueError(f"unknown task {name!r}: use one of {', '.join(NAMES)}")


def get(name: str):
  """The Task class of --task=name."""
  _known(name)
  return importlib.import_module(_MODULES[name]).TASK


def spec(name: str):
  """The TF-free half of --task=name (a tfpar.tasks.specs.TaskSpec)."""
  _known(name)
  from tfpar.tasks import specs  # pylint: disable=import-outside-toplevel
  return specs.SPECS[name]


def make(cfg):
  """The Task of a run's config (cfg.model.task)."""
  return get(cfg.model.task)(cfg)
