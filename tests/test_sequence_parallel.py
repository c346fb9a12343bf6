"""Sequence parallelism (--sequence_parallel) trains like plain tensor parallelism and one device.

GPT and Llama engines, built in this process on the 8 logical CPUs, train 4
steps under XLA (each shard's attention and MLP compiled on its device, as
by default): tensor 2 with the sequence split over the two shards matches
tensor 2 without it and one device (loss and gradient norm per step, the
first gradient in full, the final weights and AdamW slots, at 1e-5); so does
pipeline 2 x tensor 2 with the split and --remat (full), whose stages join
the slices where they leave and whose blocks join them for the recompute.
Then what it saves: the activations the backward reads on each device,
counted on the traced step's graph, fall on the busiest device and spread
evenly over the shards; plan.json records the split and its prediction, and
the planner's bytes for the run are the measured ones within 10%.
"""

import collections
import json

import numpy as np
import pytest

from conftest import TINY, assert_twin, build_engine, make_config, train_twin
from tfpar.config import ConfigError
from tfpar.parallel import plan as plan_lib
from tfpar.planner import clusters, cost, report, search

STEPS = 4
SEQ = 16
BASE = TINY + [f"--seq_len={SEQ}", f"--train_steps={STEPS}", "--eval_every=0",
               "--checkpoint_every=100"]
TENSOR_2 = ["--num_cpu_devices=2", "--tensor_parallel=2"]
SP = ["--sequence_parallel"]
LLAMA = ["--architecture=llama", "--num_kv_heads=2"]
PLANS = {
    "one": ["--strategy=one_device"],
    "tensor_2": TENSOR_2,
    "sequence_2": TENSOR_2 + SP,
    "sequence_2_x_pipeline_2_remat": ["--num_cpu_devices=4", "--pipeline_stages=2",
                                      "--tensor_parallel=2", "--microbatches=2", "--remat"] + SP,
    "llama_one": LLAMA + ["--strategy=one_device"],
    "llama_sequence_2": LLAMA + TENSOR_2 + SP,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for name, args in PLANS.items():
    model_dir = tmp_path_factory.mktemp(name)
    out[name] = train_twin(build_engine(BASE + args + [f"--model_dir={model_dir}"]), STEPS)
    out[name]["model_dir"] = model_dir
  return out


@pytest.mark.parametrize("plan, twins", [
    ("sequence_2", ("tensor_2", "one")),
    ("sequence_2_x_pipeline_2_remat", ("one",)),
    ("llama_sequence_2", ("llama_one",)),
])
def test_the_sequence_split_trains_like_its_twins(runs, plan, twins):
  run = runs[plan]
  assert all(block.placement.sequence_parallel for block in run["model"].blocks)
  assert run["engine"].plan.sequence_parallel
  for twin in twins:
    assert_twin(run, runs[twin])


def test_plan_json_records_the_split_and_the_planner_predicts_its_bytes(runs):
  """plan.json: the split, its smaller predicted activations, the variables' measured bytes;
  tfpar.planner.cost's weights + optimizer on the busiest device within 10% of those, and
  its activations the runtime plan's (one formula: plan.activation_bytes_per_block)."""
  written = {}
  for name in ("tensor_2", "sequence_2"):
    with open(runs[name]["model_dir"] / "plan.json") as f:
      written[name] = json.load(f)
  plain, split = written["tensor_2"], written["sequence_2"]
  assert (plain["sequence_parallel"], split["sequence_parallel"]) == (False, True)
  assert split["bytes_per_device"] == plain["bytes_per_device"]  # The weights do not move.
  acts = lambda plan: max(plan["activation_bytes_per_device"].values())
  assert acts(split) < acts(plain)
  cfg = runs["sequence_2"]["engine"].cfg
  plans = cost.Plans(D=np.ones(2, int), K=np.ones(2, int), T=np.full(2, 2),
                     b=np.full(2, cfg.train.global_batch_size), remat=np.zeros(2, int),
                     sp=np.array([False, True]))
  predicted = cost.evaluate(cfg.model, clusters.parse("cpu:2"), plans,
                            global_batch=cfg.train.global_batch_size, precision="float32",
                            system=cost.TFPAR)
  measured = split["measured_bytes_per_device"]
  busiest = max(b["parameters"] + b["optimizer"] for b in measured.values())
  for i, plan in enumerate((plain, split)):
    state = predicted["weights"][i] + predicted["optimizer"][i]
    assert abs(state / busiest - 1) < 0.1, (state, busiest)
    assert predicted["activations"][i] == pytest.approx(acts(plan), rel=1e-6)


def kept_bytes_per_device(args, model_dir):
  """{device: bytes of forward tensors that gradient ops read there}: the activations kept for
  the backward, counted on the traced step's graph (without XLA, so every op is in it; a
  gradient op runs where the forward op it is colocated with does)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  engine = build_engine(BASE + args + ["--jit_compile=false", f"--model_dir={model_dir}"])
  tokens = tf.zeros([engine.cfg.train.global_batch_size, SEQ], tf.int32)
  graph = tf.function(engine.copies[0].pipeline.loss_and_grads).get_concrete_function(
      tokens, tokens).graph
  backward = lambda op: op.name.startswith("gradients")

  def device(op):
    for group in op.colocation_groups():
      name = group.decode().split("@", 1)[1]
      if name != op.name:
        return plan_lib.device_key(graph.get_operation_by_name(name).device)
    return plan_lib.device_key(op.device)

  kept = set()
  for op in graph.get_operations():
    if not backward(op):
      continue
    for x in op.inputs:
      if not backward(x.op) and x.op.type not in ("ReadVariableOp", "Const", "Placeholder"):
        kept.add((device(op), x.name, x.shape.num_elements() * x.dtype.size))
  out = collections.Counter()
  for dev, _, nbytes in kept:
    out[dev] += nbytes
  return dict(out)


def test_the_split_keeps_less_on_the_busiest_device_and_spreads_it(tmp_path):
  plain = kept_bytes_per_device(TENSOR_2, tmp_path / "plain")
  split = kept_bytes_per_device(TENSOR_2 + SP, tmp_path / "split")
  assert sorted(plain) == sorted(split) == ["CPU:0", "CPU:1"]
  print(f"kept for the backward, bytes per device: tensor 2 {plain}, + sequence parallel {split}")
  # Without the split the LayerNorms and the residual stream sit whole on the first device;
  # with it each device keeps its slice of them (the head stays on the first device).
  assert max(split.values()) < max(plain.values())
  assert split["CPU:0"] - split["CPU:1"] < plain["CPU:0"] - plain["CPU:1"]


def test_the_planner_searches_the_split_and_models_its_memory():
  m = make_config(BASE).model
  plans = search.candidates(m, clusters.parse("cpu:4"), 8, cost.TFPAR)
  assert set(zip(plans.T.tolist(), plans.sp.tolist())) == {(1, False), (2, False), (2, True),
                                                          (4, False), (4, True)}
  assert not len(search.candidates(m, clusters.parse("cpu:4"), 8, cost.TFPAR,
                                   tensor_parallel=1, sequence_parallel=True))
  one = lambda **kw: cost.Plans(D=np.ones(1, int), K=np.ones(1, int), T=np.full(1, 4),
                                b=np.full(1, 8), **kw)
  r = {(system.name, sp): cost.evaluate(m, clusters.parse("cpu:4"),
                                        one(remat=np.zeros(1, int), sp=np.array([sp])),
                                        global_batch=8, precision="float32", system=system)
       for system in (cost.TFPAR, cost.MEGATRON) for sp in (False, True)}
  acts = {k: v["activations"][0] for k, v in r.items()}
  saved = {name: acts[name, False] - acts[name, True] for name in ("tfpar", "megatron")}
  # tfpar keeps the gathered inputs whole; Megatron-LM gathers them again in the backward.
  assert 0 < saved["tfpar"] < saved["megatron"]
  assert r["tfpar", True]["tensor_comm"][0] == r["tfpar", False]["tensor_comm"][0]
  # Per block, in 16-bit values: s b h (10 + 24/T) -> (4 + 30/T) -> 34/T, plus 5 a s^2 b / T.
  s, b, h, a, t = m.seq_len, 8, m.d_model, m.num_heads, 4
  for sp, regather, whole in ((False, False, 10), (True, False, 4), (True, True, 0)):
    kept, _ = plan_lib.activation_bytes_per_block(m, b, t, cost.NO_REMAT, "mixed_bfloat16", sp,
                                                  regather=regather)
    assert kept == pytest.approx(s * b * h * (whole + (34 - whole) / t) + 5 * a * s * s * b / t)
  ranked = search.rank(m, clusters.parse("cpu:4"), plans, global_batch=8, precision="float32",
                       system=cost.TFPAR)
  row = next(ranked.row(i) for i in ranked.order if ranked.plans.sp[i])
  assert row["sequence_parallel"] and "sequence parallel" in report.degrees(row)
  assert "--sequence_parallel" in report.plan_flags(row, clusters.parse("cpu:4"))


@pytest.mark.parametrize("flags, says", [
    (SP, "--tensor_parallel=1 has one"),
    (TENSOR_2 + SP + ["--seq_len=15"], "--seq_len=15 into --tensor_parallel=2"),
    (TENSOR_2 + SP + ["--task=classify"], "--sequence_parallel is for --task=lm"),
])
def test_what_cannot_split_is_refused_in_one_line(flags, says, tmp_path):
  with pytest.raises(ConfigError, match=says) as raised:
    make_config(BASE + flags + [f"--model_dir={tmp_path}"])
  assert "\n" not in str(raised.value)
