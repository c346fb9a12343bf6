"""Training: mirrored equals one device, XLA equals no XLA, resume continues exactly,
mixed precision trains as float32 does (bfloat16 without XLA, its default), and the CLI end
to end.

In-process runs (conftest.train_in_process) share one TensorFlow with 8 logical
CPUs; they use --jit_compile=false unless XLA is the subject, because a
4-replica XLA compile alone costs ~25 s on 2 cores.
"""

import glob
import json
import math
import os

import sys

import numpy as np
import pytest

from conftest import (REPO, TINY, in_background, make_config, read_metrics, run_module,
                      run_module_in_background, selected_tests_use, train_in_process)
from tfpar.training.checkpoint import read_checkpoint

sys.path.insert(0, os.path.join(REPO, "scripts"))
import dp_profile  # pylint: disable=wrong-import-position

FAST = TINY + ["--jit_compile=false"]


def losses(model_dir):
  return np.array([r["loss"] for r in read_metrics(model_dir)])


def checkpoint(model_dir, step):
  return read_checkpoint(os.path.join(model_dir, "checkpoints", f"ckpt-{step}"))


def weights(state):
  """The model's weights in a canonical checkpoint (no optimizer slots or step)."""
  return {k: v for k, v in state.items() if "@" not in k and not k.startswith("optimizer/")}


def assert_same_weights(a, b, rtol, atol=0.0):
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


# XLA is left off for time (a compile costs more than this whole run); the in-process
# XLA test covers that path.
CLI_ARGS = FAST + ["--train_steps=10", "--eval_every=5", "--checkpoint_every=5",
                   "--profile_steps=3,4"]


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
  """test_cli_end_to_end's process, started before this module's in-process runs.

  Its own `python -m tfpar.train`, as before; it only runs beside them.
  """
  if not selected_tests_use(request, "cli_run"):
    return None
  model_dir = str(tmp_path_factory.mktemp("cli") / "run")
  # The host's BFC allocator, whose counters tfpar reads for the allocator peak (plan.json).
  return model_dir, run_module_in_background("tfpar.train", CLI_ARGS + [f"--model_dir={model_dir}"],
                                             env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})


# mixed_bfloat16 as a user gets it from the CLI (no XLA for the step, XLA's auto-clustering of
# the fusible ops set up before TensorFlow starts), under the data-parallel engine and the
# model-parallel one; --verbosity=0 brings back TensorFlow's C++ lines, which say XLA compiled.
BF16_CLI = {"mirrored_2": ["--strategy=mirrored", "--num_cpu_devices=2"],
            "pipeline_2_x_tensor_2": ["--num_cpu_devices=4", "--pipeline_stages=2",
                                      "--tensor_parallel=2", "--microbatches=2"]}


@pytest.fixture(scope="module", autouse=True)
def bf16_started(request, tmp_path_factory):
  """{plan: (model_dir, Future of its CLI runs)}, one after the other beside the in-process tests."""
  if not selected_tests_use(request, "bf16_cli_runs"):
    return None
  dirs = {name: str(tmp_path_factory.mktemp(name) / "run") for name in BF16_CLI}
  runs = lambda: {name: run_module("tfpar.train", MIXED + args + [
      "--precision=mixed_bfloat16", f"--model_dir={dirs[name]}", "--verbosity=0"])
                  for name, args in BF16_CLI.items()}
  return dirs, in_background(runs)


@pytest.fixture(scope="module")
def bf16_cli_runs(bf16_started):
  dirs, future = bf16_started
  return {name: (dirs[name], proc) for name, proc in future.result().items()}


@pytest.fixture(scope="module")
def cli_run(started):
  """(model_dir, CompletedProcess) of the CLI run end to end."""
  model_dir, future = started
  return model_dir, future.result()


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
  """3 steps on one device without XLA: the serial twin of the runs below."""
  model_dir = str(tmp_path_factory.mktemp("one_device"))
  train_in_process(FAST + ["--train_steps=3", f"--model_dir={model_dir}"])
  return model_dir


def test_mirrored_on_4_devices_matches_one_device(tmp_path, one_device_run):
  # Under XLA: each replica's forward and backward, then (after the exchange) its update,
  # each one XLA program (AdamW.compile_update), against one device without XLA.
  four = str(tmp_path / "four")
  train_in_process(FAST + ["--train_steps=3", f"--model_dir={four}", "--strategy=mirrored",
                           "--num_cpu_devices=4", "--jit_compile=true"])
  assert [r["replicas"] for r in read_metrics(four)] == [4, 4, 4]
  one = losses(one_device_run)
  assert len(set(one.tolist())) == 3  # the steps saw different batches and weights
  np.testing.assert_allclose(losses(four), one, rtol=1e-4)
  np.testing.assert_allclose(read_metrics(four, "eval")[0]["loss"],
                             read_metrics(one_device_run, "eval")[0]["loss"], rtol=1e-4)
  # Same updates, not just the same losses. Adam divides by sqrt(v), which magnifies
  # rounding in near-zero gradients, hence atol; a wrong gradient scale moves weights
  # by ~learning_rate (3e-3) per step.
  assert_same_weights(weights(checkpoint(four, 3)), weights(checkpoint(one_device_run, 3)),
                      rtol=1e-4, atol=2e-5)


def test_the_run_records_its_peak_beside_what_the_plan_puts_in_its_memory(one_device_run):
  """plan.json's process_memory: the peak RSS, and the plan's weights, gradient, AdamW slots
  and activations on this process's devices (one_device names its device /job:localhost)."""
  with open(os.path.join(one_device_run, "plan.json"), encoding="utf-8") as f:
    plan = json.load(f)
  (state,) = plan["bytes_per_device"].values()
  memory = plan["process_memory"]["worker 0"]
  assert (2 * state["parameters"] + state["optimizer"] < memory["predicted_host_bytes"]
          < memory["peak_rss_bytes"]), (state, memory)


def test_xla_and_no_xla_give_the_same_loss(tmp_path, one_device_run):
  xla = str(tmp_path / "xla")
  train_in_process(TINY + ["--train_steps=2", "--jit_compile=true", "--eval_steps=0",
                           f"--model_dir={xla}"])
  np.testing.assert_allclose(losses(xla), losses(one_device_run)[:2], rtol=1e-4)


@pytest.mark.parametrize("dropout", ["0.0", "0.1"])
def test_resume_continues_exactly(tmp_path, dropout):
  # --min_lr_ratio=1: a constant rate after warmup, so that the schedule does not depend
  # on --train_steps and a run stopped at 3 is the same run as the first 3 steps of 6.
  args = FAST + [f"--dropout={dropout}", "--min_lr_ratio=1.0", "--train_steps=6"]
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  train_in_process(args + [f"--model_dir={straight}"])
  train_in_process(args + [f"--model_dir={resumed}", "--train_steps=3"])
  assert int(checkpoint(resumed, 3)["optimizer/iterations"]) == 3
  # A run that died after logging step 4 but before checkpointing it.
  with open(os.path.join(resumed, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"kind": "train", "step": 4, "loss": 99.0}) + "\n")
  train_in_process(args + [f"--model_dir={resumed}"])

  records = read_metrics(resumed)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # none twice, none skipped
  assert [r["step"] for r in read_metrics(resumed, "eval")] == [3, 6]
  # Same data position, optimizer state, schedule and dropout RNG: the same numbers.
  np.testing.assert_allclose(losses(resumed), losses(straight), rtol=1e-6)
  np.testing.assert_allclose([r["learning_rate"] for r in records],
                             [r["learning_rate"] for r in read_metrics(straight)], rtol=1e-6)
  final, middle = checkpoint(resumed, 6), checkpoint(resumed, 3)
  assert int(final["optimizer/iterations"]) == 6
  assert_same_weights(final, checkpoint(straight, 6), rtol=1e-6)  # slots and RNG included
  rng = [k for k in final if k.startswith("dropout_rng/")]
  assert len(rng) == (5 if float(dropout) else 0)  # embedding + 2 per block
  assert all(not np.array_equal(final[k], middle[k]) for k in rng)  # the RNG state is live


MIXED = TINY + ["--train_steps=8", "--eval_steps=0"]


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory):
  """8 steps in float32 without XLA: the twin of the mixed-precision runs."""
  model_dir = str(tmp_path_factory.mktemp("float32"))
  train_in_process(MIXED + ["--jit_compile=false", f"--model_dir={model_dir}"])
  return model_dir


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains(tmp_path, precision, float32_run):
  model_dir = str(tmp_path / precision)
  # mixed_bfloat16 as a user gets it: without XLA by default (config.jit_compile_default).
  args = MIXED + [f"--precision={precision}", f"--model_dir={model_dir}"] + \
      (["--jit_compile=false"] if precision == "mixed_float16" else [])
  assert make_config(args).train.jit_compile is False
  train_in_process(args)
  values = losses(model_dir)
  assert len(values) == 8 and np.all(np.isfinite(values))
  assert values[-2:].mean() < values[:2].mean() - 0.1, values
  # float32's losses step by step, up to 16-bit rounding (bfloat16 keeps 8 significant
  # bits, ~0.4% per value; the 8 losses agreed to 4e-5 on 4 December), and not equal to
  # them: the 16-bit compute really ran.
  reference = losses(float32_run)
  np.testing.assert_allclose(values, reference, rtol=1e-3)
  assert np.abs(values - reference).max() > 1e-5, values
  assert all(math.isfinite(r["grad_norm"]) for r in read_metrics(model_dir))
  # The checkpoint holds float32 master weights.
  assert checkpoint(model_dir, 8)["wte/embeddings"].dtype == np.float32


def test_cli_end_to_end(cli_run):
  model_dir, proc = cli_run
  assert "step     10/10" in proc.stdout  # the progress line a person watches
  # The ETA leaves out the first (tracing) call: none after step 1, one from step 2 on.
  progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
  assert "| ETA -- |" in progress[0] and all("ETA --" not in p for p in progress[1:]), progress
  # Steps 3-4 traced where TensorBoard's Profile tab looks, and the trace holds the step's ops.
  assert "profiled steps 3-4 into" in proc.stdout
  traces = glob.glob(os.path.join(model_dir, "plugins", "profile", "*", "*.xplane.pb"))
  assert len(traces) == 1
  # scripts/dp_profile.py splits each traced step's wall time into parts that add up to it.
  parts = dp_profile.breakdown(model_dir, steps=2)
  assert parts["step"] > 0 and parts["update"] > 0 and parts["exchange"] == 0  # One device.
  assert sum(parts[p] for p in dp_profile.PARTS + ("idle",)) == pytest.approx(parts["step"])
  # What runs, in a sentence, first; none of TensorFlow's C++ start-up lines (cuInit, ...).
  assert proc.stdout.startswith("tfpar: training a 2-layer GPT of "), proc.stdout[:500]
  assert proc.stderr.strip() == "", proc.stderr[-2000:]
  train = read_metrics(model_dir)
  assert [r["step"] for r in train] == list(range(1, 11))
  for r in train:
    assert {"kind", "step", "loss", "learning_rate", "tokens_per_sec"} <= set(r)
    assert r["tokens_per_sec"] > 0 and r["learning_rate"] > 0
  evals = read_metrics(model_dir, "eval")
  assert [r["step"] for r in evals] == [5, 10]
  for r in evals:
    assert set(r) == {"kind", "step", "loss", "perplexity", "loss_per_byte"}
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    assert r["loss_per_byte"] == pytest.approx(r["loss"])  # Bytes: one byte per token.
  values = losses(model_dir)
  assert values[-3:].mean() < values[:3].mean() - 0.1, values  # visibly falling
  # The allocator's peak over step 2 (the first call after tracing), beside the prediction:
  # what was held before it includes the weights and slots; what the step added on top, its
  # gradients and the activations the backward keeps, is the plan's count within 25%.
  with open(os.path.join(model_dir, "plan.json")) as f:
    plan = json.load(f)
  peak = plan["allocator_peak"]
  assert peak["steps"] == [2, 2] and list(peak["allocators"]) == ["CPU"]
  cpu = peak["allocators"]["CPU"]
  (measured,) = plan["measured_bytes_per_device"].values()
  assert cpu["held_bytes"] >= measured["parameters"] + measured["optimizer"]
  assert cpu["added_bytes"] == cpu["peak_bytes"] - cpu["held_bytes"]
  assert cpu["added_bytes"] == pytest.approx(cpu["predicted_added_bytes"], rel=0.25), cpu
  assert "memory during step 2, allocator: CPU held" in proc.stdout
  assert evals[1]["loss"] < evals[0]["loss"]
  ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "checkpoints",
                                                                     "ckpt-*.index")))
  assert ckpts == ["ckpt-10.index", "ckpt-5.index"]
  for kind in ("train", "eval"):
    assert glob.glob(os.path.join(model_dir, kind, "events.out.tfevents.*")), kind
  assert os.path.exists(os.path.join(model_dir, "config.json"))


def test_help_lists_tfpar_flags_and_how_to_run():
  """--help used to print the module's developer notes and no flag (only --helpfull had them)."""
  proc = run_module("tfpar.train", ["--help"])
  assert proc.stdout.startswith("Trains a transformer in parallel: python -m tfpar.train")
  for flag in ("--model_dir", "--strategy", "--pipeline_stages", "--data", "--train_steps"):
    assert f"  {flag}:" in proc.stdout, flag


# Last in the file: its CLI runs (bf16_started) train beside every in-process test above.
@pytest.mark.parametrize("plan", BF16_CLI)
def test_bfloat16_by_default_auto_clusters_the_fusible_ops_and_trains_as_float32(
    plan, bf16_cli_runs, float32_run):
  model_dir, proc = bf16_cli_runs[plan]
  what = next(line for line in proc.stdout.splitlines() if "training a" in line)
  assert "XLA auto-clustering of the fusible ops" in what and "asked for but off" not in what
  assert "Compiled cluster using XLA" in proc.stderr  # XLA ran, though the step is not compiled.
  values = losses(model_dir)
  reference = losses(float32_run)  # One device's float32: every plan's twin in float32.
  assert len(values) == 8 and values[-2:].mean() < values[:2].mean() - 0.1, values
  np.testing.assert_allclose(values, reference, rtol=1e-3)
  assert np.abs(values - reference).max() > 1e-5, values  # 16-bit compute really ran.
