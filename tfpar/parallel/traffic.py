"""Byte accounting of the gradient exchange: what one replica hands to the collectives.

Per replica per step, counted at trace time from the tensors actually passed
to the collectives (tfpar.parallel.exchange records them), and predicted here
for float32 gradients of given shapes; a ring all-reduce puts 2 (R-1)/R times
that on each link:

    none:     sum_t 4 |t|
    bf16:     sum_t 2 |t|
    fp16:     sum_t 2 |t| + 4 T                (T tensors: the MAX of the scales)
    powersgd: sum_{compressed m x n} 4 (m + n) R + sum_{others} 4 |t|

(the codecs are in tfpar.parallel.compression).
"""

import dataclasses
from typing import Optional, Sequence

import numpy as np

from tfpar.config.schema import CompressionConfig


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes one replica hands to the collectives in one step."""
  bytes: int
  uncompressed: int


NONE = Traffic(0, 0)


def nbytes(tensors) -> int:
  """Bytes of these tensors (static shapes)."""
  return sum(int(np.prod(t.shape)) * t.dtype.size for t in tensors)


def matrix_shape(shape) -> Optional[tuple]:
  """The 2-D view PowerSGD compresses: [shape[0], prod(shape[1:])], or None for vectors."""
  shape = [int(d) for d in shape]
  if len(shape) < 2:
    return None
  return shape[0], int(np.prod(shape[1:]))


def powersgd_compresses(shape, rank: int, min_size: int) -> bool:
  """Whether PowerSGD sends this tensor as P, Q (it must be a matrix, big enough, and shrink)."""
  mn = matrix_shape(shape)
  if mn is None:
    return False
  m, n = mn
  return m * n >= min_size and (m + n) * rank < m * n


def expected_bytes(shapes: Sequence, compression: CompressionConfig) -> int:
  """The bytes formula of the module docstring, for float32 gradients of these shapes."""
  sizes = [int(np.prod(s)) for s in shapes]
  method = compression.method
  if method == "none":
    return 4 * sum(sizes)
  if method == "bf16":
    return 2 * sum(sizes)
  if method == "fp16":
    return 2 * sum(sizes) + 4 * len(sizes)
  total = 0
  for shape, size in zip(shapes, sizes):
    if powersgd_compresses(shape, compression.rank, compression.min_size):
      m, n = matrix_shape(shape)
      total += 4 * (m + n) * compression.rank
    else:
      total += 4 * size
  return total
