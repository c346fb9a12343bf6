"""A Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

images [B, S, S, C] -> embed (non-overlapping P x P patches, each linearly
projected to d_model, plus a learned class token and learned positions)
-> num_layers x Block (the GPT's block, attention NOT causal: every patch sees
every patch) -> final LayerNorm -> pool (the class token, or the mean of the
patches) -> logits [B, num_classes].

Like the GPT, the parts are public (tfpar.models.base.ParallelModel) so that
tfpar.parallel runs them on different devices; the model never names a
device. How its variables split: tfpar/models/vit/rules.py. A task that needs
other outputs (per-patch logits for detection or segmentation) subclasses ViT
and replaces `build_head`/`head`.
"""

import keras
from keras import ops

from tfpar.config.schema import ModelConfig
from tfpar.layers import Block
from tfpar.layers.dropout import ReplicaDropout
from tfpar.models.base import Transformer
from tfpar.models.vit import rules as rules_lib


class ViT(Transformer):
  """Vision Transformer classifier.

  Args:
    config: a `tfpar.config.ModelConfig` (image_size, patch_size, num_channels,
      num_classes, pooling and the transformer shape).
    tensor_shards: split each block's attention and MLP in this many shards.
    seed: seeds dropout.

  Example:
    >>> model = ViT(ModelConfig(task="classify", image_size=8, patch_size=2, d_model=64))
    >>> logits = model(images)  # [B, 8, 8, 1] float -> [B, 10]
  """

  rules = rules_lib.RULES

  def __init__(self, config: ModelConfig, *, tensor_shards: int = 1, seed: int = 0, **kwargs):
    kwargs.setdefault("name", "vit")
    super().__init__(**kwargs)
    self.config = config
    d, p = config.d_model, config.patch_size
    self.num_patches = config.num_patches
    self.num_tokens = self.num_patches + (1 if config.pooling == "cls" else 0)
    # A P x P convolution with stride P is one linear map per patch (Glorot-initialised,
    # as in the ViT paper's code: N(0, 0.02) on a few pixels would start the stream near 0).
    self.patch_embedding = keras.layers.Conv2D(d, p, strides=p, name="patch_embed")
    self.embed_dropout = ReplicaDropout(config.dropout, seed=seed, name="drop")
    self.blocks = [
        Block(d_model=d, num_heads=config.num_heads, d_ff=config.d_ff, dropout=config.dropout,
              causal=False, tensor_shards=tensor_shards, seed=seed + 2 * (i + 1),
              name=f"block_{i}")
        for i in range(config.num_layers)]
    self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")
    self.classifier = keras.layers.Dense(config.num_classes, kernel_initializer="zeros",
                                         name="classifier")
    self.block_shape = (None, self.num_tokens, d)  # What each block is built for.

  def build_embed(self):
    c, d = self.config, self.config.d_model
    self.patch_embedding.build((None, c.image_size, c.image_size, c.num_channels))
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.position_embedding = self.add_weight(shape=(self.num_tokens, d), initializer=init,
                                              name="position_embedding")
    if c.pooling == "cls":
      self.class_token = self.add_weight(shape=(d,), initializer="zeros", name="class_token")

  def build_head(self):
    self.ln_f.build((None, self.config.d_model))
    self.classifier.build((None, self.config.d_model))

  def embed(self, images, training=False):
    """images [B, S, S, C] float -> tokens [B, N (+1), d_model] in the compute dtype."""
    h = self.patch_embedding(ops.cast(images, self.compute_dtype))  # [B, S/P, S/P, d]
    b = ops.shape(h)[0]
    h = ops.reshape(h, (b, self.num_patches, self.config.d_model))  # [B, N, d]
    if self.config.pooling == "cls":
      token = ops.cast(self.class_token, h.dtype)[None, None, :]  # [1, 1, d]
      h = ops.concatenate([ops.tile(token, (b, 1, 1)), h], axis=1)  # [B, N+1, d]
    h = h + ops.cast(self.position_embedding, h.dtype)[None]
    return self.embed_dropout(h, training=training)

  def head(self, h):
    """tokens [B, N (+1), d_model] -> logits [B, num_classes] in float32 (for a stable loss)."""
    pooled = h[:, 0] if self.config.pooling == "cls" else ops.mean(h, axis=1)  # [B, d]
    return ops.cast(self.classifier(self.ln_f(pooled)), "float32")


class DenseViT(ViT):
  """The ViT with its classifier replaced by a head over the patch tokens.

  Args:
    config: the ModelConfig.
    head: a Keras layer, patch tokens [B, G*G, d] -> outputs.
    rules: the ViT family with this head's shapes (tfpar.partitioning).
    tensor_shards, seed: as for ViT.
  """

  def __init__(self, config, *, head, rules, tensor_shards: int = 1, seed: int = 0, **kwargs):
    super().__init__(config, tensor_shards=tensor_shards, seed=seed, **kwargs)
    self.dense_head = head
    self.rules = rules

  def build_head(self):
    self.dense_head.build((None, self.num_patches, self.config.d_model))

  def head(self, h):
    """tokens [B, N (+1), d] -> the dense head's outputs (float32)."""
    if self.config.pooling == "cls":
      h = h[:, 1:]  # The class token: a dense head reads the patches only.
    return self.dense_head(h)
