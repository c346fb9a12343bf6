"""Model-parallel plans train exactly like one device: pipeline, tensor, hybrid, remat.

Every plan runs in this process on the 8 logical CPUs conftest sets up (the
multi-worker case in two local processes), on the TINY model for 5 steps,
and must match the one_device loss per step within a relative 1e-4.
"""

import os

import numpy as np
import pytest

from conftest import TINY, read_metrics, run_module, train_in_process

STEPS = 5
# XLA off on both sides: a model-parallel step spans devices and runs without it.
BASE = TINY + [f"--train_steps={STEPS}", "--eval_every=0", "--eval_steps=1",
               "--checkpoint_every=100", "--jit_compile=false"]


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
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_pipeline_matches_one_device(one_device, tmp_path):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=4",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)
  assert os.path.exists(os.path.join(model_dir, "plan.json"))


def test_tensor_parallel_matches_one_device(one_device, tmp_path):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--num_cpu_devices=2", "--tensor_parallel=2",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)


def test_hybrid_matches_one_device(one_device, tmp_path):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--strategy=mirrored", "--num_cpu_devices=8", "--data_parallel=2",
                           "--pipeline_stages=2", "--tensor_parallel=2", "--microbatches=2",
                           f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)


def test_remat_matches_one_device(one_device, tmp_path):
  model_dir = str(tmp_path)
  train_in_process(BASE + ["--remat", f"--model_dir={model_dir}"])
  assert_same_losses(model_dir, one_device)


def test_hybrid_across_two_worker_processes(one_device, tmp_path):
  """D=2 over two local workers (the all-reduce crosses processes), K=2 stages in each."""
  model_dir = str(tmp_path)
  run_module("tfpar.launch", ["--num_workers=2", "--"] + BASE + [
      "--strategy=multi_worker_mirrored", "--num_cpu_devices=2", "--pipeline_stages=2",
      "--microbatches=2", "--input_sharding=data", f"--model_dir={model_dir}"], timeout=300)
  assert_same_losses(model_dir, one_device)
