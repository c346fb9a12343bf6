"""Storage: every file of a run through tf.io.gfile, and checkpoints that survive being cut short.

A `ram://` model dir (TensorFlow's in-memory filesystem, alive as long as this
process) proves that no file of a run assumes a local path: with plain
`open`/`os.makedirs` the files would land in a local './ram:' directory instead.
"""

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import TINY, train_in_process
from tfpar.training.checkpoint import CheckpointUnreadableError, list_checkpoints

FAST = TINY + ["--jit_compile=false"]


def ram_records(path):
  with tf.io.gfile.GFile(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_a_ram_model_dir_holds_every_file_of_a_run_and_resumes_from_it(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # where a local './ram:/...' would appear
  model_dir = "ram://tfpar-storage-test/run"
  args = FAST + ["--pipeline_stages=2", "--num_cpu_devices=2", "--checkpoint_every=2",
                 "--eval_every=2", f"--model_dir={model_dir}"]
  train_in_process(args + ["--train_steps=2"])
  files = {os.path.relpath(os.path.join(root, name), model_dir)
           for root, _, names in tf.io.gfile.walk(model_dir) for name in names}
  assert {"config.json", "plan.json", "metrics.jsonl", "checkpoints/checkpoint",
          "checkpoints/ckpt-2.index"} <= files, files
  assert any(f.startswith("train/events.out.tfevents") for f in files), files
  assert any(f.startswith("eval/events.out.tfevents") for f in files), files
  train_in_process(args + ["--train_steps=4"])  # resumes from ram://.../ckpt-2
  records = ram_records(f"{model_dir}/metrics.jsonl")
  assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
  assert [s for s, _ in list_checkpoints(f"{model_dir}/checkpoints")] == [4, 2]
  assert os.listdir(tmp_path) == []  # nothing local


@pytest.fixture(scope="module")
def run_to_4(tmp_path_factory):
  """A run with checkpoints at steps 2 and 4 (copied afresh by each test)."""
  model_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
  train_in_process(FAST + ["--train_steps=4", "--checkpoint_every=2", "--eval_steps=0",
                           "--min_lr_ratio=1.0", f"--model_dir={model_dir}"])
  return model_dir


def truncate_data(model_dir, step):
  [data] = glob.glob(os.path.join(model_dir, "checkpoints", f"ckpt-{step}.data-*"))
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) // 2)


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, run_to_4,
                                                                      capsys):
  import shutil  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  shutil.copytree(run_to_4, model_dir)
  truncate_data(model_dir, 4)
  # And the state file is gone: the checkpoints are found from their own files.
  os.remove(os.path.join(model_dir, "checkpoints", "checkpoint"))
  train_in_process(FAST + ["--train_steps=5", "--checkpoint_every=2", "--eval_steps=0",
                           "--min_lr_ratio=1.0", f"--model_dir={model_dir}"])
  out = capsys.readouterr().out
  warnings = [line for line in out.splitlines() if "unreadable" in line]
  assert len(warnings) == 1 and "ckpt-4" in warnings[0] and "restored ckpt-2" in warnings[0], out
  assert "at step 2" in out
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == [1, 2, 3, 4, 5]  # 3 and 4 ran again, from ckpt-2
  with open(os.path.join(model_dir, "metrics.jsonl.superseded")) as f:
    superseded = {r["step"]: r["loss"] for r in map(json.loads, f)}
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    rerun = {r["step"]: r["loss"] for r in map(json.loads, f)}
  # The same state and data position as the first time: the same losses.
  np.testing.assert_allclose([rerun[3], rerun[4]], [superseded[3], superseded[4]], rtol=1e-6)
  assert [s for s, _ in list_checkpoints(os.path.join(model_dir, "checkpoints"))] == [5, 4, 2]


def test_every_checkpoint_unreadable_is_one_clear_error_not_a_restart(tmp_path, run_to_4):
  import shutil  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  shutil.copytree(run_to_4, model_dir)
  truncate_data(model_dir, 4)
  truncate_data(model_dir, 2)
  with open(os.path.join(model_dir, "checkpoints", "checkpoint"), "w") as f:
    f.write("this is not a checkpoint state\n")
  with pytest.raises(CheckpointUnreadableError) as info:
    train_in_process(FAST + ["--train_steps=6", "--eval_steps=0", "--min_lr_ratio=1.0",
                             f"--model_dir={model_dir}"])
  message = str(info.value)
  assert "\n" not in message and "ckpt-4" in message and "ckpt-2" in message
