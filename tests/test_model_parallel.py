"""Model-parallel plans train exactly like one device: pipeline, tensor, hybrid, remat.

Every plan runs in this process on the 8 logical CPUs conftest sets up (the
multi-worker case in two local processes), on the TINY model for 5 steps,
with XLA on (each stage's or shard's forward and backward compiled on its
device) as by default, and must match the one_device loss (XLA on too) per
step within a relative 1e-5, gradient norms within 1e-4. One run without XLA
checks the uncompiled path the same way against one_device without XLA.
"""

import glob
import json
import os

import numpy as np
import pytest

import conftest
from conftest import (TINY, read_metrics, run_module_in_background, selected_tests_use,
                      train_in_process)

STEPS = 5
BASE = TINY + [f"--train_steps={STEPS}", "--eval_every=0", "--eval_steps=1",
               "--checkpoint_every=100"]
NO_XLA = ["--jit_compile=false"]


def losses(model_dir):
  return np.array([r["loss"] for r in read_metrics(model_dir)])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("one_device"))
  train_in_process(BASE + ["--strategy=one_device", f"--model_dir={model_dir}"])
  return model_dir


def assert_same_losses(model_dir, reference_dir):
  got, want = losses(model_dir), losses(reference_dir)
  assert len(got) == len(want) == STEPS
  np.testing.assert_allclose(got, want, rtol=1e-5)
  norms = [[r["grad_norm"] for r in read_metrics(d)] for d in (model_dir, reference_dir)]
  np.testing.assert_allclose(norms[0], norms[1], rtol=1e-4)  # The same (summed) gradient.


def test_pipeline_matches_one_device(one_device, tmp_path):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=4",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)
  assert os.path.exists(os.path.join(model_dir, "plan.json"))


def test_tensor_parallel_matches_one_device_and_resumes_as_a_pipeline(one_device, tmp_path,
                                                                      capsys):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--num_cpu_devices=2", "--tensor_parallel=2", "--checkpoint_every=3",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)
  # Back to step 3 (restore takes the newest checkpoint on disk, so ckpt-5 goes), then on
  # under another plan: steps 4 and 5 are trained again and still match one device.
  for path in glob.glob(os.path.join(model_dir, "checkpoints", "ckpt-5.*")):
    os.remove(path)
  last = train_in_process(BASE + ["--num_cpu_devices=2", "--pipeline_stages=2",
                                  "--microbatches=2", f"--model_dir={model_dir}"])
  assert last["train"]["step"] == 5  # This run trained (a run with nothing to do returns {}).
  assert capsys.readouterr().out.count(f"resumed from {model_dir}/checkpoints/ckpt-3 at step 3")
  assert [r["step"] for r in read_metrics(model_dir)] == [1, 2, 3, 4, 5]
  with open(os.path.join(model_dir, "metrics.jsonl.superseded")) as f:  # The first run's 4, 5.
    old = [json.loads(line) for line in f]
  assert [(r["kind"], r["step"]) for r in old] == [("train", 4), ("train", 5), ("eval", 5)]
  assert_same_losses(model_dir, one_device)


def test_hybrid_matches_one_device(one_device, tmp_path):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--strategy=mirrored", "--num_cpu_devices=8", "--data_parallel=2",
                           "--pipeline_stages=2", "--tensor_parallel=2", "--microbatches=2",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)


def test_pipeline_of_tensor_shards_without_xla_matches_one_device_without_xla(tmp_path):
  reference, model_dir = str(tmp_path / "one_device"), str(tmp_path / "split")
  train_in_process(BASE + NO_XLA + ["--strategy=one_device", f"--model_dir={reference}"])
  train_in_process(BASE + NO_XLA + ["--num_cpu_devices=4", "--pipeline_stages=2",
                                    "--tensor_parallel=2", "--microbatches=2",
                                    f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, reference)


def test_remat_of_tensor_shards_under_xla_matches_one_device(one_device, tmp_path):
  """--remat (full) recomputes each block inside tf.gradients' colocation with its input:
  shard 1's recomputed forward must still run on shard 1's device (XLA refuses to read
  a variable across devices, which is how this combination once failed)."""
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--remat", "--num_cpu_devices=2", "--tensor_parallel=2",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)


@pytest.mark.parametrize("plan", [[], ["--num_cpu_devices=4", "--pipeline_stages=2",
                                       "--tensor_parallel=2", "--microbatches=2"]],
                         ids=["one_device", "pipeline_of_tensor_shards"])
def test_selective_remat_matches_one_device(one_device, tmp_path, plan):
  """--remat=selective (each shard's attention core recomputed, under XLA) vs no remat."""
  model_dir = str(tmp_path)
  train_in_process(BASE + plan + ["--remat=selective", f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)
  with open(os.path.join(model_dir, "plan.json")) as f:
    assert json.load(f)["remat"] == "selective"


@pytest.fixture(scope="module", autouse=True)
def two_workers(request, tmp_path_factory):
  """(model_dir, Future of its CompletedProcess): the two-worker hybrid, started with the
  file's first test, when selected, so that its processes take the second core while
  the in-process plans train on the first."""
  if not selected_tests_use(request, "two_workers_run"):
    return None
  model_dir = str(tmp_path_factory.mktemp("two_workers"))
  return model_dir, run_module_in_background("tfpar.launch", ["--num_workers=2", "--"] + BASE + [
      "--strategy=multi_worker_mirrored", "--num_cpu_devices=2", "--pipeline_stages=2",
      "--microbatches=2", "--input_sharding=data", "--optimizer_sharding=zero1",
      f"--model_dir={model_dir}"], timeout=300)


@pytest.fixture(scope="module")
def two_workers_run(two_workers):
  model_dir, future = two_workers
  future.result()  # Raises, with its output, where the job exited non-zero.
  return model_dir


def test_hybrid_across_two_worker_processes(one_device, two_workers_run):
  """D=2 over two local workers (the all-reduce crosses processes), K=2 stages in each, under
  --optimizer_sharding=zero1 (each worker's shards of m and v; the new weights all-gathered
  across the processes, the slots gathered at the save: tests/test_zero_hybrid.py twins it
  in one process)."""
  assert_same_losses(two_workers_run, one_device)
  with open(os.path.join(two_workers_run, "plan.json")) as f:
    assert json.load(f)["optimizer_sharding"] == "zero1"


# --- placement and checkpoints (engines built, not trained) ------------------------

PLANS = {
    "one_device": ["--strategy=one_device"],
    "pipeline": ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=4"],
    "tensor": ["--num_cpu_devices=2", "--tensor_parallel=2"],
    "hybrid": ["--strategy=mirrored", "--num_cpu_devices=8", "--data_parallel=2",
               "--pipeline_stages=2", "--tensor_parallel=2", "--microbatches=2"],
}


def build_engine(plan_args, model_dir):
  """The engine the runner would build for these flags (conftest.build_engine)."""
  return conftest.build_engine(BASE + plan_args + [f"--model_dir={model_dir}"])


def test_each_device_holds_its_planned_share(tmp_path):
  engine = build_engine(PLANS["hybrid"] + ["--num_layers=4", "--stage_layers=1,3"], tmp_path)
  predicted, measured = engine.plan.bytes_per_device(), engine.measured_bytes()
  assert sorted(measured) == sorted(predicted) and len(measured) == 8
  for device, want in predicted.items():
    for kind in ("parameters", "optimizer"):
      assert abs(measured[device][kind] - want[kind]) <= 0.1 * want[kind], (device, kind)
  # The split is real: no device holds more than its stage's share.
  total = sum(b["parameters"] for b in measured.values()) / 2  # per replica
  assert max(b["parameters"] for b in measured.values()) < 0.5 * total


def test_checkpoint_from_any_plan_restores_under_any_other(tmp_path):
  from tfpar.training.checkpoint import (  # pylint: disable=import-outside-toplevel
      CanonicalCheckpointer, assign_canonical, read_canonical)
  engines = {name: build_engine(args, tmp_path / name) for name, args in PLANS.items()}
  rng = np.random.default_rng(0)
  for source, engine in engines.items():
    # Distinct weights and AdamW slots, the same in every copy of the source.
    values = {name: (np.array(7, v.dtype) if v.ndim == 0 else
                     rng.normal(size=v.shape).astype(v.dtype))
              for name, v in read_canonical(engine.layouts[0]).items()}
    for layout in engine.layouts:
      assign_canonical(layout, values)
    directory = str(tmp_path / f"ckpt_{source}")
    path = CanonicalCheckpointer(engine.layouts, directory).save(7)
    for target, other in engines.items():
      assert CanonicalCheckpointer(other.layouts, directory).restore(path)
      assert other.step == 7
      for copy in other.layouts:  # Every replica copy of the target.
        restored = read_canonical(copy)
        assert sorted(restored) == sorted(values), (source, target)
        for name, want in values.items():
          np.testing.assert_array_equal(restored[name], want, err_msg=f"{source}->{target} {name}")


def gradient_graph_ops(args, model_dir):
  """{op type: count} in the pipeline's loss-and-gradients graph (without XLA: ops in it)."""
  import collections  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  engine = build_engine(PLANS["pipeline"] + NO_XLA + args, model_dir)
  tokens = tf.zeros([8, 32], tf.int32)
  graph = tf.function(engine.copies[0].pipeline.loss_and_grads).get_concrete_function(
      tokens, tokens).graph
  return collections.Counter(op.type for op in graph.get_operations())


def test_remat_recomputes_each_block_in_the_backward(tmp_path):
  matmuls = lambda args: sum(gradient_graph_ops(args, tmp_path / "_".join(args or ["plain"]))[t]
                             for t in ("MatMul", "BatchMatMulV2", "Einsum"))
  # Each of the 2 blocks runs its forward matmuls (8) once more in the backward pass.
  assert matmuls(["--remat"]) >= matmuls([]) + 2 * 8


def test_selective_remat_recomputes_only_the_attention_core(tmp_path):
  none, selective = (gradient_graph_ops(args, tmp_path / name) for name, args in
                     (("none", ["--noremat"]), ("selective", ["--remat=selective"])))
  cores = none["Softmax"]  # One per block and micro-batch: 2 blocks x 4 micro-batches.
  assert cores == 2 * 4
  # Each core's forward runs once more: its softmax and its two batched matmuls (QK^T, PV) ...
  assert selective["Softmax"] == 2 * cores
  assert selective["BatchMatMulV2"] == none["BatchMatMulV2"] + 2 * cores
  # ... and nothing else: no projection or MLP matmul, no LayerNorm, is recomputed.
  for op in ("MatMul", "Mean", "Rsqrt", "Einsum"):
    assert selective[op] == none[op], op
