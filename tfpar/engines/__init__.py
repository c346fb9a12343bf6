"""The engines, and the one choice of engine for a config (`make`).

  model-parallel plan (--pipeline_stages or --tensor_parallel > 1)  ModelParallelEngine
  --strategy=parameter_server (the chief)                         ParameterServerEngine
  every other strategy                                            DataParallelEngine

tfpar.runner and scripts/bench.py both build their engine here. The core the
three share is tfpar.engines.base.
"""

from tfpar.config.schema import Config
from tfpar.engines.base import Engine


def make(cfg: Config, strategy, data, *, sharding: str = "data", task=None) -> Engine:
  """The engine cfg's plan and strategy call for, training `task` (default: cfg's) on `data`."""
  # Each engine module imports its own machinery (pipelines, ps patches) only when chosen.
  if cfg.parallel.model_parallel:
    from tfpar.engines.model_parallel import ModelParallelEngine  # pylint: disable=import-outside-toplevel
    return ModelParallelEngine(cfg, strategy, data, sharding=sharding, task=task)
  if cfg.dist.strategy == "parameter_server":
    from tfpar.engines.parameter_server.engine import ParameterServerEngine  # pylint: disable=import-outside-toplevel
    return ParameterServerEngine(cfg, strategy, data, task=task)
  from tfpar.engines.data_parallel import DataParallelEngine  # pylint: disable=import-outside-toplevel
  return DataParallelEngine(cfg, strategy, data, sharding=sharding, task=task)


__all__ = ["make"]
