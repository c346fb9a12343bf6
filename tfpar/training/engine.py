"""The engines' old import path, kept for callers: they live in tfpar.engines now.

The one import upward from tfpar.training (docs/design.md, "Layers"); it
re-exports only, and tests/test_layering.py allows exactly this alias.
"""

from tfpar.engines.base import Engine, build_model  # pylint: disable=unused-import
from tfpar.engines.data_parallel import DataParallelEngine  # pylint: disable=unused-import
