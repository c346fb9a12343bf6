"""The Llama family (--architecture=llama) under every model-parallel plan, against one device.

A 2-block Llama with grouped-query attention (4 heads sharing 2 key/value
heads) trains 3 steps on real text (Python standard library source) on one
device, mirrored over 4 logical CPUs, pipeline 2, tensor 2 and tensor 2 x
pipeline 2, the last also with --fused_projections (all in this process).
Each plan's loss per step matches one device at relative 1e-5 in float32,
its gradient norm per step too, its first gradient in full (read as AdamW's
first moment after one step, (1 - beta_1) g, so that no plan traces a second
function for it) and its weights and AdamW slots after the steps; its
variables, their splits and its bytes per device come
tfpar/models/llama/rules.py; flags that cannot split are refused in one line.
"""

import inspect
import textwrap

import numpy as np
import pytest

from conftest import TINY, assert_twin, build_engine, make_config, train_twin
from tfpar import partitioning
from tfpar.config.schema import ConfigError
from tfpar.layout import placement as plan_lib
from tfpar.models.base import ParallelModel
from tfpar.models.llama import rules as llama_rules
from tfpar.models.llama.model import Llama
from tfpar.training.checkpoint import model_layout

STEPS = 3
LLAMA = TINY + ["--architecture=llama", "--num_kv_heads=2", "--seq_len=16",
                f"--train_steps={STEPS}", "--eval_every=0", "--checkpoint_every=100",
                "--jit_compile=false"]
PLANS = {
    "one": ["--strategy=one_device"],
    "mirrored_4": ["--strategy=mirrored", "--num_cpu_devices=4"],
    "pipeline_2": ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=2"],
    "tensor_2": ["--num_cpu_devices=2", "--tensor_parallel=2"],
    "tensor_2_x_pipeline_2": ["--num_cpu_devices=4", "--pipeline_stages=2",
                              "--tensor_parallel=2", "--microbatches=2"],
    # Each shard's Q, K, V and gate, up as one matmul (tests/test_fused.py).
    "fused_tensor_2_x_pipeline_2": ["--num_cpu_devices=4", "--pipeline_stages=2",
                                    "--tensor_parallel=2", "--microbatches=2",
                                    "--fused_projections"],
}
TEXT = np.frombuffer(inspect.getsource(textwrap).encode(), np.uint8)  # Real text, 20 kB.


def build(args, model_dir):
  return build_engine(LLAMA + args + [f"--model_dir={model_dir}"], TEXT, eval_tokens=1024)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  return {name: train_twin(build(args, tmp_path_factory.mktemp(name)), STEPS)
          for name, args in PLANS.items()}


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "one"])
def test_each_plan_trains_the_llama_like_one_device(runs, plan):
  one, run = runs["one"], runs[plan]
  assert isinstance(run["model"], (Llama, ParallelModel))
  assert len(one["grads"]) == 3 + 9 * 2
  assert_twin(run, one)


def test_its_variables_and_splits_come_from_its_rules(runs):
  engine = runs["tensor_2_x_pipeline_2"]["engine"]
  m = engine.cfg.model
  assert (m.positions, m.num_heads, m.kv_heads) == ("rotary", 4, 2)
  layout = model_layout(engine.copies[0].model)
  assert partitioning.check_disjoint(llama_rules.RULES, sorted(layout)) == {}
  full = {**{f"block_{i}/{n}": s for i in range(m.num_layers)
             for n, s in llama_rules.block_shapes(m).items()},
          **llama_rules.embed_shapes(m), **llama_rules.head_shapes(m)}
  assert sorted(full) == sorted(n for n in layout if not n.startswith("dropout_rng/"))
  assert full["block_0/attn/key/kernel"] == (32, 16)  # 2 KV heads of 8: half the queries'.
  want = partitioning.shard_shapes(llama_rules.RULES, full, 2)
  for name, (axis, shards) in layout.items():
    if name in full:
      assert len(shards) == (1 if axis is None else 2), name
      assert all(tuple(v.shape) == want[name] for v in shards), name
  measured = engine.measured_bytes()
  assert {d: b["parameters"] for d, b in engine.plan.bytes_per_device().items()} == \
      {d: b["parameters"] for d, b in measured.items()}
  assert engine.plan.counts == plan_lib.count_params(m, 2)  # The plan reads the Llama's rules.
  assert "scale" in partitioning.no_decay_names([llama_rules.RULES])


@pytest.mark.parametrize("flags, says", [
    (["--num_kv_heads=3"], "--num_kv_heads=3 does not divide --num_heads=4"),
    (["--num_kv_heads=1", "--num_cpu_devices=2", "--tensor_parallel=2"],
     "--tensor_parallel=2 does not divide --num_kv_heads=1"),
    (["--architecture=gpt"], "is for --architecture=llama"),
    (["--positions=learned"], "--positions=learned does not fit --architecture=llama"),
])
def test_flags_that_cannot_work_are_refused_in_one_line(flags, says, tmp_path):
  with pytest.raises(ConfigError, match=says) as raised:
    make_config(LLAMA + flags + [f"--model_dir={tmp_path}"])
  assert "\n" not in str(raised.value)
