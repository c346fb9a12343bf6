"""The model-parallel engine's old import path, kept for callers: tfpar.engines.model_parallel.

The one import upward from tfpar.parallel (docs/design.md, "Layers"); it
re-exports only, and tests/test_layering.py allows exactly this alias.
"""

from tfpar.engines.model_parallel import (ModelCopy, ModelParallelEngine,  # pylint: disable=unused-import
                                          measured_bytes)
