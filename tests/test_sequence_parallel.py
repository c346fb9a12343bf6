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

And what each --remat really keeps: scripts/activation_memory.py runs once
(one child process with TensorFlow's BFC allocator, started with this
module's first test) and measures, from the allocator's trace, the bytes each
device holds when the backward starts, under --remat=none, selective and full
on tensor 2, selective with the split, and Llama with the split: plan.json's
prediction is within 10% of it on the busiest device, and the recomputation
stays in the backward (selective frees the attention cores' probabilities,
full everything but the blocks' inputs).
"""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import (REPO, TINY, assert_twin, build_engine, canonical_grads, in_background,
                      make_config, selected_tests_use, train_twin)
from tfpar.config.schema import ConfigError
from tfpar.layout import placement as plan_lib
from tfpar.planner import clusters, cost, report, search

STEPS = 2
SEQ = 16
BASE = TINY + [f"--seq_len={SEQ}", f"--train_steps={STEPS}", "--eval_every=0",
               "--checkpoint_every=100"]
TENSOR_2 = ["--num_cpu_devices=2", "--tensor_parallel=2"]
SP = ["--sequence_parallel"]
NO_XLA = ["--jit_compile=false"]
LLAMA = ["--architecture=llama", "--num_kv_heads=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One device and tensor 2 with the split, trained STEPS steps (without XLA: its
  compiled shards are checked step by step below)."""
  return {name: train_twin(build_engine(BASE + args + NO_XLA + [
      f"--model_dir={tmp_path_factory.mktemp(name)}"]), STEPS)
          for name, args in (("one", ["--strategy=one_device"]), ("sequence_2", TENSOR_2 + SP))}


def test_the_sequence_split_trains_like_one_device(runs):
  run = runs["sequence_2"]
  assert all(block.placement.sequence_parallel for block in run["model"].blocks)
  assert run["engine"].plan.sequence_parallel
  assert_twin(run, runs["one"])


ALIASES = ("Reshape", "Identity", "StopGradient", "ExpandDims", "Squeeze")  # Share a buffer.
NOT_ACTIVATIONS = ("ReadVariableOp", "Const", "Placeholder")


REMATS = ("none", "selective", "full")
MEASURED = [f"tensor_2/{remat}" for remat in REMATS] + ["sequence_2/selective",
                                                       "llama_sequence_2/none"]


def run_activation_memory(tmp_path):
  """scripts/activation_memory.py on MEASURED: {case: its row}."""
  out = tmp_path / "memory.json"
  proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "activation_memory.py"),
                         f"--cases={','.join(MEASURED)}", f"--out={out}"],
                        capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  print(proc.stdout)
  return {f"{row['layout']}/{row['remat']}": row for row in json.loads(out.read_text())}


@pytest.fixture(scope="module", autouse=True)
def memory_started(request, tmp_path_factory):
  """The script's run, started with the module's first test when a selected test reads it."""
  if selected_tests_use(request, "memory"):
    return in_background(run_activation_memory, tmp_path_factory.mktemp("memory"))
  return None


@pytest.fixture(scope="module")
def memory(memory_started):
  return memory_started.result()


def kept_bytes_per_device(graph):
  """{device: bytes of forward tensors that gradient ops read there}: the activations kept for
  the backward, counted on the traced step's graph (without XLA, so every op is in it; a
  gradient op runs where the forward op it is colocated with does). Each buffer once: a
  reshape's output is its input's buffer (the Dense layers' inputs come reshaped)."""
  backward = lambda op: op.name.startswith("gradients")

  def buffer(x):
    while x.op.type in ALIASES:
      x = x.op.inputs[0]
    return x

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
      x = x if backward(x.op) else buffer(x)
      if not backward(x.op) and x.op.type not in NOT_ACTIVATIONS:
        kept.add((device(op), x.name, x.shape.num_elements() * x.dtype.size))
  out = collections.Counter()
  for dev, _, nbytes in kept:
    out[dev] += nbytes
  return dict(out)


# One traced forward and backward of one batch each (without XLA unless asked), the split
# against the same plan unsplit: {name: (flags, the unsplit twin)}.
STEPPED = {
    "tensor_2": (TENSOR_2 + NO_XLA, None),
    "sequence_2": (TENSOR_2 + SP + NO_XLA, "tensor_2"),
    # Each shard's attention and MLP compiled on its device, forward and backward.
    "sequence_2_xla": (TENSOR_2 + SP + ["--jit_compile=true"], "tensor_2"),
    # The stages join the slices where they leave; --remat (full) joins each block's.
    "sequence_2_x_pipeline_2_remat": (["--num_cpu_devices=4", "--pipeline_stages=2",
                                       "--tensor_parallel=2", "--microbatches=2", "--remat"] + SP
                                      + NO_XLA, "tensor_2"),
    "llama_tensor_2": (LLAMA + TENSOR_2 + NO_XLA, None),
    "llama_sequence_2": (LLAMA + TENSOR_2 + SP + NO_XLA, "llama_tensor_2"),
}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
  """{name: its engine, loss, canonical gradients, kept bytes per device and plan.json}."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tokens = tf.constant(np.arange(8 * SEQ).reshape(8, SEQ) % 256, tf.int32)
  targets = tf.roll(tokens, -1, axis=1)
  out = {}
  for name, (args, _) in STEPPED.items():
    model_dir = tmp_path_factory.mktemp(name)
    engine = build_engine(BASE + args + [f"--model_dir={model_dir}"])
    step = tf.function(engine.copies[0].pipeline.loss_and_grads).get_concrete_function(
        tokens, targets)
    loss, grads = step(tokens, targets)
    with open(model_dir / "plan.json") as f:
      plan = json.load(f)
    out[name] = dict(engine=engine, loss=float(loss), plan=plan,
                     grads=canonical_grads(engine.copies[0].model, grads),
                     kept=kept_bytes_per_device(step.graph))
  return out


@pytest.mark.parametrize("name", [n for n, (_, twin) in STEPPED.items() if twin])
def test_the_split_gives_the_unsplit_loss_and_every_gradient(steps, name):
  split, plain = steps[name], steps[STEPPED[name][1]]
  assert not any(b.placement.sequence_parallel for b in plain["engine"].copies[0].model.blocks)
  assert all(b.placement.sequence_parallel for b in split["engine"].copies[0].model.blocks)
  np.testing.assert_allclose(split["loss"], plain["loss"], rtol=1e-5)
  assert sorted(split["grads"]) == sorted(plain["grads"])
  assert len(plain["grads"]) == (3 + 2 * 9 if "llama" in name else 4 + 2 * 16)
  scale = max(np.abs(g).max() for g in plain["grads"].values())
  for grad_name, want in plain["grads"].items():
    np.testing.assert_allclose(split["grads"][grad_name], want, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=grad_name)


def test_the_split_keeps_less_on_the_busiest_device_and_spreads_it(steps):
  plain, split = steps["tensor_2"]["kept"], steps["sequence_2"]["kept"]
  print(f"kept for the backward, bytes per device: tensor 2 {plain}, + sequence parallel {split}")
  assert sorted(plain) == sorted(split) == ["CPU:0", "CPU:1"]
  # Without the split the LayerNorms and the residual stream sit whole on the first device;
  # with it each device keeps its slice of them (the head stays on the first device).
  assert max(split.values()) < max(plain.values())
  assert split["CPU:0"] - split["CPU:1"] < plain["CPU:0"] - plain["CPU:1"]


def test_plan_json_records_the_split_and_the_planner_predicts_its_bytes(steps):
  """plan.json: the split, its smaller predicted activations, the variables' measured bytes;
  tfpar.planner.cost's weights + optimizer on the busiest device within 10% of those, and
  its activations the runtime plan's (one formula: plan.activation_bytes_per_block)."""
  plain, split = steps["tensor_2"]["plan"], steps["sequence_2"]["plan"]
  assert (plain["sequence_parallel"], split["sequence_parallel"]) == (False, True)
  assert split["bytes_per_device"] == plain["bytes_per_device"]  # The weights do not move.
  acts = lambda plan: max(plan["activation_bytes_per_device"].values())
  assert acts(split) < acts(plain)
  cfg = steps["sequence_2"]["engine"].cfg
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


def test_the_planner_searches_the_split_and_models_its_memory():
  m = make_config(BASE + ["--model_dir=/tmp/tfpar-unused"]).model
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


@pytest.mark.parametrize("case", MEASURED)
def test_plan_json_predicts_what_the_allocator_holds_for_the_backward(memory, case):
  """plan.json's activations on the busiest device (tfpar's count: plan.tfpar_kept_per_position
  and head_activation_bytes, the planner's for --system=tfpar) against the bytes the step
  allocated and still holds when its backward starts there: within 10%."""
  predicted, measured = memory[case]["predicted"], memory[case]["measured"]
  assert list(predicted) == ["CPU:0"] and sorted(measured) in (["CPU:0"], ["CPU:0", "CPU:1"])
  assert abs(predicted["CPU:0"] / measured["CPU:0"] - 1) < 0.1, (predicted, measured)


def test_recompute_frees_what_it_recomputes(memory):
  """Grappler did not merge the recomputation back into the forward: selective recompute
  holds the attention cores' probabilities (a s^2 b / T per block) less on each device, and
  full recompute holds nothing on the second shard's device (only the blocks' inputs and the
  head, on the first)."""
  kept = {remat: memory[f"tensor_2/{remat}"]["measured"] for remat in REMATS}
  m = make_config(BASE + ["--model_dir=/tmp/tfpar-unused"]).model
  core = m.num_heads * m.seq_len ** 2 * 8 // 2 * 4  # batch 8, T = 2, float32
  for device in ("CPU:0", "CPU:1"):
    assert kept["none"][device] - kept["selective"][device] == pytest.approx(
        m.num_layers * core, rel=0.05)
  assert "CPU:1" not in kept["full"]
  assert kept["full"]["CPU:0"] < kept["selective"]["CPU:0"] / 2
