"""The public API (tfpar.__all__) and a user's own model: examples/alibi_lm.py.

The example, a parallel-residual transformer with ALiBi written against the
public API alone, is built by `tfpar.Trainer(make_config(...)).build()` (the
path `fit()` and `python -m tfpar.train` take) under pipeline 2 x tensor 2 (4
logical CPU devices) and under ZeRO-1 over 2 mirrored replicas; each trains 3
steps on real text and matches one device at 1e-5 in float32: the same initial
weights, losses, gradient norms, first gradient and final weights and slots.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_twin, load_file, train_twin
import tfpar

STEPS = 3
TEXT = os.path.join(os.path.dirname(os.__file__), "textwrap.py")  # Real text: the stdlib's.
SMALL = dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, seq_len=32, global_batch_size=8,
             train_steps=STEPS, eval_every=0, eval_steps=1, checkpoint_every=100,
             steps_per_call=1, log_every=1, learning_rate=3e-3, warmup_steps=1,
             jit_compile=False, data=TEXT)
PLANS = {
    "one": dict(strategy="one_device"),
    "pipeline_2_x_tensor_2": dict(num_cpu_devices=4, pipeline_stages=2, tensor_parallel=2,
                                  microbatches=2),
    "zero1_x_2": dict(strategy="mirrored", num_cpu_devices=2, optimizer_sharding="zero1"),
}


def load_example():
  """examples/alibi_lm.py as a module (it registers its family as it loads)."""
  return load_file("examples", "alibi_lm.py")


@pytest.fixture(scope="module")
def example():
  return load_example()


@pytest.fixture(scope="module")
def runs(example, tmp_path_factory):
  out = {}
  for name, plan in PLANS.items():
    cfg = tfpar.make_config(architecture=example.FAMILY.name,
                            model_dir=str(tmp_path_factory.mktemp(name)), **SMALL, **plan)
    out[name] = train_twin(tfpar.Trainer(cfg).build(), STEPS)
  return out


def test_the_users_model_trains_under_pipeline_2_x_tensor_2_like_one_device(runs, example):
  run = runs["pipeline_2_x_tensor_2"]
  assert isinstance(run["model"], example.AlibiLM) and isinstance(run["model"], tfpar.ParallelModel)
  assert run["model"].blocks[0].tensor_shards == 2
  assert len(run["engine"].plan.stages) == 2
  assert "block_1/attn/query/kernel" in run["initial"] and "block_0/bias" in run["initial"]
  assert_twin(run, runs["one"])


def test_the_users_model_trains_under_zero1_over_2_replicas_like_one_device(runs):
  assert_twin(runs["zero1_x_2"], runs["one"])


def test_its_bytes_per_device_come_from_its_rules(runs):
  engine = runs["pipeline_2_x_tensor_2"]["engine"]
  predicted, measured = engine.plan.bytes_per_device(), engine.measured_bytes()
  assert {d: b["parameters"] for d, b in predicted.items()} == \
      {d: b["parameters"] for d, b in measured.items()}


def test_fit_trains_it_and_records_its_family(example, tmp_path):
  records = tfpar.fit(architecture=example.FAMILY.name, model_dir=str(tmp_path),
                        **{**SMALL, "train_steps": 2})
  assert records and np.isfinite(records["train"]["loss"])
  with open(tmp_path / "config.json", encoding="utf-8") as f:
    assert '"architecture": "alibi_lm"' in f.read()


def test_import_tfpar_and_make_config_import_no_tensorflow():
  code = ("import sys, tfpar; cfg = tfpar.make_config(num_layers=2, model_dir='x', "
          "pipeline_stages=2, num_cpu_devices=2); "
          "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules; "
          "print(cfg.parallel.pipeline_stages)")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       check=True, timeout=120)
  assert out.stdout.split() == ["2"]


def test_every_public_name_resolves():
  for name in tfpar.__all__:
    assert getattr(tfpar, name) is not None, name
  with pytest.raises(AttributeError):
    tfpar.no_such_name  # pylint: disable=pointless-statement


@pytest.mark.parametrize("settings, says", [
    (dict(d_modle=64), "unknown setting d_modle=64 (did you mean d_model?)"),
    (dict(strategy="bogus"), "strategy='bogus' is not one of one_device, mirrored"),
    (dict(d_model="64"), "d_model='64' must be of type int"),
    (dict(num_heads=5), "--num_heads=5 does not divide --d_model=128"),
    (dict(architecture="gtp"), "--architecture=gtp is not a registered language model family"),
])
def test_make_config_refuses_a_bad_setting_in_one_line(settings, says):
  with pytest.raises(tfpar.ConfigError, match=re.escape(says)) as raised:
    tfpar.make_config(model_dir="unused", **settings)
  assert "\n" not in str(raised.value)


def test_the_config_is_frozen_with_resolved_defaults():
  cfg = tfpar.make_config(d_model=64, model_dir="unused", remat=True, stage_layers=(2, 2),
                          pipeline_stages=2, num_cpu_devices=2)
  assert cfg.model.d_ff == 256 and cfg.parallel.remat == "full"
  assert cfg.parallel.stage_layers == (2, 2)
  with pytest.raises(Exception, match="cannot assign"):
    cfg.model.d_model = 32


def test_the_trainer_says_when_tensorflow_started_with_too_few_devices():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  assert len(tf.config.list_logical_devices("CPU")) == 8  # The runtime is up (conftest's 8).
  cfg = tfpar.make_config(model_dir="unused", strategy="mirrored", num_cpu_devices=16)
  with pytest.raises(tfpar.ConfigError, match="TensorFlow already started with 8 CPU device"):
    tfpar.Trainer(cfg)


def test_no_module_outside_a_family_folder_names_a_family():
  """A family is its folder plus its registration: every other module asks tfpar.families."""
  import ast  # pylint: disable=import-outside-toplevel
  from tfpar import families  # pylint: disable=import-outside-toplevel
  folders = {name for name in os.listdir(os.path.join(REPO, "tfpar", "models"))
             if os.path.isdir(os.path.join(REPO, "tfpar", "models", name))
             and not name.startswith("__")}
  assert {"gpt", "llama", "vit"} <= folders and set(families.names()) >= folders
  tables = {t.family for t in families.all_rules()} - {"alibi_lm"}  # The example's own.
  found = []
  for root, _, files in os.walk(os.path.join(REPO, "tfpar")):
    rel = os.path.relpath(root, os.path.join(REPO, "tfpar")).split(os.sep)
    if rel[0] == "models" and len(rel) > 1 and rel[1] in folders:
      continue
    for name in (f for f in files if f.endswith(".py")):
      with open(os.path.join(root, name), encoding="utf-8") as f:
        tree = ast.parse(f.read())
      found += [f"{'/'.join(rel)}/{name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in tables]
  assert not found, "family names outside their folders:\n" + "\n".join(found)


def test_the_trainer_takes_the_family_to_train(example):
  cfg = tfpar.make_config(model_dir="unused")
  assert tfpar.Trainer(cfg, model=example.FAMILY).config.model.architecture == "alibi_lm"
  llama = tfpar.Trainer(cfg, model="llama").config.model  # Its own default positions.
  assert (llama.architecture, llama.positions) == ("llama", "rotary")
  with pytest.raises(tfpar.ConfigError, match="--architecture=gtp is not a registered"):
    tfpar.Trainer(cfg, model="gtp")
