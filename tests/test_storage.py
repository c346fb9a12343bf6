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


def test_a_newest_checkpoint_without_its_index_is_named_when_skipped(tmp_path, run_to_4, capsys):
  """Its data files alone: once passed over for ckpt-2 without a word."""
  import shutil  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  shutil.copytree(run_to_4, model_dir)
  os.remove(os.path.join(model_dir, "checkpoints", "ckpt-4.index"))
  train_in_process(FAST + ["--train_steps=4", "--checkpoint_every=2", "--eval_steps=0",
                           "--min_lr_ratio=1.0", f"--model_dir={model_dir}"])
  out = capsys.readouterr().out
  [warning] = [line for line in out.splitlines() if "unreadable" in line]
  assert "ckpt-4 (its ckpt-4.index is missing" in warning and "restored ckpt-2" in warning, out


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


def test_a_metrics_line_cut_short_is_set_aside_on_resume(tmp_path, run_to_4, capsys):
  """A pod killed mid-write leaves half a record: the resumed run used to glue its first one onto it."""
  import shutil  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  shutil.copytree(run_to_4, model_dir)
  path = os.path.join(model_dir, "metrics.jsonl")
  with open(path, "a") as f:
    f.write('{"kind": "train", "step": 5, "lo')  # no newline: the write was cut here
  train_in_process(FAST + ["--train_steps=5", "--checkpoint_every=2", "--eval_steps=0",
                           "--min_lr_ratio=1.0", f"--model_dir={model_dir}"])
  warnings = [line for line in capsys.readouterr().out.splitlines() if "cut short" in line]
  assert len(warnings) == 1, warnings
  with open(path) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5]  # every line whole JSON
  with open(path + ".superseded") as f:
    assert f.read() == '{"kind": "train", "step": 5, "lo\n'


def test_metrics_never_glue_a_record_to_a_partial_line(tmp_path):
  """Without drop_after (a first write into a dir with an old file) the first write sets it aside."""
  from tfpar.training.metrics import MetricsWriter  # pylint: disable=import-outside-toplevel
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tr')
  MetricsWriter(str(tmp_path)).write({"kind": "train", "step": 3, "loss": 1.5})
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
  assert (tmp_path / "metrics.jsonl.superseded").read_text() == '{"kind": "tr\n'
  path.write_text('{"kind": "train", "step": 1}')  # whole, only its newline lost: kept
  MetricsWriter(str(tmp_path)).write({"kind": "train", "step": 2, "loss": 1.5})
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_keep_checkpoints_counts_the_checkpoints_on_disk_across_restarts(tmp_path, run_to_4):
  """Each restart used to forget the older checkpoints: ckpt-2, 4, 6, 8... piled up."""
  import shutil  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  shutil.copytree(run_to_4, model_dir)  # ckpt-2 and ckpt-4, from another process
  train_in_process(FAST + ["--train_steps=6", "--checkpoint_every=2", "--eval_steps=0",
                           "--min_lr_ratio=1.0", "--keep_checkpoints=2", f"--model_dir={model_dir}"])
  checkpoints = os.path.join(model_dir, "checkpoints")
  assert [s for s, _ in list_checkpoints(checkpoints)] == [6, 4]
  assert sorted(n for n in os.listdir(checkpoints) if n.startswith("ckpt-2")) == []  # data too
  train_in_process(FAST + ["--train_steps=7", "--checkpoint_every=2", "--eval_steps=0",
                           "--min_lr_ratio=1.0", "--keep_checkpoints=1", f"--model_dir={model_dir}"])
  assert sorted(os.listdir(checkpoints)) == ["checkpoint", "ckpt-7.data-00000-of-00001",
                                             "ckpt-7.index"]
