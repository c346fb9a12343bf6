"""Models built from tfpar.layers."""

from tfpar.models.gpt import GPT
from tfpar.models.vit import ViT

__all__ = ["GPT", "ViT"]
