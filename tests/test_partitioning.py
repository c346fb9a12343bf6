"""tfpar.partitioning: the rules tables against every task's real model variables."""

import math

import numpy as np
import pytest

from conftest import make_config
from tfpar import families, partitioning, tasks
from tfpar.config.schema import ModelConfig
from tfpar.layout import placement as plan_lib
from tfpar.training.checkpoint import model_layout
from tfpar.training.optimizer import NO_DECAY

TASK_FLAGS = {
    "lm": ["--task=lm", "--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64",
           "--seq_len=16"],
    "classify": ["--task=classify", "--num_layers=2", "--d_model=32", "--num_heads=4",
                 "--d_ff=64"],
    "detect": ["--task=detect", "--image_size=16", "--patch_size=4", "--num_layers=1", "--d_model=32", "--num_heads=4", "--d_ff=64"],
    "segment": ["--task=segment", "--num_classes=11", "--image_size=16", "--patch_size=4", "--num_layers=1", "--d_model=32", "--num_heads=4",
                "--d_ff=64"],
}


def built(task_name, tensor_shards):
  task = tasks.make(make_config(TASK_FLAGS[task_name] + ["--model_dir=unused"]))
  model = task.build_model(tensor_shards=tensor_shards)
  model.build_all()
  return task, model


@pytest.fixture(scope="module", params=sorted(TASK_FLAGS))
def task_models(request):
  return {t: built(request.param, t) for t in (1, 2)}


def test_every_variable_matches_exactly_one_rule(task_models):
  for _, model in task_models.values():
    names = list(model_layout(model))
    assert partitioning.check_disjoint(model.rules, names) == {}


def test_each_shard_has_its_rules_slice_and_the_counts_are_the_variables(task_models):
  task, whole = task_models[1]
  _, split = task_models[2]
  m = task.cfg.model
  full = {name: tuple(shards[0].shape) for name, (_, shards) in model_layout(whole).items()}
  want = partitioning.shard_shapes(whole.rules, full, 2)
  for name, (axis, shards) in model_layout(split).items():
    assert len(shards) == (1 if axis is None else 2), name
    assert all(tuple(v.shape) == want[name] for v in shards), name
  # The block's shapes the planner counts from are the built block's.
  block = {name.split("/", 1)[1]: shape for name, shape in full.items()
           if name.startswith("block_0/")}
  assert whole.rules.block_shapes(m) == block
  # So are its embedding's and head's (the plan's and the planner's counts of them).
  outside = {name: shape for name, shape in full.items()
             if not name.startswith(("block_", "dropout_rng/"))}
  assert {**whole.rules.embed_shapes(m), **whole.rules.head_shapes(m)} == outside
  # count_params (the plan's bytes, the planner's stages) equals the built variables.
  for t, (_, model) in task_models.items():
    c = plan_lib.count_params(m, t)
    one_shard = sum(math.prod(shards[-1].shape) for name, (axis, shards)
                    in model_layout(model).items() if axis is not None)
    assert c.block_shard * m.num_layers == one_shard
    total = sum(math.prod(v.shape) for v in model.trainable_variables)
    assert c.embedding + c.head + m.num_layers * c.block == total


def test_the_no_decay_set_is_todays():
  today = {"bias", "gamma", "beta", "attn_bias", "mlp_bias"}
  assert set(partitioning.no_decay_names([families.rules("gpt"), families.rules("vit")])) == today
  assert set(NO_DECAY) >= today


def test_keras_decays_exactly_what_the_rules_say(task_models):
  from tfpar.config.schema import OptimConfig  # pylint: disable=import-outside-toplevel
  from tfpar.training.optimizer import make_optimizer  # pylint: disable=import-outside-toplevel
  _, model = task_models[2]
  opt = make_optimizer(OptimConfig(), 10)
  prefix = model.name + "/"
  for v in model.trainable_variables:
    name = v.path[len(prefix):] if v.path.startswith(prefix) else v.path
    name = name.split("_shard_")[0]
    assert opt._use_weight_decay(v) == model.rules.decays(name), name  # pylint: disable=protected-access


def test_the_planners_layer_flops_come_from_the_rules():
  from tfpar.planner import cost  # pylint: disable=import-outside-toplevel
  m = ModelConfig(seq_len=64, num_layers=3, d_model=48, num_heads=6, d_ff=96)
  s, h, f = m.seq_len, m.d_model, m.d_ff
  assert cost.layer_flops(m) == 2 * s * (4 * h * h + 2 * h * f) + 4 * s * s * h


def test_a_name_no_rule_matches_is_a_clear_error():
  with pytest.raises(KeyError, match="no partitioning rule of model family 'gpt' matches"):
    families.rules("gpt").rule("block_0/attn/rotary/kernel")
  with pytest.raises(KeyError, match="unknown model family 'gtp': registered are gpt, llama"):
    families.get("gtp")
  with pytest.raises(ValueError, match="split 'diagonal'"):
    partitioning.Rule("x", "diagonal")
  assert np.isscalar(families.rules("gpt").axis("block_3/mlp/fc_in/bias", 1))
