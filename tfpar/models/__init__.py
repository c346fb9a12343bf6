"""Models built from tfpar.layers (GPT, Llama, ViT), and the protocol the engines use of them (tfpar.models.base)."""

from tfpar.models.base import ParallelBlock, ParallelModel, Transformer
from tfpar.models.gpt import GPT
from tfpar.models.llama import Llama
from tfpar.models.vit import ViT

__all__ = ["GPT", "Llama", "ViT", "ParallelBlock", "ParallelModel", "Transformer"]
