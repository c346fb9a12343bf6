"""The ViT family (Dosovitskiy et al. 2021): model.py (ViT, the classifier, and DenseViT, its
per-patch head for detect and segment) and its rules, one table per head. TF-free here; the
model is imported when built."""

from tfpar import families
from tfpar.models.vit import rules

FAMILY = families.register(families.Family(
    name="vit", model="tfpar.models.vit.model:ViT", rules=rules.RULES, task="classify",
    title="ViT", positions=("learned",), default=True, tables=(rules.DETECT, rules.SEGMENT),
    dense="tfpar.models.vit.model:DenseViT"))
