"""Model families by name: what --architecture (or a user's `tfpar.Family`) selects.

A family is one folder, tfpar/models/<name>/, whose `__init__` registers one
`Family`: its model class (imported only when a model is built, so that the
config checks and the planner stay free of TensorFlow), its partitioning
rules (tfpar.partitioning tables: checkpoint names, split axes, no-decay set,
bytes per device), and its keras-hub conversion where it has one. Every other
module asks this registry, by the family's name, for what differs between
families; none names one. A user registers a family of their own the same way
(`tfpar.register`), from their own file.

Pure Python, no TensorFlow.
"""

import dataclasses
import importlib
import pkgutil
from typing import Callable, Dict, Optional, Tuple, Union

from tfpar import partitioning

_FAMILIES: Dict[str, "Family"] = {}
_TABLES: Dict[str, partitioning.Rules] = {}
_LOADED = []  # True once tfpar/models/*/ have registered themselves.


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    name: what `architecture=` (--architecture) names it by; its rules' `family`.
    model: the Keras model class, or "module:Class" imported on first use. It is
      called as `model(model_config, tensor_shards=T, seed=S)` and satisfies
      tfpar.models.base.ParallelModel for pipeline and tensor plans.
    rules: its partitioning table (tfpar.partitioning.Rules, family == name).
    task: the task it is trained on ("lm": a language model, the only task whose
      model --architecture picks).
    title: what the start-up line calls the model ("GPT").
    positions: the --positions it computes, the first by default (empty: it has its own
      way, and ignores the setting).
    grouped_query: whether it takes --num_kv_heads below --num_heads.
    default: the family a task builds when --architecture is not passed.
    tables: other tables of the same variables: an image family's per-task heads, each
      named <name>_<task> ("vit_detect"), which --task=detect and segment look up.
    dense: an image family's model with a per-patch head in place of its classifier
      (--task=detect, segment), or "module:Class"; called as
      `dense(model_config, head=, rules=, tensor_shards=T, seed=S)`.
    hub: the keras-hub conversion module (CLASS, NAMES, FIXED, CAUSAL_LM,
      flags_of, backbone_config: tfpar.hub), or None.
    norm_statistics, mlp_values: what one block keeps for its backward per
      position, besides its matmuls' inputs (tfpar.layout.placement's activation
      model): per norm (LayerNorm 3, RMSNorm 1), and per MLP hidden unit and
      tensor shard (a GELU MLP 5, SwiGLU 4).
  """
  name: str
  model: Union[str, Callable]
  rules: partitioning.Rules
  task: str = "lm"
  title: str = ""
  positions: Tuple[str, ...] = ("learned", "rotary")
  grouped_query: bool = False
  default: bool = False
  tables: Tuple[partitioning.Rules, ...] = ()
  hub: Optional[object] = None
  dense: Union[str, Callable, None] = None
  norm_statistics: int = 3
  mlp_values: int = 5

  def __post_init__(self):
    if self.rules.family != self.name:
      raise ValueError(f"family {self.name!r}: its rules are named {self.rules.family!r}; "
                       f"name them {self.name!r}")

  def model_class(self):
    """The model class (imported now where `model` is a "module:Class" string)."""
    return _resolve(self.model)

  def dense_class(self):
    """The model class with a per-patch head (`dense`), imported now."""
    if self.dense is None:
      raise KeyError(f"model family {self.name!r} has no dense-head model for detect/segment")
    return _resolve(self.dense)

  def build(self, model_config, *, tensor_shards: int = 1, seed: int = 0):
    """A model of this family for `model_config` (a tfpar.Config's `model` section), holding
    the family's rules as `rules` where its class names none."""
    model = self.model_class()(model_config, tensor_shards=tensor_shards, seed=seed)
    if getattr(model, "rules", None) is None:
      model.rules = self.rules
    return model


def _resolve(target):
  """A class given as itself or as "module:Class"."""
  if not isinstance(target, str):
    return target
  module, _, attr = target.partition(":")
  return getattr(importlib.import_module(module), attr)


def _load_builtin() -> None:
  """Imports each folder of tfpar/models once: its `__init__` registers its family."""
  if _LOADED:
    return
  _LOADED.append(True)
  package = importlib.import_module("tfpar.models")
  for info in pkgutil.iter_modules(package.__path__):
    if info.ispkg:
      importlib.import_module(f"tfpar.models.{info.name}")


def register(family: Family) -> Family:
  """Adds (or replaces) a family and its tables; returns it."""
  _FAMILIES[family.name] = family
  for table in (family.rules, *family.tables):
    _TABLES[table.family] = table
  return family


def get(name: str) -> Family:
  """The family registered as `name`.

  Raises:
    KeyError: none is: the message lists those that are.
  """
  _load_builtin()
  if name not in _FAMILIES:
    raise KeyError(f"unknown model family {name!r}: registered are {', '.join(_FAMILIES)} "
                   "(tfpar.register adds one)")
  return _FAMILIES[name]


def names(task: Optional[str] = None) -> Tuple[str, ...]:
  """The registered families' names (those trained on `task`, where given)."""
  _load_builtin()
  return tuple(n for n, f in _FAMILIES.items() if task is None or f.task == task)


def default(task: str) -> str:
  """The family `task` builds when --architecture is not passed."""
  found = [n for n in names(task) if _FAMILIES[n].default]
  if not found:
    raise KeyError(f"no default model family for task {task!r}")
  return found[0]


def rules(table: str) -> partitioning.Rules:
  """A partitioning table by name: a family's own, or one of its `tables`."""
  _load_builtin()
  if table not in _TABLES:
    raise KeyError(f"unknown partitioning table {table!r}: registered are "
                   f"{', '.join(_TABLES)} (tfpar.register adds a family's)")
  return _TABLES[table]


def all_rules() -> Tuple[partitioning.Rules, ...]:
  """Every registered table (the optimizer's no-decay names cover them all)."""
  _load_builtin()
  return tuple(_TABLES.values())


def with_hub() -> Tuple[Family, ...]:
  """The families with a keras-hub conversion."""
  _load_builtin()
  return tuple(f for f in _FAMILIES.values() if f.hub is not None)
