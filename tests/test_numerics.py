"""NaN and infinity: --on_nonfinite=stop ends the run without saving, =skip drops the update.

The NaN is real, not injected into a mock: --learning_rate=1e30 moves the
weights so far in one update that the next forward pass overflows (steps 1-2
are finite: warmup starts the rate at 0; step 3's loss is NaN). Nothing of
TensorFlow is replaced.
"""

import json
import os

import numpy as np
import pytest

from conftest import TINY, run_module, train_in_process
from tfpar.training.checkpoint import list_checkpoints, read_checkpoint

FAST = TINY + ["--jit_compile=false", "--eval_steps=0"]
BLOW_UP = ["--learning_rate=1e30"]


def strict_records(model_dir):
  """metrics.jsonl as JSON that refuses the bare NaN/Infinity Python's json would accept."""
  def refuse(constant):
    raise AssertionError(f"metrics.jsonl holds a bare {constant}: not JSON")
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]


def steps_on_disk(model_dir):
  return sorted(step for step, _ in list_checkpoints(os.path.join(model_dir, "checkpoints")))


def test_stop_names_the_step_exits_3_and_keeps_the_last_good_checkpoint(tmp_path):
  model_dir = str(tmp_path / "run")
  args = FAST + [f"--model_dir={model_dir}", "--checkpoint_every=2", "--keep_checkpoints=1"]
  train_in_process(args + ["--train_steps=2"])  # a good run to step 2
  good = read_checkpoint(os.path.join(model_dir, "checkpoints", "ckpt-2"))
  proc = run_module("tfpar.train", args + ["--train_steps=8"] + BLOW_UP, check=False)
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  errors = proc.stderr.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith("tfpar.train: error: step 4: loss nan"), \
      proc.stderr
  assert "--on_nonfinite" in errors[0]
  # Step 3 ran (finite loss, the huge update); step 4 is NaN: nothing saved after step 2,
  # and with --keep_checkpoints=1 the good checkpoint was not rotated out.
  assert steps_on_disk(model_dir) == [2]
  after = read_checkpoint(os.path.join(model_dir, "checkpoints", "ckpt-2"))
  assert all(np.array_equal(good[k], after[k]) for k in good)
  records = strict_records(model_dir)
  assert records[-1] == {"kind": "nonfinite", "step": 4, "loss": None, "grad_norm": None}
  assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]


@pytest.mark.parametrize("plan", [
    ["--strategy=mirrored", "--num_cpu_devices=2"],  # the update's cond in cross-replica context
    ["--pipeline_stages=2", "--num_cpu_devices=2"],  # the model-parallel engine's own apply
], ids=["mirrored", "pipeline"])
def test_skip_drops_exactly_the_nonfinite_updates_and_counts_them(tmp_path, plan):
  model_dir = str(tmp_path / "run")
  train_in_process(FAST + plan + BLOW_UP + [
      f"--model_dir={model_dir}", "--train_steps=6", "--checkpoint_every=2",
      "--keep_checkpoints=3", "--on_nonfinite=skip"])
  records = [r for r in strict_records(model_dir) if r["kind"] == "train"]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
  assert records[-1]["skipped_total"] == 4
  assert records[1]["loss"] is not None and records[2]["loss"] is None  # null, not NaN
  # Steps 3-6 were dropped: the weights and AdamW slots at 4 and 6 are those after step 2,
  # while the step counter (schedule and data position) went on.
  ckpt = {s: read_checkpoint(os.path.join(model_dir, "checkpoints", f"ckpt-{s}"))
          for s in (2, 4, 6)}
  for name, value in ckpt[2].items():
    if name == "optimizer/iterations":
      continue
    assert np.all(np.isfinite(ckpt[6][name])), name
    np.testing.assert_array_equal(ckpt[6][name], value, err_msg=name)
    np.testing.assert_array_equal(ckpt[4][name], value, err_msg=name)
  assert [int(ckpt[s]["optimizer/iterations"]) for s in (2, 4, 6)] == [2, 4, 6]
