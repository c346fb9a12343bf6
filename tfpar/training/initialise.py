"""Sharded initialisation: any slice of any weight made on its own, equal to one device's.

A weight's initial value is defined over its CANONICAL coordinates (its name
and full shape in tfpar.training.checkpoint's layout), never over the shard a
device holds, so a device can make exactly its slice, and every plan (one
device, tensor shards, pipeline stages, ZeRO row shards) starts from the same
values, element for element.

Tiles. The full shape is cut into tiles of TILE x TILE over its last two axes
(one row of the leading axes at a time; a vector into runs of TILE). Tile i
of weight `name` is drawn by TensorFlow's stateless RNG with the key

    (seed * 2**32 + crc32(name), i)       (i: the tile's row-major index in the tile grid)

at the tile's own shape (clipped at the tensor's edge). A slice [begin, begin + size)
is assembled from the tiles it overlaps, each cut to the overlap; no other
tile is drawn, so making a slice costs its own size plus at most one tile's
border per axis.

Distributions follow the Keras initializer the layer asked for, with its
parameters: RandomNormal(mean, stddev), TruncatedNormal, RandomUniform,
VarianceScaling (Glorot, He, Lecun) with fans from the FULL shape (Keras's
compute_fans, as one device computes them), Zeros, Ones, Constant. Any other
initializer (Orthogonal) cannot be cut: it is drawn whole from a Keras
initializer seeded by the same key and sliced, which costs one full tensor
while it runs.

`recording()` notes the initializer of every Keras variable created inside it
(Keras keeps none once a variable holds its value); `initialise()` then
assigns each slice its canonical value.
"""

import contextlib
import math
import zlib
from typing import Dict, Iterable, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.initializers.random_initializers import compute_fans

TILE = 256


@contextlib.contextmanager
def recording():
  """Yields {id(variable): (variable, initializer)} of the Keras variables created inside."""
  seen: Dict[int, tuple] = {}
  original = keras_backend.Variable._initialize_with_initializer  # pylint: disable=protected-access

  def note(variable, initializer):
    seen[id(variable)] = (variable, initializer)
    original(variable, initializer)

  keras_backend.Variable._initialize_with_initializer = note  # pylint: disable=protected-access
  try:
    yield seen
  finally:
    keras_backend.Variable._initialize_with_initializer = original  # pylint: disable=protected-access


def _key(seed: int, name: str) -> int:
  return (int(seed) % 2**31) * 2**32 + zlib.crc32(name.encode())


def _tile_shape(shape: Sequence[int]) -> tuple:
  rank = len(shape)
  return tuple(TILE if axis >= rank - 2 else 1 for axis in range(rank))


def _sampler(initializer, shape: Sequence[int], dtype):
  """f(tile shape, stateless seed) -> the tile's values, for `initializer` of a `shape` weight;
  None where the initializer cannot be drawn by tiles."""
  kind = type(initializer)
  if isinstance(initializer, keras.initializers.Zeros):
    return lambda s, seed: tf.zeros(s, dtype)
  if isinstance(initializer, keras.initializers.Ones):
    return lambda s, seed: tf.ones(s, dtype)
  if isinstance(initializer, keras.initializers.Constant):
    if np.ndim(initializer.value):  # Values per element: made whole, then sliced.
      return None
    value = float(initializer.value)
    return lambda s, seed: tf.fill(s, tf.constant(value, dtype))
  if kind is keras.initializers.RandomNormal:
    mean, stddev = initializer.mean, initializer.stddev
    return lambda s, seed: tf.random.stateless_normal(s, seed, mean, stddev, dtype=dtype)
  if kind is keras.initializers.TruncatedNormal:
    mean, stddev = initializer.mean, initializer.stddev
    return lambda s, seed: tf.random.stateless_truncated_normal(s, seed, mean, stddev, dtype=dtype)
  if kind is keras.initializers.RandomUniform:
    low, high = initializer.minval, initializer.maxval
    return lambda s, seed: tf.random.stateless_uniform(s, seed, low, high, dtype=dtype)
  if isinstance(initializer, keras.initializers.VarianceScaling):
    fan_in, fan_out = compute_fans(tuple(shape))
    n = {"fan_in": fan_in, "fan_out": fan_out}.get(initializer.mode, (fan_in + fan_out) / 2)
    scale = initializer.scale / max(1.0, n)
    if initializer.distribution == "truncated_normal":
      stddev = math.sqrt(scale) / 0.87962566103423978
      return lambda s, seed: tf.random.stateless_truncated_normal(s, seed, 0.0, stddev, dtype=dtype)
    if initializer.distribution == "untruncated_normal":
      stddev = math.sqrt(scale)
      return lambda s, seed: tf.random.stateless_normal(s, seed, 0.0, stddev, dtype=dtype)
    limit = math.sqrt(3.0 * scale)
    return lambda s, seed: tf.random.stateless_uniform(s, seed, -limit, limit, dtype=dtype)
  return None


def slice_value(initializer, seed: int, name: str, shape: Sequence[int], begin: Sequence[int],
                size: Sequence[int], dtype=tf.float32) -> tf.Tensor:
  """Slice [begin, begin + size) of weight `name` (full `shape`) as `initializer` makes it."""
  shape, begin, size = tuple(shape), tuple(begin), tuple(size)
  dtype = tf.as_dtype(dtype)
  key = _key(seed, name)
  sample = _sampler(initializer, shape, dtype)
  if sample is None:  # Not cut into tiles: the whole tensor, from one keyed draw.
    config = initializer.get_config()
    config["seed"] = key % 2**31
    whole = type(initializer).from_config(config)(shape, dtype=dtype)
    return tf.slice(tf.convert_to_tensor(whole, dtype), begin, size)
  if not shape:
    return sample((), tf.constant([key, 0], tf.int64))
  tile = _tile_shape(shape)
  grid = [max(1, -(-n // t)) for n, t in zip(shape, tile)]

  def block(axis: int, index: tuple) -> tf.Tensor:
    if axis == len(shape):
      origin = [i * t for i, t in zip(index, tile)]
      extent = [min(t, n - o) for t, n, o in zip(tile, shape, origin)]
      values = sample(extent, tf.constant([key, np.ravel_multi_index(index, grid)], tf.int64))
      lo = [max(b, o) - o for b, o in zip(begin, origin)]
      hi = [min(b + s, o + e) - o for b, s, o, e in zip(begin, size, origin, extent)]
      return values[tuple(slice(a, b) for a, b in zip(lo, hi))]
    first, last = begin[axis] // tile[axis], (begin[axis] + size[axis] - 1) // tile[axis]
    parts = [block(axis + 1, index + (i,)) for i in range(first, last + 1)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis)

  if any(s == 0 for s in size):
    return tf.zeros(size, dtype)
  return block(0, ())


def initialise(slices: Iterable, seed: int, initializers: Dict[int, tuple]) -> int:
  """Assigns every slice (tfpar.training.checkpoint.Slice) of a recorded variable its canonical
  value, made on the variable's own device; returns how many it assigned."""
  done = 0
  for piece in slices:
    recorded = initializers.get(id(piece.variable))
    if recorded is None or not isinstance(recorded[1], keras.initializers.Initializer):
      continue  # Not a weight made by a Keras initializer (a dropout RNG's state).
    variable = piece.variable
    tf_var = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)
    with tf.device(getattr(tf_var, "device", None) or None):
      variable.assign(slice_value(recorded[1], seed, piece.name, piece.shape, piece.begin,
                                  piece.size, variable.dtype))
    done += 1
  return done
