"""Reading and writing keras-hub presets' weights (keras-hub itself does the files).

`load_weights(preset, m)`: the preset's backbone weights under tfpar's
canonical names, at tfpar's shapes (the family's hub.py, in its folder of
tfpar/models, says which is which). `save(m, weights, out, tokenizer)`: a CausalLM preset of those
weights with that keras-hub tokenizer (tfpar.tokenizer's `to_keras_hub`).
"""

import keras_hub
import numpy as np

from tfpar import families, hub


def _pairs(module, num_layers: int):
  """(canonical name, keras-hub path) of every weight."""
  for name, path in module.NAMES.items():
    for i in (range(num_layers) if "{i}" in name else [None]):
      yield name.format(i=i), path.format(i=i)


def load_weights(preset: str, m) -> dict:
  """{canonical name: array at tfpar's shape} of the preset's backbone (checked by hub.check)."""
  family, _ = hub.backbone_of(preset)
  module, rules = family.hub, family.rules
  try:
    model = keras_hub.models.Backbone.from_preset(preset)
  except (OSError, ValueError, KeyError) as e:  # h5py's "truncated file", a missing weight.
    raise hub.ConfigError(f"--init_from={preset}: keras-hub cannot read its weights "
                          f"({' '.join(str(e).split())[:200]}): restore its {hub.WEIGHTS} (what "
                          "save_to_preset writes), or start from another preset") from None
  by_path = {w.path: np.asarray(w.numpy()) for w in model.weights}
  shapes = {**rules.embed_shapes(m), **rules.head_shapes(m),
            **{f"block_{i}/{n}": s for i in range(m.num_layers)
               for n, s in rules.block_shapes(m).items()}}
  out = {}
  for name, path in _pairs(module, m.num_layers):
    value = by_path[path]
    if name == "wpe/embeddings":  # A preset's positions may outnumber --seq_len.
      value = value[:m.seq_len]
    out[name] = np.reshape(value, shapes[name])  # Heads axes folded: [d, H, D] -> [d, H D].
  return out


def _conversion(m):
  """The keras-hub conversion of m's family (its folder's hub.py), or ConfigError."""
  module = families.get(m.architecture).hub
  if module is None:
    raise hub.ConfigError(f"--architecture={m.architecture} has no keras-hub conversion (its "
                          "family registers no hub module): export a family that has one")
  return module


def backbone(m, weights: dict):
  """A keras-hub backbone of tfpar's model config m holding `weights` (canonical names)."""
  module = _conversion(m)
  model = getattr(keras_hub.models, module.CLASS)(**module.backbone_config(m))
  by_path = {w.path: w for w in model.weights}
  for name, path in _pairs(module, m.num_layers):
    target = by_path[path]
    target.assign(np.reshape(weights[name], target.shape))
  return model


def save(m, weights: dict, out: str, tokenizer) -> str:
  """Writes a keras-hub CausalLM preset of `weights` and `tokenizer` (a keras-hub tokenizer)
  to `out`; returns the CausalLM class it loads as."""
  model = backbone(m, weights)
  task, preprocessor = _conversion(m).CAUSAL_LM
  lm = getattr(keras_hub.models, task)(
      backbone=model, preprocessor=getattr(keras_hub.models, preprocessor)(tokenizer))
  lm.save_to_preset(out)
  return task
