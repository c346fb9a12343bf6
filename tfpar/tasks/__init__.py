"""Tasks: what is learned. One string (--task) -> one Task.

A task (tfpar.tasks.task.Task) holds everything the engines must not know:
the model, the loss and its global normaliser, the data, the held-out
metrics and the throughput unit. The engines (tfpar.training.engine,
tfpar.parallel.hybrid, tfpar.parallel.parameter_server), tfpar.parallel and
the loop only run what a task gives them.

The modules are imported on demand, so that the flags and the config (which
need only the names) stay free of TensorFlow.
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


def get(name: str):
  """The Task class of --task=name."""
  if name not in _MODULES:
    raise ValueError(f"unknown task {name!r}: use one of {', '.join(NAMES)}")
  return importlib.import_module(_MODULES[name]).TASK


def make(cfg):
  """The Task of a run's config (cfg.model.task)."""
  return get(cfg.model.task)(cfg)
