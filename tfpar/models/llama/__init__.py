"""The Llama family (Touvron et al. 2023): model.py, its rules, its keras-hub LlamaBackbone
conversion. TF-free here; the model is imported when one is built."""

from tfpar import families
from tfpar.models.llama import hub, rules

FAMILY = families.register(families.Family(
    name="llama", model="tfpar.models.llama.model:Llama", rules=rules.RULES, title="Llama",
    positions=("rotary",), grouped_query=True, hub=hub, norm_statistics=1, mlp_values=4))
