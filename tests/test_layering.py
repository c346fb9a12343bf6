"""The package's import arrows go one way, and never round (docs/design.md, "Layers").

Every import statement in tfpar (module level or inside a function: a lazy
import is an arrow too) is parsed with `ast`, its target placed in a layer,
and no module may import from a layer above its own, nor sit on a cycle of
imports. The planner imports no runtime module; engines and the training
machinery import no model, loss or reader: the task brings them.
Runs no TensorFlow.
"""

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "tfpar")

# Lowest first. A module may import its own layer and those below.
LAYERS = [
    ("foundation", ["tfpar", "tfpar.storage", "tfpar.status", "tfpar.console",
                    "tfpar.partitioning", "tfpar.families"]),
    ("data", ["tfpar.data", "tfpar.vision", "tfpar.tokenizer"]),
    ("settings", ["tfpar.config", "tfpar.tasks.specs", "tfpar.hub"]),
    ("layout", ["tfpar.layout"]),  # TF-free arithmetic: the runtime and the planner read it.
    ("planner", ["tfpar.planner"]),  # Below every runtime layer: it imports none.
    ("layers", ["tfpar.layers"]),
    ("models", ["tfpar.models"]),
    ("training", ["tfpar.training"]),
    ("tasks", ["tfpar.tasks"]),
    ("parallel", ["tfpar.parallel"]),
    ("engines", ["tfpar.engines", "tfpar.strategies"]),
    ("runner", ["tfpar.runner", "tfpar.trainer"]),
    # The command-line tools, and the modules that keep their `python -m` names.
    ("cli", ["tfpar.cli", "tfpar.train", "tfpar.generate", "tfpar.predict", "tfpar.launch",
             "tfpar.plan", "tfpar.export", "tfpar.k8s", "tfpar.data.__main__",
             "tfpar.tokenizer.__main__"]),
]
RANK = {prefix: rank for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes}
# A module whose layer is not its package's: the task registry (the names, and
# each task's TF-free spec; the Task classes it loads by name, on demand) sits
# with the settings that validate --task.
EXACT = {"tfpar.tasks": RANK["tfpar.config"]}

# What the engines and the training machinery must not import: models, losses, readers.
WHAT_A_TASK_BRINGS = ["tfpar.models", "tfpar.layers", "tfpar.tasks.", "tfpar.data.corpus",
                      "tfpar.data.images", "tfpar.data.image_records", "tfpar.data.image_pipeline",
                      "tfpar.data.digit_canvas", "tfpar.data.augment", "tfpar.vision"]


def modules():
  """{dotted name: path} of every module in tfpar."""
  out = {}
  for root, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].split(os.sep)
        out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(root, f)
  return out


MODULES = modules()


def layer_of(name: str):
  """The rank of `name` in EXACT, else of its longest layer prefix, or None."""
  if name in EXACT:
    return EXACT[name]
  best = None
  for prefix, rank in RANK.items():
    below = name.startswith(prefix + ".") and prefix != "tfpar"  # The root: itself only.
    if (name == prefix or below) and (
        best is None or len(prefix) > len(best[0])):
      best = (prefix, rank)
  return None if best is None else best[1]


def imports(path: str):
  """The tfpar modules `path` imports, as dotted names (a `from` of a module: that module)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "tfpar":
          yield alias.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
        node.module.split(".")[0] == "tfpar":
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        yield sub if sub in MODULES else node.module


def test_every_module_has_a_layer():
  missing = sorted(m for m in MODULES if layer_of(m) is None)
  assert not missing, f"in no layer of docs/design.md (add them to LAYERS): {missing}"


def test_no_module_imports_from_a_layer_above_its_own():
  upward = []
  for name, path in MODULES.items():
    for target in imports(path):
      if layer_of(target) > layer_of(name):
        upward.append(f"{name} -> {target}")
  assert not upward, "imports against the layering:\n" + "\n".join(sorted(set(upward)))


def graph():
  """{module: the tfpar modules it imports}, every arrow (lazy ones too)."""
  return {name: {t for t in imports(path) if t in MODULES and t != name}
          for name, path in MODULES.items()}


def cycles(edges):
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  found = cycles(graph())
  assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_cycles():
  """A finder that finds nothing would pass anything."""
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_planner_imports_no_runtime_module():
  """The planner prices plans for thousands of devices on a laptop: TF-free arithmetic only."""
  runtime = [prefix for _, prefixes in LAYERS[LAYERS.index(("planner", ["tfpar.planner"])) + 1:]
             for prefix in prefixes]
  found = [f"{name} -> {target}" for name, path in MODULES.items()
           if name.startswith("tfpar.planner") for target in imports(path)
           if any(target == p or target.startswith(p + ".") for p in runtime)]
  assert not found, "the planner reaches the runtime:\n" + "\n".join(sorted(set(found)))


def test_engines_and_training_import_no_model_loss_or_reader():
  found = []
  for name, path in MODULES.items():
    if layer_of(name) not in (RANK["tfpar.engines"], RANK["tfpar.training"]):
      continue
    for target in imports(path):
      if any(target == p or target.startswith(p if p.endswith(".") else p + ".")
             for p in WHAT_A_TASK_BRINGS):
        found.append(f"{name} -> {target}")
  assert not found, "engines and training reach a task's model, loss or reader:\n" + \
      "\n".join(sorted(set(found)))


def test_the_layering_test_sees_real_arrows():
  """The parser finds what is there (a test that finds no import would pass anything)."""
  assert "tfpar.training.step" in set(imports(MODULES["tfpar.engines.data_parallel"]))
  assert "tfpar.layout.placement" in set(imports(MODULES["tfpar.planner.cost"]))
  assert "tfpar.tasks" in set(imports(MODULES["tfpar.runner"]))
  assert layer_of("tfpar.parallel.exchange") > layer_of("tfpar.training.step")


def test_pyflakes_finds_no_unused_import_or_undefined_name():
  """No dead import (a re-export shim is one), unused local or undefined name anywhere in the
  repository's Python (pyflakes, in the test extra)."""
  from pyflakes import api, reporter  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  out = io.StringIO()
  trees = [os.path.join(REPO, d) for d in ("tfpar", "tests", "scripts", "examples")]
  found = api.checkRecursive(trees, reporter.Reporter(out, out))
  assert found == 0, out.getvalue()
