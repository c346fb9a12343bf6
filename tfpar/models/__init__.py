"""Models built from tfpar.layers."""

from tfpar.models.gpt import GPT

__all__ = ["GPT"]
