"""The GPT family (GPT-2's shape, nanoGPT's habits): model.py, its rules, its keras-hub
GPT2Backbone conversion. TF-free here; the model is imported when one is built."""

from tfpar import families
from tfpar.models.gpt import hub, rules

FAMILY = families.register(families.Family(
    name="gpt", model="tfpar.models.gpt.model:GPT", rules=rules.RULES, title="GPT",
    positions=("learned", "rotary"), default=True, hub=hub, norm_statistics=3, mlp_values=5))
