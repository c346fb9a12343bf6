"""Keras 3 layers of the transformer. None of them names a device or a strategy."""

from tfpar.layers.attention import SelfAttention
from tfpar.layers.block import Block, LlamaBlock, set_compute
from tfpar.layers.mlp import MLP, GatedMLP
from tfpar.layers.parallel import ColumnParallelDense, Placement, RowParallelDense, TensorParallel

__all__ = ["Block", "LlamaBlock", "SelfAttention", "MLP", "GatedMLP", "ColumnParallelDense",
           "RowParallelDense", "Placement", "TensorParallel", "set_compute"]
