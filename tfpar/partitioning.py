"""Partitioning rules as data: how each model family's variables split over tensor shards.

One ordered table per model family (in the spirit of t5x / MaxText logical-axis
rules and keras-hub layout maps) maps each variable's canonical name (its path
inside the model, e.g. `block_3/attn/query/kernel`) to

  split   COLUMN      split along the LAST axis: a column-parallel Dense's kernel
                      [d_in, d_out] by output columns, its bias [d_out] with it;
                      shard t computes its columns alone (y_t = x W[:, t] + b[t]).
          ROW         split along the FIRST axis: a row-parallel Dense's kernel
                      [d_in, d_out] by input rows; shard t multiplies its slice of the
                      input, and the T partial outputs SUM to the whole x W.
          VOCAB       a table over the vocabulary (the tied token embedding): whole on
                      the stage's first device in tfpar, split by rows only in the
                      planner's Megatron layout (vocabulary parallelism).
          REPLICATED  whole, on the stage's first device (LayerNorms, output biases,
                      embeddings, heads).
  decay   whether AdamW's decoupled weight decay applies (matrices and embeddings
          yes; biases and LayerNorm scales no: GPT-2 / nanoGPT practice).

and declares, from the ModelConfig, the shapes of one block and of the
embedding and head parts, from which `shard_counts` counts parameters per
shard (the plan's bytes per device, the planner's stages, with the Megatron
layout's vocabulary-parallel table) and the planner counts FLOPs (2 s per
weight of a matrix per sequence, plus attention's 4 s^2 h).

Everything reads these tables: checkpoint canonical names and the gather /
split axis (tfpar.training.checkpoint), parameter and optimizer bytes per
device (tfpar.layout.placement), the no-decay set (tfpar.training.optimizer),
FLOPs (tfpar.planner.cost). Each family's table and shapes functions live in
its folder (tfpar/models/<family>/rules.py) and are registered with it
(tfpar.families); this module holds the machinery and the rules of
tfpar.layers' own parts (tfpar.layers.Block) that tables share. Patterns are full
matches and a family's patterns are disjoint, so each variable has exactly one
rule (the unit tests check it against every model's real variables).

Pure Python (no TensorFlow): the planner and the config checks import it.
"""

import dataclasses
import math
import re
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
SPLITS = (COLUMN, ROW, VOCAB, REPLICATED)

Shape = Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
  """Variables whose canonical name fully matches `pattern` split as `split`; `decay` or not."""
  pattern: str
  split: str = REPLICATED
  decay: bool = False

  def __post_init__(self):
    if self.split not in SPLITS:
      raise ValueError(f"rule {self.pattern!r}: split {self.split!r} is not one of {SPLITS}")

  def matches(self, name: str) -> bool:
    return re.fullmatch(self.pattern, name) is not None


def shard_axis(split: str, rank: int) -> Optional[int]:
  """The axis a variable of this split and rank is cut along over tensor shards (None: whole)."""
  return {COLUMN: rank - 1, ROW: 0}.get(split) if rank else None


@dataclasses.dataclass(frozen=True)
class Rules:
  """One model family's table.

  Attributes:
    family: its name (what a task's `family` and a model's `rules` refer to).
    rules: the ordered, disjoint rules.
    block_shapes: ModelConfig -> {name inside a block: full shape} of one block.
    embed_shapes: ModelConfig -> {canonical name: full shape} of the embedding part
      (the variables before the first block: stage 0, the first device).
    head_shapes: ModelConfig -> {canonical name: full shape} of the head part (after
      the last block: stage K-1, the first device).
  """
  family: str
  rules: Tuple[Rule, ...]
  block_shapes: Callable[[object], Dict[str, Shape]]
  embed_shapes: Callable[[object], Dict[str, Shape]]
  head_shapes: Callable[[object], Dict[str, Shape]]

  def matching(self, name: str) -> Tuple[Rule, ...]:
    return tuple(r for r in self.rules if r.matches(name))

  def rule(self, name: str) -> Rule:
    """The rule of canonical name `name` (the first that matches).

    Raises:
      KeyError: no rule matches: the family's table lacks this variable.
    """
    for r in self.rules:
      if r.matches(name):
        return r
    raise KeyError(f"no partitioning rule of model family {self.family!r} matches the "
                   f"variable {name!r}: add one to its table (tfpar.partitioning)")

  def axis(self, name: str, rank: int) -> Optional[int]:
    """The axis `name` is split along over tensor shards, or None (whole on one device)."""
    return shard_axis(self.rule(name).split, rank)

  def decays(self, name: str) -> bool:
    return self.rule(name).decay

  def block_counts(self, m, tensor_parallel: int = 1) -> Tuple[int, int]:
    """(unsplit parameters of one block, parameters of one of its T shards)."""
    return shard_counts(self, {f"block_0/{n}": s for n, s in self.block_shapes(m).items()},
                        tensor_parallel)

  def embed_head_counts(self, m) -> Tuple[int, int]:
    """(parameters of the embedding part, of the head part): both whole on one device.

    Raises:
      ValueError: a COLUMN or ROW rule names one of their variables (tfpar splits
        only blocks over tensor shards).
    """
    out = []
    for part, shapes in (("embedding", self.embed_shapes(m)), ("head", self.head_shapes(m))):
      split = [n for n, shape in shapes.items() if self.axis(n, len(shape)) is not None]
      if split:
        raise ValueError(f"model family {self.family!r}: its {part}'s {', '.join(split)} split "
                         f"over tensor shards (COLUMN/ROW rules); tfpar keeps the {part} whole")
      out.append(sum(math.prod(shape) for shape in shapes.values()))
    return out[0], out[1]

  def block_matmul_params(self, m) -> int:
    """Weights of one block's matrices (rank-2 kernels): 2 FLOPs per weight per position."""
    return sum(math.prod(s) for s in self.block_shapes(m).values() if len(s) == 2)


def no_decay_names(tables: Iterable[Rules]) -> Tuple[str, ...]:
  """The variable names (last path component) of every no-decay rule of `tables`.

  Keras's AdamW excludes variables by a regex search on that short name, so a
  family's no-decay rules must end in names its decaying variables do not
  contain (the unit tests check it for every registered family's variables).
  """
  names = []
  for table in tables:
    for r in table.rules:
      leaf = r.pattern.rsplit("/", 1)[-1]
      for name in re.sub(r"^\((.*)\)$", r"\1", leaf).split("|"):
        # A plain name only: `dropout_rng/\d+` is state, not a weight the optimizer sees.
        if not r.decay and re.fullmatch(r"[A-Za-z_]\w*", name) and name not in names:
          names.append(name)
  return tuple(names)


# --- tfpar.layers' parts, for the families' tables (tfpar/models/<family>/rules.py) ----------

def norm(prefix: str) -> Tuple[Rule, ...]:
  """A LayerNorm's scale and offset: whole, not decayed."""
  return (Rule(rf"{prefix}/(gamma|beta)"),)


def dense(prefix: str, split: str = REPLICATED, bias: bool = True) -> Tuple[Rule, ...]:
  """A Dense layer's kernel (decayed) and bias (not), split as the layer is."""
  return (Rule(rf"{prefix}/kernel", split, decay=True),) + (
      (Rule(rf"{prefix}/bias", split),) if bias else ())


BLOCK = r"block_\d+"
BLOCK_RULES = (
    *norm(rf"{BLOCK}/ln_(1|2)"),
    *dense(rf"{BLOCK}/attn/(query|key|value)", COLUMN),  # Heads [t H/T, (t+1) H/T).
    *dense(rf"{BLOCK}/attn/output", ROW, bias=False),
    *dense(rf"{BLOCK}/mlp/fc_in", COLUMN),
    *dense(rf"{BLOCK}/mlp/fc_out", ROW, bias=False),
    Rule(rf"{BLOCK}/(attn_bias|mlp_bias)"),  # Added once, after the sum of the shards.
)
DROPOUT_RULES = (Rule(r"dropout_rng/\d+"),)  # Dropout's RNG state (tfpar.training.checkpoint).


def final_norm_shapes(m) -> Dict[str, Shape]:
  """A final LayerNorm after the blocks (ln_f)."""
  return {"ln_f/gamma": (m.d_model,), "ln_f/beta": (m.d_model,)}


def block_shapes(m) -> Dict[str, Shape]:
  """tfpar.layers.Block's variables at full shape, from the ModelConfig."""
  d, f = m.d_model, m.d_ff
  width = m.num_heads * (d // m.num_heads)
  shapes = {"ln_1/gamma": (d,), "ln_1/beta": (d,), "ln_2/gamma": (d,), "ln_2/beta": (d,)}
  for name in ("query", "key", "value"):
    shapes.update({f"attn/{name}/kernel": (d, width), f"attn/{name}/bias": (width,)})
  shapes.update({"attn/output/kernel": (width, d), "mlp/fc_in/kernel": (d, f),
                 "mlp/fc_in/bias": (f,), "mlp/fc_out/kernel": (f, d),
                 "attn_bias": (d,), "mlp_bias": (d,)})
  return shapes


def shard_counts(rules: Rules, shapes: Dict[str, Shape], tensor_parallel: int, *,
                 vocab_parallel: bool = False) -> Tuple[int, int]:
  """(parameters kept whole, parameters of one of the T shards) of the variables `shapes`.

  Args:
    rules: the family's table, which says how each canonical name splits.
    shapes: {canonical name: full shape}.
    tensor_parallel: T.
    vocab_parallel: VOCAB tables split too, by rows (the planner's Megatron
      layout); in tfpar's they are whole.
  """
  whole = shard = 0
  for name, shape in shapes.items():
    size, split = math.prod(shape), rules.rule(name).split
    if vocab_parallel and split == VOCAB or shard_axis(split, len(shape)) is not None:
      shard += size // tensor_parallel
    else:
      whole += size
  return whole, shard


def shard_shapes(rules: Rules, shapes: Dict[str, Shape], tensor_parallel: int
                 ) -> Dict[str, Shape]:
  """Each variable's shape on one tensor shard (whole where it is not split)."""
  out = {}
  for name, shape in shapes.items():
    axis = rules.axis(name, len(shape))
    out[name] = shape if axis is None else tuple(
        n // tensor_parallel if i == axis else n for i, n in enumerate(shape))
  return out


def check_disjoint(rules: Rules, names: Sequence[str]) -> Dict[str, int]:
  """{name: number of matching rules} for every name that does not match exactly one."""
  return {n: len(rules.matching(n)) for n in names if len(rules.matching(n)) != 1}
