"""--task=classify: the ViT's shapes, its parallel twins, its checkpoints, its bad input.

The parallel runs train the ViT in this process on the 8 logical CPUs
conftest sets up, for 3 steps, and must match one device's loss at every
step within a relative 1e-5 (and its gradient norm, and held-out accuracy):
the same engines, plans and checkpoints as the GPT, through the task seam.
"""

import os

import numpy as np
import pytest

from conftest import make_config, read_metrics, run_modules, train_in_process

STEPS = 3
# A tiny ViT on the digits: 8x8 images in 2x2 patches (16 + a class token), 2 blocks.
# No warmup: the classifier starts at zero (every step-1 loss is ln 10, whatever the
# batch), so step 1 must already update it for steps 2 and 3 to depend on the data.
VIT = ["--task=classify", "--image_size=8", "--patch_size=2", "--num_layers=2", "--d_model=32",
       "--num_heads=4", "--d_ff=64", "--global_batch_size=16", "--learning_rate=3e-3",
       "--warmup_steps=0", "--log_every=1", "--steps_per_call=1", "--eval_every=0",
       "--eval_steps=2", f"--train_steps={STEPS}", "--checkpoint_every=100",
       "--jit_compile=false"]


def losses(model_dir):
  return np.array([r["loss"] for r in read_metrics(model_dir)])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("vit_one_device"))
  train_in_process(VIT + [f"--model_dir={model_dir}"])
  return model_dir


def test_cli_generate_on_a_vision_run_names_the_task_it_needs(one_device, cli):
  """Once "the checkpoint ... was written by another version of the model; retrain"."""
  from test_bad_input import snapshot  # pylint: disable=import-outside-toplevel
  proc, before = cli["generate"], cli["one_device_before"]
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.generate: error:"), proc.stderr
  for words in ("a vision run (--task=classify)", "a --task=lm run", "tfpar.predict"):
    assert words in lines[0], lines[0]
  assert "another version" not in lines[0]
  assert snapshot(one_device) == before


CLASSES = ("cat", "dog", "eel")


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
  """A ViT trained 1 step on a user's class folders (4 grey 8x8 images each): (run, folder)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp("vit_folders")
  for shade, name in enumerate(CLASSES):
    (root / "images" / name).mkdir(parents=True)
    for i in range(4):
      Image.new("L", (8, 8), 60 * shade + i).save(root / "images" / name / f"{i}.png")
  model_dir = str(root / "run")
  train_in_process(VIT + ["--num_classes=3", "--train_steps=1", f"--data={root / 'images'}",
                          f"--model_dir={model_dir}"])
  return model_dir, root / "images"


@pytest.fixture(scope="module")
def cli(one_device, folder_run, tmp_path_factory):
  """Every CLI process of this file, each its own `python -m`, started side by side once.

  {name: CompletedProcess}, and one_device's files as they were before ("one_device_before").
  """
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from test_bad_input import snapshot  # pylint: disable=import-outside-toplevel
  model_dir, folder = folder_run
  bad = tmp_path_factory.mktemp("vit_bad")
  for name in ("cat", "dog", "eel"):  # A user's image folder with 3 classes.
    (bad / "images" / name).mkdir(parents=True)
    Image.new("L", (8, 8), 200).save(bad / "images" / name / "0.png")
  calls = {
      "generate": ("tfpar.generate", [f"--model_dir={one_device}", "--prompt=hi"]),
      "predict": ("tfpar.predict", [f"--model_dir={model_dir}", f"--image={folder / 'eel'}"]),
      "image_size": ("tfpar.train", VIT + ["--image_size=9", f"--model_dir={bad / 'run'}"]),
      "num_classes": ("tfpar.train", VIT + ["--num_classes=5", f"--model_dir={bad / 'run'}"]),
      "user": ("tfpar.train", VIT + ["--num_classes=2", f"--data={bad / 'images'}",
                                     f"--model_dir={bad / 'user'}"]),
  }
  before = snapshot(one_device)
  return {**dict(zip(calls, run_modules(list(calls.values())))), "one_device_before": before,
          "bad": bad}


def test_cli_predict_prints_the_class_folder_names(folder_run, cli):
  """Once "class 2 (0.4)": an index the user had to map back to the sorted folder names."""
  import json  # pylint: disable=import-outside-toplevel
  model_dir, _ = folder_run
  with open(os.path.join(model_dir, "config.json")) as f:
    assert json.load(f)["class_names"] == list(CLASSES)  # recorded when the data was read
  assert cli["predict"].returncode == 0, cli["predict"].stderr[-3000:]
  out = cli["predict"].stdout.splitlines()
  assert len(out) == 4
  for line in out:
    assert line.split(": class ")[1].split(" (")[0] in CLASSES, line


def test_vit_shapes_and_parameter_count():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import tasks  # pylint: disable=import-outside-toplevel
  from tfpar.layout import placement as plan  # pylint: disable=import-outside-toplevel
  for pooling in ("cls", "mean"):
    # --data: not the built-in 8x8 digits (this model is never trained).
    cfg = make_config(VIT + ["--model_dir=/tmp/unused", "--num_classes=7", "--data=/tmp",
                             f"--pooling={pooling}", "--image_size=12", "--patch_size=3",
                             "--num_channels=3"])
    model = tasks.make(cfg).build_model()
    model.build_all()
    images = tf.random.uniform([5, 12, 12, 3])
    assert model.embed(images).shape == (5, 16 + (pooling == "cls"), 32)
    logits = model(images)
    assert logits.shape == (5, 7) and logits.dtype == tf.float32
    # The plan counts the ViT's parameters from the config alone, as it does the GPT's.
    counts = plan.count_params(cfg.model)
    assert counts.embedding + 2 * counts.block + counts.head == \
        sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def test_attention_is_not_causal_in_the_vit():
  """Changing the last patch changes the class token's output: it sees every patch."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import tasks  # pylint: disable=import-outside-toplevel
  model = tasks.make(make_config(VIT + ["--model_dir=/tmp/unused"])).build_model()
  model.build_all()
  images = tf.random.uniform([1, 8, 8, 1])
  h = model.embed(images)
  # (Not a constant shift: the block's LayerNorm would remove it.)
  changed = tf.concat([h[:, :-1], h[:, -1:] + tf.random.normal(tf.shape(h[:, -1:]))], axis=1)
  out, out_changed = model.blocks[0](h), model.blocks[0](changed)
  assert float(tf.reduce_max(tf.abs(out[:, 0] - out_changed[:, 0]))) > 1e-4


def assert_same_run(model_dir, reference_dir):
  got, want = losses(model_dir), losses(reference_dir)
  assert len(got) == len(want) == STEPS and len(set(want.tolist())) == STEPS
  np.testing.assert_allclose(got, want, rtol=1e-5)
  norms = [[r["grad_norm"] for r in read_metrics(d)] for d in (model_dir, reference_dir)]
  np.testing.assert_allclose(norms[0], norms[1], rtol=1e-4)  # The same (summed) gradient.
  evals = [read_metrics(d, "eval")[-1] for d in (model_dir, reference_dir)]
  np.testing.assert_allclose(evals[0]["loss"], evals[1]["loss"], rtol=1e-5)
  assert evals[0]["accuracy"] == evals[1]["accuracy"]


@pytest.mark.parametrize("plan", [
    ["--strategy=mirrored", "--num_cpu_devices=4"],
    ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=2", "--checkpoint_every=3"],
    ["--num_cpu_devices=2", "--tensor_parallel=2"],
], ids=["mirrored_4", "pipeline_2", "tensor_2"])
def test_vit_matches_one_device(one_device, tmp_path, plan):
  model_dir = str(tmp_path)
  train_in_process(VIT + plan + [f"--model_dir={model_dir}"])
  assert_same_run(model_dir, one_device)
  record = read_metrics(model_dir)[-1]
  assert record["images_per_sec"] > 0 and "tokens_per_sec" not in record
  if "--pipeline_stages=2" in plan:
    check_pipeline_checkpoint_restores_on_one_device(model_dir, tmp_path)


def check_pipeline_checkpoint_restores_on_one_device(model_dir, tmp_path):
  """The pipeline's step-3 checkpoint, restored on one device: same weights, same eval."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import tasks  # pylint: disable=import-outside-toplevel
  from tfpar.training import checkpoint  # pylint: disable=import-outside-toplevel
  from tfpar.engines.data_parallel import DataParallelEngine  # pylint: disable=import-outside-toplevel
  cfg = make_config(VIT + [f"--model_dir={tmp_path / 'restored'}"])
  task = tasks.make(cfg)
  data, _ = task.load_data()
  engine = DataParallelEngine(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"), data, task=task)
  checkpointer = checkpoint.CanonicalCheckpointer(engine.layouts,
                                                  os.path.join(model_dir, "checkpoints"))
  assert checkpointer.restore() and engine.step == STEPS
  saved = checkpoint.read_checkpoint(checkpointer.latest)
  restored = checkpoint.read_canonical(engine.layouts[0])
  assert sorted(saved) == sorted(restored)
  assert any("attn/query/kernel" in name for name in saved)  # Canonical, not per shard/stage.
  for name, value in saved.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  metrics = engine.eval_metrics(engine.eval_iterator(), cfg.train.eval_steps)
  want = read_metrics(model_dir, "eval")[-1]
  np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-5)
  assert metrics["accuracy"] == want["accuracy"]


def test_accuracy_counts_each_held_out_image_once():
  from tfpar import tasks  # pylint: disable=import-outside-toplevel
  task = tasks.make(make_config(VIT + ["--model_dir=/tmp/unused"]))
  # Batches wrap around a 3-image held-out set: image 0 seen twice, right once, wrong once.
  batches = [{"loss": np.float32(1.0), "index": np.array([0, 1]), "correct": np.array([1.0, 0.0])},
             {"loss": np.float32(3.0), "index": np.array([2, 0]), "correct": np.array([1.0, 0.0])}]
  assert task.eval_metrics(batches) == {"loss": 2.0, "accuracy": pytest.approx(2 / 3)}


def test_bad_image_size_and_class_ids_are_one_line_errors(cli):
  from test_config import assert_one_line_error  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match="--image_size=10 is not divisible by --patch_size=4"):
    make_config(VIT + ["--model_dir=/tmp/unused", "--image_size=10", "--patch_size=4",
                       "--data=/tmp"])
  # Before TensorFlow starts: one line, exit 2, nothing created.
  for name, flag in (("image_size", "image_size"), ("num_classes", "num_classes")):
    assert_one_line_error(cli[name], flag)
  assert not (cli["bad"] / "run").exists()
  # A user's image folder with 3 classes, trained with --num_classes=2.
  line = assert_one_line_error(cli["user"], "num_classes")
  assert "class id 2" in line
