"""--task=detect and --task=segment: heads, data, one-device vs mirrored, predict, bad input."""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from conftest import make_config, read_metrics, run_modules, train_in_process
from tfpar import tasks
from tfpar.data import pipeline

# A ViT small enough that a run takes seconds: 32 x 32 canvases, 8 x 8 patches -> 16 tokens.
VISION = ["--image_size=32", "--patch_size=8", "--pooling=mean", "--num_layers=2", "--d_model=32",
          "--num_heads=4", "--d_ff=64", "--global_batch_size=8", "--eval_steps=2",
          "--steps_per_call=1", "--log_every=1", "--learning_rate=3e-3", "--warmup_steps=1"]
DETECT = ["--task=detect", "--num_classes=10", *VISION]
SEGMENT = ["--task=segment", "--num_classes=11", *VISION]


def _task(args, tmp="/tmp/unused"):
  return tasks.make(make_config([f"--model_dir={tmp}", *args]))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_dense_heads_shapes(pooling):
  images = tf.random.uniform([3, 32, 32, 1])
  for args, shape in ((DETECT, (3, 4, 4, 14)), (SEGMENT, (3, 32, 32, 11))):
    task = _task([*args, f"--pooling={pooling}"])
    model = task.build_model()
    model.build_all()
    out = model(images)
    assert out.shape == shape and out.dtype == tf.float32
    # No unused weights (the ViT's classifier is replaced, not kept beside the head).
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(images, training=True))
    assert all(g is not None for g in tape.gradient(loss, model.trainable_variables))
    embed, head = task.embed_head_params(task.cfg.model)
    blocks = sum(int(np.prod(v.shape)) for b in model.blocks for v in b.weights)
    assert embed + head + blocks == sum(int(np.prod(v.shape)) for v in model.weights)


def test_datasets_carry_images_and_their_targets():
  detect, segment = _task(DETECT), _task(SEGMENT)
  data, sharding = detect.load_data()
  assert sharding == "data" and len(data.train) == 6000 and len(data.eval) == 500
  images, t = next(iter(detect.dataset(data.train, pipeline.Shard(4))))
  assert images.shape == (4, 32, 32, 1) and 0 <= images.numpy().min() <= images.numpy().max() <= 1
  assert t["heatmap"].shape == (4, 4, 4, 10) and t["regression"].shape == (4, 4, 4, 4)
  # Every image holds 1..4 digits, each with at least one positive patch of its class.
  for n in range(4):
    classes = t["classes"][n].numpy()
    assert 1 <= (classes >= 0).sum() <= 4
    assert set(np.nonzero(t["heatmap"][n].numpy().reshape(-1, 10).any(0))[0]) == \
        set(classes[classes >= 0])
  seg_data, _ = segment.load_data()
  images, t = next(iter(segment.dataset(seg_data.eval, pipeline.Shard(4), shuffle=False)))
  np.testing.assert_array_equal(t["mask"], seg_data.eval.masks[:4])  # held out: in order
  np.testing.assert_array_equal(t["index"], [0, 1, 2, 3])


@pytest.fixture(scope="module")
def detect_runs(tmp_path_factory):
  """One-device and mirrored (2 logical CPUs) detection runs of 3 steps; their model dirs."""
  root = tmp_path_factory.mktemp("detect")
  one = str(root / "one")
  train_in_process([*DETECT, f"--model_dir={one}", "--train_steps=3", "--eval_every=3",
                    "--jit_compile=false"])
  two = str(root / "two")
  train_in_process([*DETECT, f"--model_dir={two}", "--train_steps=3", "--eval_every=3",
                    "--jit_compile=false", "--strategy=mirrored", "--num_cpu_devices=2"])
  return one, two


def test_detect_under_mirrored_equals_one_device(detect_runs):
  one, two = (read_metrics(d) for d in detect_runs)
  np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
  ev = read_metrics(detect_runs[0], "eval")[-1]
  assert {"loss", "map50", "map"} <= set(ev) and 0 <= ev["map"] <= ev["map50"] <= 1
  assert "images_per_sec" in one[-1]


@pytest.fixture(scope="module")
def segment_run(tmp_path_factory):
  """A segmentation run of 2 steps, evaluated at the end: (its last records, its model dir)."""
  model_dir = str(tmp_path_factory.mktemp("segment") / "run")
  return train_in_process([*SEGMENT, f"--model_dir={model_dir}", "--train_steps=2",
                           "--eval_every=2"]), model_dir


def test_segment_trains_and_reports_mean_iou(segment_run):
  records, model_dir = segment_run
  ev = records["eval"]
  assert 0 < ev["mean_iou"] <= 1 and 0 < ev["pixel_accuracy"] <= 1
  losses = [r["loss"] for r in read_metrics(model_dir)]
  assert abs(losses[0] - np.log(11)) < 0.5  # starts near uniform over 11 classes


def _canvas_png(path, size=32):
  from tfpar.data import digit_canvas
  _, held_out = digit_canvas.digit_canvases(1, 2, canvas_size=size, scale=1)
  Image.fromarray(held_out.images[0, ..., 0]).resize((size * 2, size)).save(path)
  return held_out


def _copy_run(model_dir, tmp_path, state_file):
  """A copy of a run whose `checkpoint` state file is replaced (bytes) or removed (None).

  predict finds checkpoints from their files, as train and generate do: the
  state file, lost or corrupt, changes nothing.
  """
  copy = tmp_path / "run"
  shutil.copytree(model_dir, copy)
  (copy / "checkpoints" / "checkpoint").unlink()
  if state_file is not None:
    (copy / "checkpoints" / "checkpoint").write_bytes(state_file)
  return str(copy)


def predict(args, capsys):
  """What tfpar.predict's main prints on stdout, run in this process (its command line as a
  process of its own: tests/test_vit.py)."""
  from tfpar.cli import predict as predict_cli  # pylint: disable=import-outside-toplevel
  capsys.readouterr()
  predict_cli.main(["predict", *args])
  return capsys.readouterr().out


def test_predict_prints_boxes_and_writes_masks(detect_runs, tmp_path, capsys):
  image = str(tmp_path / "canvas.png")
  _canvas_png(image)
  model_dir = _copy_run(detect_runs[0], tmp_path, state_file=None)
  out = predict([f"--model_dir={model_dir}", f"--image={image}", "--score_threshold=0",
                 "--overlay", f"--output_dir={tmp_path}"], capsys).splitlines()
  assert out[0].startswith(f"{image}: ") and out[0].endswith((" box", " boxes"))
  boxes = [line for line in out if line.startswith("  class ")]
  assert len(boxes) == int(out[0].split()[1]) > 0  # threshold 0: every NMS survivor
  xs = [float(v) for line in boxes for v in line.split("= (")[1].rstrip(")").split(",")[1::2]]
  assert max(xs) <= 64 and max(xs) > 32  # in the 64-wide image's own pixels
  assert Image.open(tmp_path / "canvas.overlay.png").size == (64, 32)


def test_predict_writes_a_mask_png(segment_run, tmp_path, capsys):
  model_dir = _copy_run(segment_run[1], tmp_path, state_file=b"\xff\xfe\x00 not a state file")
  image = str(tmp_path / "canvas.png")
  _canvas_png(image)
  out = predict([f"--model_dir={model_dir}", f"--image={tmp_path}"], capsys)
  assert f"{image}: mask -> " in out
  mask = Image.open(os.path.join(model_dir, "predictions", "canvas.mask.png"))
  assert mask.mode == "P" and mask.size == (64, 32)
  assert np.asarray(mask).max() < 11


def _one_line(proc):
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr
  return lines[-1]


def _user_error(args):
  """The one line train.main would print (a runner.USER_ERRORS, exit 2), raised in this process.

  train.main's own exit 2 and one line for these errors: test_bad_input's CLI runs.
  """
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  with pytest.raises(runner.USER_ERRORS) as info:
    train_in_process(args)
  assert "\n" not in str(info.value), str(info.value)
  return str(info.value)


def test_bad_input_ends_with_one_line_and_status_2(detect_runs, tmp_path):
  coco = {"images": [{"id": 1, "file_name": "a.png", "width": 16, "height": 16}],
          "annotations": [{"id": 1, "image_id": 1, "bbox": [10, 2, 8, 4], "category_id": 1}],
          "categories": [{"id": 1, "name": "one"}]}
  Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "a.png")
  (tmp_path / "coco.json").write_text(json.dumps(coco))
  (tmp_path / "empty" / "images").mkdir(parents=True)
  (tmp_path / "empty" / "masks").mkdir()
  (tmp_path / "bad.png").write_bytes(b"not an image")
  common = ["--num_channels=3", "--train_steps=2"]
  # tfpar.predict's own command line: three processes, two at a time (conftest.run_modules).
  lines = [_one_line(proc) for proc in run_modules([
      ("tfpar.predict", [f"--model_dir={detect_runs[0]}", f"--image={tmp_path / 'bad.png'}"]),
      ("tfpar.predict", [f"--model_dir={detect_runs[0]}", f"--image={tmp_path / 'a.png'}",
                         "--overlay", "--output_dir=/proc/tfpar_predictions"]),
      ("tfpar.predict", [f"--model_dir={tmp_path / 'nothing'}", f"--image={tmp_path}"]),
  ])]
  # Training's, found when the data is read: in this process.
  lines += [_user_error([*DETECT, *common, f"--data={tmp_path / 'coco.json'}",
                         f"--model_dir={tmp_path / 'run0'}"]),
            _user_error([*SEGMENT, *common, f"--data={tmp_path / 'empty'}",
                         f"--model_dir={tmp_path / 'run1'}"]),
            _user_error(["--task=segment", "--num_classes=5", *VISION,
                         f"--model_dir={tmp_path / 'run2'}", "--train_steps=2"])]
  assert "bad.png is not a readable image" in lines[0]
  assert "--output_dir=/proc/tfpar_predictions cannot be created" in lines[1]
  assert "has no config.json" in lines[2]
  assert "outside its 16x16 image" in lines[3] and "fix the box" in lines[3]
  assert "holds no images" in lines[4]
  assert lines[5].endswith("use --num_classes=11")
  for run in ("run0", "run1", "run2"):
    assert not (tmp_path / run).exists()
