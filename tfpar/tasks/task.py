"""The task seam: what an engine asks of the thing being learned.

An engine builds a task's model (whole, or piece by piece on the devices of a
parallel plan), feeds it the task's batches and minimises the task's loss;
the loop logs the task's held-out metrics and throughput. No engine, nothing
in tfpar.parallel and not the loop imports a model, a loss or a reader.

The model a task builds has the three parts pipeline parallelism splits:

  inputs -> model.embed(x, training) -> model.blocks[i](h, training) ... -> model.head(h) -> outputs

with `build_embed()`, `build_head()`, `build_all()` creating the weights (each
block is built from `model.block_shape`) and `model(x, training)` the whole.

Loss normalisation, the one rule every task keeps: `loss(outputs, targets)`
is this replica's (or micro-batch's) SUM of per-example losses divided by
`global_count`, the number of labelled units in the GLOBAL batch (tokens for
the language model, images for classification, pixels for segmentation).
Gradients are summed, not averaged, across replicas and micro-batches, so
the sum of the parts is the mean over the global batch: the number one device
computes. `cross_entropy` below does this for labels that are class ids.
"""

from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from tfpar import families
from tfpar.layers import set_compute


def cross_entropy(logits, labels, global_count: int):
  """Softmax cross-entropy summed over every label here / labels in the GLOBAL batch.

  Args:
    logits: [..., num_classes] (any float dtype; computed in float32).
    labels: int [...], the same leading shape.
    global_count: labels in the global batch (see the module docstring).
  """
  ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.cast(logits, tf.float32))
  return tf.reduce_sum(ce) / tf.cast(global_count, tf.float32)


class Task:
  """Base class of a task; a subclass fills in every method that raises here.

  Args:
    cfg: the run's tfpar.config.Config.

  Attributes:
    unit: what throughput counts; the loop logs `<unit>_per_sec` ("tokens", "images").
    family: the model family `build_model` builds: its tfpar.partitioning rules.
    units_per_step: units in one global batch (throughput = units_per_step / step time).
    global_count: the loss normaliser (see the module docstring).
  """

  unit = "examples"
  def __init__(self, cfg):
    self.cfg = cfg

  @classmethod
  def family_of(cls, model_config) -> str:
    """The partitioning table (tfpar.families) of the model this task builds for
    `model_config`, before any Task exists (the plan)."""
    raise NotImplementedError

  @property
  def family(self) -> str:
    return self.family_of(self.cfg.model)

  @property
  def units_per_step(self) -> int:
    raise NotImplementedError

  @property
  def global_count(self) -> int:
    raise NotImplementedError

  # --- model --------------------------------------------------------------------
  def build_model(self, *, tensor_shards: int = 1, seed: int = 0):
    """The Keras model (weights not created yet; see the module docstring for its parts)."""
    raise NotImplementedError

  def computing(self, model):
    """`model`, its layers set to compute as --fused_projections and --causal_attention say."""
    t = self.cfg.train
    set_compute(model, fused_projections=t.fused_projections, causal_attention=t.causal_attention)
    return model

  def embed_head_params(self, model_config) -> Tuple[int, int]:
    """(parameters of the embedding part, of the head part), from the config alone:
    the shapes and rules of the task's family (tfpar.partitioning), as the plan counts."""
    return families.rules(self.family).embed_head_counts(model_config)

  # --- data ---------------------------------------------------------------------
  def load_data(self, *, worker_index: int = 0, num_workers: int = 1):
    """(data, sharding): what this worker reads, as `data.train` and `data.eval`.

    `sharding` is 'data' (each worker reads its slice of every global batch)
    or 'file' (each worker reads the batches of its own files).
    """
    raise NotImplementedError

  def describe_data(self, data) -> str:
    """One line for the start-up log."""
    raise NotImplementedError

  def class_names(self, data) -> Tuple[str, ...]:
    """The classes' names in id order, where the data has them (class folders); else ().

    Recorded in config.json, so that tfpar.predict prints names, not indices.
    """
    del data
    return ()

  def dataset(self, split, shard, *, start_step: int = 0, shuffle: bool = True,
              inputs: bool = True) -> tf.data.Dataset:
    """Endless per-replica batches (inputs, targets) of `split` (data.train or data.eval).

    Without `inputs` the batches' inputs may be zeros of their shape, not read (what a
    pipeline's last stage on a worker of its own needs: the targets).

    `shard` (tfpar.data.pipeline.Shard) says which slice of each global batch
    this pipeline produces; the order is a pure function of (seed, step), so
    a run resumes at `start_step` with nothing replayed.
    """
    raise NotImplementedError

  # --- loss and metrics ------------------------------------------------------------
  def loss(self, outputs, targets):
    """This replica's share of the global mean loss (see the module docstring)."""
    raise NotImplementedError

  def eval_outputs(self, outputs, targets) -> Dict[str, tf.Tensor]:
    """What one held-out batch contributes. Scalars are SUMMED over replicas
    and micro-batches (so they are shares, as `loss` is, or counts); tensors of
    rank >= 1 are concatenated along axis 0 (per-example results)."""
    return {"loss": self.loss(outputs, targets)}

  def eval_metrics(self, batches: List[Dict[str, np.ndarray]]) -> Dict[str, float]:
    """The eval record's metrics from every held-out batch's (reduced) eval_outputs."""
    return {"loss": float(np.mean([b["loss"] for b in batches]))}

  # --- inference (tfpar.predict) ----------------------------------------------------
  writes_predictions = False  # Whether `predict` writes files (tfpar.predict makes the folder).

  def predict(self, outputs, images, *, score_threshold: float) -> None:
    """Reads one batch's model outputs: appends each image's lines to print, and draws
    on its `drawing` where there is one (`images`: tfpar.tasks.prediction.Prediction)."""
    raise NotImplementedError(f"--task={self.cfg.model.task} has no tfpar.predict")
