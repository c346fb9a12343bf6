"""The config's seams: each setting written once, one config.json reader, tasks owning their rules.

Fast checks that keep the split of tfpar.config from drifting back: the flags
are the schema's fields with the same defaults, the validation modules stay
free of TensorFlow, a run directory's config.json reads the same for every
tool, and nothing outside tfpar/tasks compares --task to a task's name.
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from tfpar.config import config, flags, rundir, schema
from tfpar import tasks

PACKAGE = pathlib.Path(tasks.__file__).parent.parent


def test_every_flag_is_one_field_of_the_schema_and_the_defaults_agree():
  fv = flags.define_flags(flags.flags.FlagValues())
  names = [s.flag for s in schema.settings()]
  assert sorted(names) == sorted(fv), "a flag without a field, or a field without a flag"
  assert len(set(names)) == len(names)
  # The flags' defaults resolve to the dataclasses' (d_ff = 4 * d_model, warmup = 5% of 200).
  assert config.from_flags(flags.parse(["--model_dir=runs/default"])) == schema.Config()


def test_a_flag_sets_its_own_field():
  cfg = config.from_flags(flags.parse(["--model_dir=d", "--powersgd_rank=7", "--d_ff=96",
                                       "--stage_layers=2,2", "--pipeline_stages=2",
                                       "--num_cpu_devices=4", "--strategy=mirrored",
                                       "--grad_compression=fp16", "--tpu=grpc://x"]))
  assert (cfg.compression.rank, cfg.compression.method, cfg.model.d_ff) == (7, "fp16", 96)
  assert (cfg.parallel.stage_layers, cfg.dist.tpu, cfg.train.model_dir) == ((2, 2), "grpc://x", "d")


def test_flags_config_and_rules_start_no_tensorflow():
  code = ("import sys; import tfpar.config.config, tfpar.config.flags, tfpar.config.rules, tfpar.config.rundir, tfpar.config.cluster; "
          "from tfpar import tasks; [tasks.spec(n) for n in tasks.NAMES]; "
          "assert 'tensorflow' not in sys.modules, 'TensorFlow imported'")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_a_run_directory_reads_alike_with_fields_missing_or_unknown(tmp_path):
  saved = schema.Config().replace(model={"d_model": 64}).to_dict()
  saved["model"]["a_field_of_a_later_version"] = 1
  del saved["model"]["pooling"]  # One of an earlier version that had no such field.
  del saved["compression"]  # A whole section of a later version.
  saved["a_section_of_a_later_version"] = {"x": 1}
  (tmp_path / rundir.RUN_CONFIG).write_text(json.dumps(saved))
  assert rundir.load(str(tmp_path)) == schema.Config().replace(model={"d_model": 64})
  heard = []
  assert rundir.find_run(str(tmp_path), warn=heard.append) == rundir.load(str(tmp_path))
  assert heard == [f"--model_dir={tmp_path}: config.json is of another tfpar version: ignored "
                   "what this tfpar does not know (a_section_of_a_later_version, "
                   "model.a_field_of_a_later_version); defaults for what it lacks "
                   "(model.pooling, compression.method, compression.min_size, "
                   "compression.rank, compression.warmup_steps)"]
  with pytest.raises(ValueError, match="has no config.json [(]it does not exist[)]"):
    rundir.find_run(str(tmp_path / "nowhere"), ValueError)
  (tmp_path / rundir.RUN_CONFIG).write_text(json.dumps({"model": []}))
  with pytest.raises(schema.ConfigError, match="config.json that cannot be read"):
    rundir.load(str(tmp_path))


def test_the_run_directory_writer_and_reader_agree(tmp_path):
  cfg = schema.Config().replace(train={"model_dir": str(tmp_path / "run")},
                                parallel={"stage_layers": (1, 3)})
  rundir.write_config(cfg, ["cat", "dog"])
  saved = rundir.read_saved(cfg.train.model_dir)
  assert rundir.from_saved(saved) == cfg
  assert rundir.saved_class_names(saved) == ("cat", "dog")


def _task_switches(tree: ast.AST):
  """(line, text) of each comparison with, or dict keyed by, a task's name."""
  def named(node):
    if isinstance(node, ast.Constant) and node.value in tasks.NAMES:
      return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts))
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare) and any(map(named, [node.left, *node.comparators])):
      yield node.lineno, ast.unparse(node)
    if isinstance(node, ast.Dict) and any(named(k) for k in node.keys if k is not None):
      yield node.lineno, ast.unparse(node)[:80]
    if isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue) \
        and named(node.pattern.value):
      yield node.pattern.lineno, ast.unparse(node.pattern)


def test_the_scan_finds_a_switch_on_a_task_name():
  code = 'if m.task == "lm": pass\nx = kind in ("detect", "segment")\ny = {"classify": 1}[k]'
  assert [line for line, _ in _task_switches(ast.parse(code))] == [1, 2, 3]


def test_no_module_outside_the_task_registry_switches_on_a_task_name():
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if PACKAGE / "tasks" in path.parents:
      continue
    tree = ast.parse(path.read_text(), str(path))
    found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
              for line, text in _task_switches(tree)]
  assert not found, "ask the task (tfpar.tasks) instead:\n" + "\n".join(found)
