"""The model protocol the engines rely on, and the base GPT and ViT share.

Pipeline parallelism (tfpar.parallel.pipeline) runs a model as three parts on
different devices, and tensor parallelism (tfpar.parallel.tensor) places each
block's shards:

  inputs -> embed(x, training) -> blocks[i](h, training) ... -> head(h) -> outputs

`build_embed()`, each `blocks[i].build(block_shape)` and `build_head()` create
the weights part by part (under the device scope the caller holds);
`build_all()` all at once. A block says how it is split (`tensor_shards`) and
takes its placement through `place()`. `rules` is the model family's
partitioning table (tfpar.partitioning), keyed by the variables' names inside
the model: checkpoints and byte counts read it. Nothing else of a model is
used by the engines, so a new family only has to satisfy `ParallelModel`.
"""

from typing import Protocol, Sequence, Tuple, runtime_checkable

import keras

from tfpar import partitioning
from tfpar.layers.parallel import Placement, whole_sequence


@runtime_checkable
class ParallelBlock(Protocol):
  """One block: built from the model's `block_shape`, its shards placed by `place`."""
  tensor_shards: int

  def place(self, placement: Placement) -> None: ...

  def build(self, input_shape) -> None: ...

  def __call__(self, h, training=False): ...


@runtime_checkable
class ParallelModel(Protocol):
  """What tfpar.parallel (pipeline, tensor placement) and the checkpoints use of a model."""
  name: str
  rules: partitioning.Rules
  blocks: Sequence[ParallelBlock]
  block_shape: Tuple
  head_reads_embed: bool  # The head reads the embedding's weights (a tied token table).

  def build_embed(self) -> None: ...

  def build_head(self) -> None: ...

  def build_all(self) -> None: ...

  def embed(self, inputs, training=False): ...

  def head(self, h): ...


class Transformer(keras.Model):
  """embed -> blocks -> head as one Keras model; a subclass gives the parts and `rules`."""

  rules: partitioning.Rules
  blocks: list
  block_shape: Tuple
  head_reads_embed = False

  def build_all(self):
    """Creates every weight now (under whatever device scope the caller holds)."""
    self.build_embed()
    for block in self.blocks:
      block.build(self.block_shape)
    self.build_head()
    self.built = True

  def call(self, inputs, training=False):
    h = self.embed(inputs, training=training)
    for block in self.blocks:
      h = block(h, training=training)
    return self.head(whole_sequence(h))  # Sequence-parallel blocks hand on slices.
