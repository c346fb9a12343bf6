"""The engines, and the one choice of engine for a config (`make`).

  stages on different workers, one program per worker             StageWorkerEngine
  a pipeline plan's copies under --optimizer_sharding=zero3          HybridZero3Engine
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
  if cfg.parallel.model_parallel and _stages_are_workers(cfg, strategy):
    from tfpar.engines.stage_worker import StageWorkerEngine  # pylint: disable=import-outside-toplevel
    return StageWorkerEngine(cfg, strategy, data, sharding=sharding, task=task)
  if cfg.parallel.model_parallel and cfg.parallel.optimizer_sharding == "zero3":
    from tfpar.engines.hybrid_zero3 import HybridZero3Engine  # pylint: disable=import-outside-toplevel
    return HybridZero3Engine(cfg, strategy, data, sharding=sharding, task=task)
  if cfg.parallel.model_parallel:
    from tfpar.engines.model_parallel import ModelParallelEngine  # pylint: disable=import-outside-toplevel
    return ModelParallelEngine(cfg, strategy, data, sharding=sharding, task=task)
  if cfg.dist.strategy == "parameter_server":
    from tfpar.engines.parameter_server.engine import ParameterServerEngine  # pylint: disable=import-outside-toplevel
    return ParameterServerEngine(cfg, strategy, data, task=task)
  from tfpar.engines.data_parallel import DataParallelEngine  # pylint: disable=import-outside-toplevel
  return DataParallelEngine(cfg, strategy, data, sharding=sharding, task=task)


def _stages_are_workers(cfg: Config, strategy) -> bool:
  """A multi-worker plan whose stages are on different workers, each worker its own program."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import strategies  # pylint: disable=import-outside-toplevel
  from tfpar.config import rules  # pylint: disable=import-outside-toplevel
  return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and
          rules.stages_across_workers(cfg, strategies.devices_per_worker(cfg)))


__all__ = ["make"]
