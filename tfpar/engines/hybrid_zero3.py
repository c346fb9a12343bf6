"""ZeRO-3 on the data-parallel dimension of a pipeline plan, on one host.

A D x K plan (--data_parallel=D, --pipeline_stages=K, T = 1) over one host's
devices, under --optimizer_sharding=zero3: each stage's weights, their
gradients and AdamW's m and v are cut by rows over that stage's D copies
(tfpar.parallel.zero3: template without storage, per-part all-gather, each
part recomputed in its backward, reduce-scatter as all-reduces of groups of
rows in turn, AdamW on rows, rows as checkpoint slices). Device (d, k) holds
shard d of the rows of every weight stage k owns (the embedding's on stage 0,
the head's on stage K-1) and runs those parts of copy d: a block's forward
gathers its weights from the D devices (., k), its backward gathers them again
and reduce-scatters the gradient there.

This is the data-parallel engine's zero3 (tfpar.engines.data_parallel) with
the D replicas being the plan's copies: a MirroredStrategy over the D
anchors (each copy's first device) runs one replica function per copy, and
Zero3's `Placement` puts each part of that copy on its stage's device
(activations cross stages as in tfpar.parallel.pipeline). The M micro-batches
run in GPipe's order (every forward, then every backward, under one tape);
the other schedules, tensor-parallel stages and stages across workers are
refused by tfpar.config.rules. Checkpoints: each process writes and restores
its copies' rows (`DataParallelEngine.checkpointer`), readable under any
plan. Sharded initialisation: each device makes its rows (Zero3.initialise).
"""

import keras
import numpy as np
import tensorflow as tf

from tfpar import strategies, tasks
from tfpar.config.schema import Config
from tfpar.engines.data_parallel import DataParallelEngine, _nbytes
from tfpar.layout import placement as plan_lib
from tfpar.parallel import zero3
from tfpar.training.optimizer import inner_optimizer


class HybridZero3Engine(DataParallelEngine):
  """zero3 over the D copies of a one-host pipeline plan (see the module docstring).

  Args:
    cfg: the run's config.
    strategy: the runner's (unused: the engine makes a MirroredStrategy over the plan's D
      anchors).
    data, sharding, task: as for tfpar.engines.base.Engine.
  """

  def __init__(self, cfg: Config, strategy, data, *, sharding: str = "data", task=None):
    del strategy
    task = task or tasks.make(cfg)
    self.plan = plan_lib.make_plan(cfg, strategies.compute_devices(cfg.dist.num_cpu_devices),
                                   family=task.family)
    self._embed_variables = []
    copies = tf.distribute.MirroredStrategy(
        self.plan.anchors, cross_device_ops=tf.distribute.ReductionToOneDevice())
    super().__init__(cfg, copies, data, sharding=sharding, task=task)
    if cfg.train.model_dir:
      print(f"tfpar: {self.plan.format()}", flush=True)
      self.plan.write(cfg.train.model_dir, measured=self.measured_bytes())

  def _template(self):
    """The task's model without storage, built as build_model builds it, noting which
    weights the embedding owns (their rows live on stage 0)."""
    cfg = self.cfg

    def build():
      keras.utils.set_random_seed(cfg.train.seed)
      model = self.task.build_model(tensor_shards=1, seed=cfg.train.seed)
      model.build_embed()
      self._embed_variables[:] = list(model.trainable_variables)
      for block in model.blocks:
        block.build(model.block_shape)
      model.build_head()
      model.built = True
      return model

    return zero3.build_template(build)

  def _zero3_placement(self) -> dict:
    """Each copy's parts on its plan row: embedding on stage 0, each block on its stage,
    the head on stage K-1; the micro-batches of the plan."""
    stage_of = {i: stage.index for stage in self.plan.stages for i in stage.blocks}
    rows = {plan_lib.device_key(row[0][0]): row for row in self.plan.devices}
    placements = []
    for device in self._local_devices:  # The strategy's replicas, in its order.
      row = rows[plan_lib.device_key(device)]
      placements.append(zero3.Placement(
          embed=row[0][0], blocks=[row[stage_of[b]][0] for b in range(len(stage_of))],
          head=row[-1][0]))
    return dict(placements=placements, embed_variables=self._embed_variables,
                microbatches=self.plan.microbatches)

  # --- bytes per device -------------------------------------------------------
  def measured_bytes(self) -> dict:
    """{device: {"parameters": bytes, "optimizer": bytes}} of the shards each device holds
    (its rows of weights; of m and v, and the mirrored step counter on each anchor)."""
    out = {plan_lib.device_key(d): {"parameters": 0, "optimizer": 0}
           for row in self.plan.devices for stage in row for d in stage}
    for replica, home in enumerate(self.zero.homes):
      for kind, part in (("w", "parameters"), ("m", "optimizer"), ("v", "optimizer")):
        for device, slot in zip(home, self.zero.slots[replica][kind]):
          out[plan_lib.device_key(device)][part] += int(np.prod(slot.shape)) * 4
    counter = _nbytes(inner_optimizer(self.optimizer).variables)
    for device in self._local_devices:
      out[plan_lib.device_key(device)]["optimizer"] += counter
    return out

  def predicted_memory(self):
    """Per device: the plan's shards (tfpar.layout.placement under zero3), what a zero3 step
    holds beside them (Zero3.step_bytes), and the plan's activations."""
    held, activations = self.plan.bytes_per_device(), self.plan.activation_bytes()
    step = self.zero.step_bytes()
    out = {}
    for device in self.memory_devices():
      key = plan_lib.device_key(device)
      out[device] = {"weights": held[key]["parameters"] + step["weights"],
                     "gradients": held[key]["parameters"] + step["gradients"],
                     "optimizer": held[key]["optimizer"], "activations": activations.get(key, 0)}
    return out

  def memory_devices(self):
    return [d for row in self.plan.devices for stage in row for d in stage]

  def write_files(self, model_dir: str) -> None:
    del model_dir  # plan.json is written at start-up (as ModelParallelEngine does).

  def bytes_report(self) -> str:
    return ""

  def describe(self) -> dict:
    p = self.plan
    per_device = {dev: f"params {plan_lib.kib(b['parameters'])} + "
                       f"optimizer {plan_lib.kib(b['optimizer'])}"
                  for dev, b in self.measured_bytes().items()}
    return {"strategy": type(self.strategy).__name__, "replicas": self.num_replicas,
            "plan": f"D={p.data_parallel} x K={p.pipeline_stages} x T=1, M={p.microbatches}, "
                    f"gpipe, xla {'per part' if self.cfg.train.jit_compile else 'off'}, "
                    f"optimizer {self.zero.mode}",
            "parameters": int(sum(np.prod(s) for s in self.zero.shapes)),
            "measured_bytes_per_device": per_device}
