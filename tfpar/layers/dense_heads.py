"""Dense prediction heads on a ViT's patch tokens: detection and segmentation.

Both read the G x G patch tokens [B, G*G, d] (row-major, as the patch
embedding lays them out) and predict per patch:

- `DetectionHead`: C class logits (a sigmoid heatmap) and 4 box distances
  (tfpar.vision.boxes says what they mean) -> [B, G, G, C + 4].
- `SegmentationHead`: the class logits of each of the patch's p x p pixels,
  rearranged to the image -> [B, S, S, C] (S = G p): a learned "pixel
  shuffle" upsampling, the linear decoder of Segmenter (Strudel et al., 2021)
  at full resolution.

Outputs are float32, for a stable loss under mixed precision.
"""

import math

import keras
from keras import ops

# Focal-loss prior (Lin et al., 2017): every class starts at probability 0.01,
# so the many background patches do not swamp the first steps.
PRIOR = 0.01


class DetectionHead(keras.layers.Layer):
  """LayerNorm -> Dense(d, gelu) -> Dense(C + 4) on every patch token.

  Args:
    num_classes: C.
    grid: G, patches per side.
    d_model: token width.
  """

  def __init__(self, *, num_classes, grid, d_model, **kwargs):
    super().__init__(**kwargs)
    self.num_classes, self.grid, self.d_model = num_classes, grid, d_model
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.ln = keras.layers.LayerNormalization(epsilon=1e-5, name="ln")
    self.hidden = keras.layers.Dense(d_model, activation="gelu", kernel_initializer=init,
                                     name="hidden")
    bias = [-math.log((1 - PRIOR) / PRIOR)] * num_classes + [1.0] * 4  # boxes start ~2 patches wide
    self.out = keras.layers.Dense(num_classes + 4, kernel_initializer=init,
                                  bias_initializer=keras.initializers.Constant(bias), name="out")

  def build(self, input_shape):
    self.ln.build(input_shape)
    self.hidden.build(input_shape)
    self.out.build((*input_shape[:-1], self.d_model))

  def call(self, tokens):
    y = ops.cast(self.out(self.hidden(self.ln(tokens))), "float32")  # [B, G*G, C + 4]
    return ops.reshape(y, (-1, self.grid, self.grid, self.num_classes + 4))

  def get_config(self):
    return {**super().get_config(), "num_classes": self.num_classes, "grid": self.grid,
            "d_model": self.d_model}


class SegmentationHead(keras.layers.Layer):
  """LayerNorm -> Dense(p * p * C) on every patch token, each patch's pixels put in place.

  Args:
    num_classes: C (background included).
    grid: G, patches per side.
    patch_size: p.
  """

  def __init__(self, *, num_classes, grid, patch_size, **kwargs):
    super().__init__(**kwargs)
    self.num_classes, self.grid, self.patch_size = num_classes, grid, patch_size
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.ln = keras.layers.LayerNormalization(epsilon=1e-5, name="ln")
    self.out = keras.layers.Dense(patch_size * patch_size * num_classes, kernel_initializer=init,
                                  name="out")

  def build(self, input_shape):
    self.ln.build(input_shape)
    self.out.build(input_shape)

  def call(self, tokens):
    g, p, c = self.grid, self.patch_size, self.num_classes
    y = ops.cast(self.out(self.ln(tokens)), "float32")  # [B, G*G, p*p*C]
    y = ops.reshape(y, (-1, g, g, p, p, c))  # [B, gy, gx, py, px, C]
    y = ops.transpose(y, (0, 1, 3, 2, 4, 5))  # [B, gy, py, gx, px, C]
    return ops.reshape(y, (-1, g * p, g * p, c))  # [B, S, S, C]

  def get_config(self):
    return {**super().get_config(), "num_classes": self.num_classes, "grid": self.grid,
            "patch_size": self.patch_size}
