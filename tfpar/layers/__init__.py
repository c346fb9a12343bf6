"""Keras 3 layers of the transformer. None of them names a device or a strategy."""

from tfpar.layers.attention import SelfAttention
from tfpar.layers.block import Block
from tfpar.layers.mlp import MLP

__all__ = ["Block", "SelfAttention", "MLP"]
