"""How a ViT's variables split (tfpar.partitioning): tfpar.layers.Block's rules, the patch
projection, positions and class token before the blocks, and one of three heads after them.

One table holds the checkpoint names of every head; three tables, one per head (the
classifier, and tfpar.layers.dense_heads' detection and segmentation heads), give the
counts of the variables each task's model has.
"""

from typing import Dict

from tfpar.partitioning import (BLOCK_RULES, DROPOUT_RULES, Rule, Rules, Shape, block_shapes,
                                dense, final_norm_shapes, norm)


def embed_shapes(m) -> Dict[str, Shape]:
  """The patch projection (a P x P convolution), the positions, the class token."""
  d, p, cls = m.d_model, m.patch_size, m.pooling == "cls"
  shapes = {"patch_embed/kernel": (p, p, m.num_channels, d), "patch_embed/bias": (d,),
            "position_embedding": (m.num_patches + int(cls), d)}
  if cls:
    shapes["class_token"] = (d,)
  return shapes


def classifier_head_shapes(m) -> Dict[str, Shape]:
  """The classifier's head (--task=classify): final LayerNorm, then the classes."""
  d, c = m.d_model, m.num_classes
  return {**final_norm_shapes(m), "classifier/kernel": (d, c), "classifier/bias": (c,)}


def detection_head_shapes(m) -> Dict[str, Shape]:
  """The detection head (--task=detect): classes + 4 box offsets per patch."""
  d, c = m.d_model, m.num_classes
  return {"detection_head/ln/gamma": (d,), "detection_head/ln/beta": (d,),
          "detection_head/hidden/kernel": (d, d), "detection_head/hidden/bias": (d,),
          "detection_head/out/kernel": (d, c + 4), "detection_head/out/bias": (c + 4,)}


def segmentation_head_shapes(m) -> Dict[str, Shape]:
  """The segmentation head (--task=segment): P x P x classes per patch."""
  d, out = m.d_model, m.patch_size * m.patch_size * m.num_classes
  return {"segmentation_head/ln/gamma": (d,), "segmentation_head/ln/beta": (d,),
          "segmentation_head/out/kernel": (d, out), "segmentation_head/out/bias": (out,)}


TABLE = (
    *dense("patch_embed"),
    Rule(r"(position_embedding|class_token)", decay=True),
    *BLOCK_RULES,
    *norm("ln_f"),
    *dense("classifier"),
    *norm("(detection_head|segmentation_head)/ln"),
    *dense("(detection_head/(hidden|out)|segmentation_head/out)"),
    *DROPOUT_RULES,
)
RULES = Rules("vit", TABLE, block_shapes, embed_shapes, classifier_head_shapes)
DETECT = Rules("vit_detect", TABLE, block_shapes, embed_shapes, detection_head_shapes)
SEGMENT = Rules("vit_segment", TABLE, block_shapes, embed_shapes, segmentation_head_shapes)
