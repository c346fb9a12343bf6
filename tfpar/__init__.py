"""tfpar: train transformers on many devices, from the command line or from Python.

    import tfpar
    cfg = tfpar.make_config(num_layers=2, d_model=64, num_heads=4, train_steps=50,
                            model_dir="runs/mine")
    tfpar.Trainer(cfg).fit()

A model of your own: a Keras model built from tfpar's layers, its partitioning
rules as data, registered as a `tfpar.Family` (examples/, docs/api.md).

Every public name is listed in `__all__` and imported on first use, so that
`import tfpar` imports no TensorFlow: the Trainer splits the host's devices
before TensorFlow's runtime starts.
"""

import importlib

# Public name -> the module that defines it.
_PUBLIC = {
    # Settings and training (tfpar.trainer; the settings are tfpar.config.schema's).
    "Config": "tfpar.config.schema",
    "ConfigError": "tfpar.config.schema",
    "make_config": "tfpar.trainer",
    "Trainer": "tfpar.trainer",
    "fit": "tfpar.trainer",  # Not "train": that is the command's module, tfpar.train.
    # Model families (tfpar.families) and their partitioning rules (tfpar.partitioning).
    "Family": "tfpar.families",
    "register": "tfpar.families",
    "Rule": "tfpar.partitioning",
    "Rules": "tfpar.partitioning",
    "COLUMN": "tfpar.partitioning",
    "ROW": "tfpar.partitioning",
    "VOCAB": "tfpar.partitioning",
    "REPLICATED": "tfpar.partitioning",
    # What a model is made of (Keras 3; these import TensorFlow).
    "Transformer": "tfpar.models.base",
    "ParallelModel": "tfpar.models.base",
    "ColumnParallelDense": "tfpar.layers",
    "RowParallelDense": "tfpar.layers",
    "TensorParallel": "tfpar.layers",
    "SelfAttention": "tfpar.layers",
    "MLP": "tfpar.layers",
    "GatedMLP": "tfpar.layers",
}

__all__ = list(_PUBLIC)


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'tfpar' has no attribute {name!r}")
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(list(globals()) + __all__)
