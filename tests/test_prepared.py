"""Prepared sets (tfpar.data.prepare / prepared): streamed windows equal the text's in memory,
prepare is streaming, parallel, byte-identical and atomic, every bad set is one line, and
training on a prepared set of hundreds of MB holds the memory of a tiny one.

The real runs share one module fixture: a tiny prepared set and its text trained one device
in memory and streamed (equal losses), two workers streamed to step 3 then resumed to step 6
on one device and, from a copy, under a pipeline of 2 stages on 2 workers (equal losses), and
two sets of 200 and 400 MB written with numpy (peak RSS). The runs whose peak RSS is measured
and those of several workers are processes of their own; the text's run in memory and the
one-device resume are in this process (conftest.train_in_process: tfpar.train's checks and
runner without a TensorFlow start)."""

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from conftest import REPO, TINY, in_background, read_metrics, run_module, run_modules, train_in_process
from tfpar import tasks, tokenizer
from tfpar.data import corpus, pipeline, prepare, prepared
from tfpar.data.pipeline import Shard

STDLIB = sysconfig.get_paths()["stdlib"]
TEXT = f"{STDLIB}/[a-c]*.py"
BYTES = tokenizer.load("bytes")
STEPS, RESUME_AT = 6, 3
# A constant learning rate after warmup (--min_lr_ratio=1): a run stopped at step 3 has taken the
# steps of the run that goes on to step 6.
ARGS = TINY + [f"--train_steps={STEPS}", "--seed=3", "--jit_compile=false", "--input_sharding=data",
               "--min_lr_ratio=1"]
TWO_WORKERS = ["--num_workers=2", "--", *ARGS, "--strategy=multi_worker_mirrored"]
# Peak RSS of training on a 200 MB set over a 0.6 MB one, and of a 400 MB set over the 200 MB.
RSS_ABOVE_TINY, RSS_GROWTH_ON_DOUBLING = 150 << 20, 48 << 20
# What preparing 1,200 images of 96x96x3 (32 MiB of pixels) may add to the peak of 300's.
IMAGE_PREPARE_GROWTH = 12 << 20


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("prep") / "tiny")
  prepare.prepare(corpus.list_files(TEXT), BYTES, out, num_shards=3)
  return out


def stdlib_documents(seed: int, total_bytes: int):
  """Stdlib files as uint8 ids, shuffled and repeated with a seed, `total_bytes` in all."""
  docs = [np.fromfile(f, np.uint8) for f in corpus.default_corpus_files()]
  docs = [d[d != 0] for d in docs if len(d)]
  rng, written = np.random.default_rng(seed), 0
  while written < total_bytes:
    for i in rng.permutation(len(docs)):
      if written >= total_bytes:
        return
      cut = docs[i][rng.integers(0, max(len(docs[i]) // 2, 1)):]  # Varied documents.
      written += len(cut) + 1
      yield cut


def run_measured(args, log):
  """python -m tfpar.train args; (exit status, peak RSS in bytes from wait4)."""
  env = dict(os.environ, PYTHONPATH=REPO)
  with open(log, "w") as out:
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.train", *args], cwd=REPO, env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  return proc.returncode, usage.ru_maxrss * 1024


@pytest.fixture(scope="module")
def runs(tiny_set, tmp_path_factory):
  """{name: model_dir} of the module's training runs, the peak RSS of the streamed ones, and
  what the one-device resume printed."""
  root = tmp_path_factory.mktemp("runs")
  dirs = {name: str(root / name) for name in ("text", "streamed", "two", "piped", "big", "bigger")}
  two = in_background(run_module, "tfpar.launch", TWO_WORKERS + [
      f"--data={tiny_set}", f"--model_dir={dirs['two']}", "--checkpoint_every=3",
      f"--train_steps={RESUME_AT}"])
  sets = {}
  for name, size in (("big", 200 << 20), ("bigger", 400 << 20)):
    sets[name] = str(root / f"set_{name}")
    prepare.write_arrays(sets[name], BYTES, stdlib_documents(len(name), size), num_shards=4)

  def measured():  # One at a time: each peak is its own process's.
    return {name: run_measured(ARGS + ["--strategy=one_device", f"--data={data}",
                                       f"--model_dir={dirs[name]}"], root / f"{name}.log")
            for name, data in (("streamed", tiny_set), ("big", sets["big"]),
                               ("bigger", sets["bigger"]))}

  rss = in_background(measured)
  train_in_process(ARGS + ["--strategy=one_device", f"--data={TEXT}",
                           f"--model_dir={dirs['text']}"])
  two.result()
  # From the 2-worker checkpoint at step 3: a pipeline whose 2 stages are 2 worker processes
  # (tfpar.engines.stage_worker: each stage's worker reads its windows), and one device.
  shutil.copytree(dirs["two"], dirs["piped"])
  piped = in_background(run_module, "tfpar.launch", TWO_WORKERS + [
      "--pipeline_stages=2", f"--data={tiny_set}", f"--model_dir={dirs['piped']}"])
  with contextlib.redirect_stdout(io.StringIO()) as said:
    train_in_process(ARGS + ["--strategy=one_device", f"--data={tiny_set}",
                             f"--model_dir={dirs['two']}"])
  piped.result()
  rss = rss.result()
  for name, (code, _) in rss.items():
    assert code == 0, open(root / f"{name}.log").read()[-3000:]
  for name in sets.values():
    shutil.rmtree(name)
  return dirs, {name: peak for name, (_, peak) in rss.items()}, said.getvalue()


def losses(model_dir, after=0):
  return np.array([r["loss"] for r in read_metrics(model_dir) if r["step"] > after])


def test_a_streamed_run_trains_with_the_loss_of_the_text_in_memory(runs):
  dirs, _, _ = runs
  np.testing.assert_allclose(losses(dirs["streamed"]), losses(dirs["text"]), rtol=1e-5)
  assert len(losses(dirs["text"])) == STEPS


def test_two_streamed_workers_then_one_device_resumed_give_the_uninterrupted_loss(runs):
  dirs, _, resumed = runs
  two = read_metrics(dirs["two"])
  assert [r["step"] for r in two] == list(range(1, STEPS + 1))
  assert two[0]["workers"] == 2 and two[-1]["workers"] == 1
  assert "resumed from" in resumed, resumed
  np.testing.assert_allclose(losses(dirs["two"]), losses(dirs["text"]), rtol=1e-5)


def test_a_run_resumed_under_a_pipeline_across_workers_gives_the_uninterrupted_loss(runs):
  dirs, _, _ = runs
  piped = read_metrics(dirs["piped"])
  assert [r["step"] for r in piped] == list(range(1, STEPS + 1))
  plan = json.load(open(os.path.join(dirs["piped"], "plan.json")))
  assert plan["pipeline_stages"] == 2 and plan["stage_workers"] == [["worker:0", "worker:1"]], plan
  np.testing.assert_allclose(losses(dirs["piped"]), losses(dirs["text"]), rtol=1e-5)


def test_peak_rss_does_not_grow_with_the_prepared_corpus(runs):
  _, rss, _ = runs
  print({name: f"{peak / 2**20:.0f} MiB" for name, peak in rss.items()})  # Seen with -s.
  assert rss["big"] - rss["streamed"] < RSS_ABOVE_TINY, rss
  assert rss["bigger"] - rss["big"] < RSS_GROWTH_ON_DOUBLING, rss


def test_streamed_windows_are_the_in_memory_windows(tiny_set):
  text = pipeline.load_corpus(TEXT, seq_len=32, eval_fraction=0.05)
  streamed = pipeline.load_corpus(tiny_set, seq_len=32, eval_fraction=0.05, tokenizer=BYTES)
  assert isinstance(streamed.train, prepared.TokenStream) and len(streamed.files) == 3
  assert np.array_equal(streamed.train.read(), text.train)
  assert np.array_equal(streamed.eval.read(), text.eval)
  first = streamed.train.sizes[0]
  # Windows that cross the end of a shard (3 shards of ~200,000 tokens) read both pieces.
  window = (first - 5) // 32
  assert np.array_equal(streamed.train.read(window * 32, 33), text.train[window * 32:][:33])
  # Both ways of reading a window: os.pread in this process (a local set) and tf.data's
  # ranged reads (a remote set, or a parameter server's workers: host_reads=False).
  for host_reads in (True, False):
    for split, kwargs in (("train", {}), ("train", {"start_step": 7}),
                          ("eval", {"shuffle": False})):
      for shard in (Shard(8), Shard(8, 4, 2, 2)):
        want = pipeline.window_dataset(getattr(text, split), 32, shard, seed=1, **kwargs)
        got = pipeline.window_dataset(getattr(streamed, split), 32, shard, seed=1,
                                      host_reads=host_reads, **kwargs)
        for (x, y), (u, v) in zip(want.take(20), got.take(20)):
          np.testing.assert_array_equal(x.numpy(), u.numpy())
          np.testing.assert_array_equal(y.numpy(), v.numpy())
    # The in-order windows include the ones that straddle: every window of the split is read.
    everything = np.concatenate([x.numpy() for x, _ in pipeline.window_dataset(
        streamed.train, 32, Shard(64), seed=0, shuffle=False, host_reads=host_reads).take(
            len(text.train) // 32 // 64)])
    np.testing.assert_array_equal(everything, text.train[:len(everything) * 32].reshape(-1, 32))


def test_each_input_pipeline_reads_only_its_own_replicas_windows(tmp_path):
  """A set whose window k starts with k's two bytes: over 5 steps, each of 2 workers (2
  replicas each of 4) reads exactly its replicas' G/2 windows a step, the two share none, and
  together they read the windows one device reads."""
  seq_len, n = 16, 1000
  stream = np.zeros(n * seq_len + 1, np.uint8)
  stream[0:n * seq_len:seq_len], stream[1:n * seq_len:seq_len] = np.divmod(np.arange(n), 256)
  prepare.write_arrays(str(tmp_path / "set"), BYTES, [stream[:-1]], num_shards=3)
  tokens = prepared.open_set(str(tmp_path / "set"), BYTES)

  def windows(shard, steps=5):
    batches = pipeline.window_dataset(tokens, seq_len, shard, seed=4, start_step=2).take(
        steps * shard.local_replicas)
    return [int(x[0]) * 256 + int(x[1]) for x, _ in batches.unbatch()]

  one = windows(Shard(16))
  workers = [windows(Shard(16, 4, 2 * w, 2)) for w in range(2)]
  assert [len(w) for w in workers] == [5 * 8, 5 * 8] and not set(workers[0]) & set(workers[1])
  assert sorted(workers[0] + workers[1]) == sorted(one)
  for step in range(5):  # Worker w's share of each global batch: its replicas' slices.
    assert workers[0][step * 8:(step + 1) * 8] == one[step * 16:step * 16 + 8]
    assert workers[1][step * 8:(step + 1) * 8] == one[step * 16 + 8:(step + 1) * 16]


def test_a_long_line_is_tokenized_in_pieces_the_same_way_everywhere(tmp_path):
  line = ("x = 'caf\u00e9' " * 300_000).encode()  # 3.9 MB on one line, 2-byte characters
  pieces = list(corpus.pieces(line))
  assert len(pieces) == 4 and all(len(p) <= corpus.PIECE_BYTES for p in pieces)
  assert b"".join(pieces) == line and all(p.decode() for p in pieces)  # Whole characters.
  lines = b"".join(b"a" * 1000 + b"\n" for _ in range(3000))
  assert all(p.endswith(b"\n") for p in corpus.pieces(lines))
  (tmp_path / "long.txt").write_bytes(line + b"\0")
  documents = corpus.iter_documents(str(tmp_path / "long.txt"))
  streamed = list(next(documents))
  assert streamed == pieces
  assert corpus.read_tokens([str(tmp_path / "long.txt")]).tobytes() == line + b"\0"


def test_prepare_refuses_to_mix_sets_and_overwrite_replaces_at_once(tiny_set, tmp_path):
  out = str(tmp_path / "set")
  (tmp_path / "empty.txt").write_text("")  # A file without a document.
  files = corpus.list_files(f"{STDLIB}/a*.py") + [str(tmp_path / "empty.txt")]
  first = prepare.prepare(files, BYTES, out, num_shards=2)
  names = sorted(os.listdir(out))
  with pytest.raises(corpus.DataError, match="already holds 4 files: pass --overwrite"):
    prepare.prepare(files, BYTES, out, num_shards=3)
  assert sorted(os.listdir(out)) == names
  second = prepare.prepare(files, BYTES, out, num_shards=3, overwrite=True)
  assert len(os.listdir(out)) == 5 and second["tokens"] == first["tokens"]
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # Nothing left aside.
  assert second["documents"] == len(files) - 1
  (tmp_path / "file").write_text("x")
  for bad, words in ((str(tmp_path / "file"), "is a file"),
                     ("/proc/tfpar_prep", "cannot be written"),
                     (str(tmp_path / "file" / "sub"), "cannot be written")):
    with pytest.raises(corpus.DataError, match=words):
      prepare.prepare(files, BYTES, bad)


def damaged(tiny_set, tmp_path, how):
  """A copy of the tiny set, damaged `how`."""
  out = str(tmp_path / "damaged")
  shutil.copytree(tiny_set, out)
  manifest = json.load(open(os.path.join(out, prepared.MANIFEST)))
  shard = os.path.join(out, manifest["shards"][1]["file"])
  if how == "truncated":
    os.truncate(shard, os.path.getsize(shard) - 7)
  elif how == "corrupt":
    with open(shard, "r+b") as f:
      f.seek(1000)
      f.write(b"\xff")
  elif how == "missing index":
    os.remove(os.path.join(out, prepared.INDEX))
  elif how == "missing shard":
    os.remove(shard)
  elif how == "incomplete":
    os.remove(os.path.join(out, prepared.MANIFEST))
  elif how in ("bad json", "no tokenizer key", "another width"):
    if how == "no tokenizer key":
      del manifest["tokenizer"]
    if how == "another width":
      manifest["dtype"] = "uint16"
      for s in manifest["shards"]:
        s["bytes"] *= 2
    text = json.dumps(manifest)[:-20] if how == "bad json" else json.dumps(manifest)
    open(os.path.join(out, prepared.MANIFEST), "w").write(text)
  return out


@pytest.mark.parametrize("how, words", [
    ("truncated", "its shard tokens-00001-of-00003.bin is truncated or altered"),
    ("corrupt", "its shard tokens-00001-of-00003.bin is corrupt"),
    ("missing index", "its index index.bin is missing"),
    ("missing shard", "its shard tokens-00001-of-00003.bin is missing"),
    ("incomplete", "this prepare is incomplete"),
    ("bad json", "manifest.json is not valid JSON"),
    ("no tokenizer key", "manifest.json lacks tokenizer"),
    ("another width", "holds uint16 ids of a 256-id vocabulary; --tokenizer=bytes has 256 ids "
                      r"\(uint8\)"),
])
def test_a_damaged_set_is_refused_in_one_line(tiny_set, tmp_path, how, words):
  out = damaged(tiny_set, tmp_path, how)
  with pytest.raises(corpus.DataError, match=words) as error:
    pipeline.load_corpus(out, seq_len=32, eval_fraction=0.05, tokenizer=BYTES)
  assert "\n" not in str(error.value) and "prepare" in str(error.value)


def test_a_corrupt_shard_past_the_verified_size_is_still_checked_for_size(tiny_set, tmp_path):
  out = damaged(tiny_set, tmp_path, "truncated")
  with pytest.raises(corpus.DataError, match="truncated"):
    prepared.open_set(out, BYTES, verify_bytes=0)


def test_an_old_tfrecord_prepare_is_refused_with_the_fix(tmp_path):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with tf.io.TFRecordWriter(str(tmp_path / "tokens-00000-of-00001.tfrecord")) as writer:
    writer.write(tf.train.Example(features=tf.train.Features(feature={"ids": tf.train.Feature(
        int64_list=tf.train.Int64List(value=[1, 2, 3]))})).SerializeToString())
  with pytest.raises(corpus.DataError, match="token ids of an older or incomplete"):
    pipeline.load_corpus(str(tmp_path / "*.tfrecord"), seq_len=2, eval_fraction=0.1)
  (tmp_path / "tokenizer.json").write_text('{"tokenizer": "bytes"}')
  with pytest.raises(corpus.DataError, match="older tfpar.data prepare .*--overwrite"):
    pipeline.load_corpus(str(tmp_path), seq_len=2, eval_fraction=0.1, tokenizer=BYTES)


def test_text_past_the_in_memory_limit_is_refused_with_prepare(tmp_path):
  (tmp_path / "a.txt").write_text("x" * 5000)
  with pytest.raises(corpus.DataError, match="more than the .* GiB tfpar reads into memory: "
                     "prepare it once with python -m tfpar.data prepare"):
    pipeline.load_corpus(str(tmp_path), seq_len=8, eval_fraction=0.1, max_text_bytes=4096)


def digest(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def test_cli_prepares_in_parallel_byte_identically_and_refuses_bad_input(tiny_set, tmp_path):
  """--workers=2 writes the bytes one process wrote; a replaced tokenizer, an incomplete set,
  a truncated shard under a run's existing model_dir, and --out on /proc or a file are one
  line, exit 2, nothing written and nothing lost."""
  sp_model = str(tmp_path / "sp.model")
  tokenizer.train(corpus.list_files(TEXT), vocab_size=500, out=sp_model)
  incomplete = damaged(tiny_set, tmp_path, "incomplete")
  (tmp_path / "file").write_text("x")
  sp_set = str(tmp_path / "sp_set")
  prepare.prepare(corpus.list_files(f"{STDLIB}/a*.py"), tokenizer.load(
      f"sentencepiece:{sp_model}"), sp_set)
  tokenizer.train(corpus.list_files(f"{STDLIB}/a*.py"), vocab_size=500, out=sp_model)  # Replaced.
  untouched = {p: digest(p) for p in [sp_model, *(os.path.join(sp_set, n)
                                                    for n in os.listdir(sp_set))]}
  model_dir = str(tmp_path / "run")
  truncated, earlier_run = damaged(tiny_set, tmp_path / "t", "truncated"), tmp_path / "earlier"
  (earlier_run / "checkpoints").mkdir(parents=True)
  (earlier_run / "checkpoints" / "checkpoint").write_text("a run's earlier state")
  runs = run_modules([
      ("tfpar.data", ["prepare", f"--data={TEXT}", f"--out={tmp_path / 'par'}", "--workers=2",
                      "--num_shards=3"]),
      ("tfpar.train", [*TINY, f"--data={sp_set}", f"--tokenizer=sentencepiece:{sp_model}",
                       "--vocab_size=500", f"--model_dir={model_dir}"]),
      ("tfpar.train", [*TINY, f"--data={incomplete}", f"--model_dir={model_dir}"]),
      ("tfpar.train", [*TINY, f"--data={truncated}", f"--model_dir={earlier_run}"]),
      ("tfpar.data", ["prepare", "--out=/proc/tfpar_prep"]),
      ("tfpar.data", ["prepare", f"--out={tmp_path / 'file'}"]),
  ])
  assert runs[0].returncode == 0, runs[0].stderr
  for name in os.listdir(tiny_set):
    assert open(os.path.join(tiny_set, name), "rb").read() == \
        open(tmp_path / "par" / name, "rb").read(), name
  for proc, words in zip(runs[1:], ["as it was then (sha256", "this prepare is incomplete",
                                    "tokens-00001-of-00003.bin is truncated or altered",
                                    "--out=/proc/tfpar_prep cannot be", "is a file"]):
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert not os.path.exists(model_dir)
  assert {p: digest(p) for p in untouched} == untouched  # The set and the new tokenizer as they were.
  assert [str(p.relative_to(earlier_run)) for p in sorted(earlier_run.rglob("*"))] == [
      "checkpoints", "checkpoints/checkpoint"]
  assert (earlier_run / "checkpoints" / "checkpoint").read_text() == "a run's earlier state"


def image_batches(data, steps=6, images=True):
  """The first `steps` batches of 2 replicas' pipelines (replica 1's), augmented (shift, flip);
  without `images`, as a pipeline's last stage reads them (no image read or decoded)."""
  from tfpar.data import augment, image_pipeline  # pylint: disable=import-outside-toplevel

  def transform(example, seed):
    example = augment.augment(example, seed, max_shift=2, flip=True)
    return example["image"], {k: v for k, v in example.items() if k != "image"}

  ds = image_pipeline.image_dataset(data, Shard(8, 2, 1, 1), transform, seed=5, start_step=3,
                                    images=images)
  return [(x.numpy(), {k: v.numpy() for k, v in y.items()}) for x, y in ds.take(steps)]


def open_set(out, task, **sizes):
  """The prepared image set at `out`, opened for `task` (its spec's label fields)."""
  from tfpar.data import image_prepared  # pylint: disable=import-outside-toplevel
  return image_prepared.open_images(out, task, tasks.spec(task).labels, **sizes)


def test_a_prepared_image_set_streams_the_batches_of_the_set_in_memory(tmp_path):
  """Labels, boxes and masks: the prepared set, held out and augmented as in memory, gives
  the same batches, and a record's image is the PNG of its pixels alone, whatever the chunk
  it was encoded with; a damaged, mismatched or older (decoded pixels) set is one line; a
  reader that fails midway publishes nothing."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data import digit_canvas, image_prepared, images  # pylint: disable=import-outside-toplevel
  from tfpar.tasks.classify import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits().train
  canvases = digit_canvas.make_canvases(digit_canvas.split_digits(0, 0.2)[0], 40, canvas_size=16,
                                        scale=1, seed=1)
  sets = {"classify": dataclasses.replace(digits, source_ids=None),
          "detect": images.ImageSet(canvases.images, boxes=canvases.boxes,
                                    classes=canvases.classes),
          "segment": images.ImageSet(canvases.images, masks=canvases.masks)}
  for task, data in sets.items():
    out = str(tmp_path / task)
    image_prepared.write_images(out, images.Examples.of(data), task, tasks.spec(task).labels,
                                num_shards=3)
    size, channels = data.images.shape[1], data.images.shape[3]
    stream = open_set(out, task, image_size=size, channels=channels,
                      num_classes=10 if task != "segment" else 11)
    assert isinstance(stream, image_prepared.ImageStream) and len(stream) == len(data)
    last = len(data) - 1  # In the last chunk (classify's is partial): a PNG of its pixels alone.
    with open(stream.paths[last % len(stream.paths)], "rb") as f:
      f.seek(int(stream.records[last, 0]))
      size = int(np.frombuffer(f.read(4), "<u4")[0])
      assert f.read(size) == tf.io.encode_png(data.images[last]).numpy(), task
    for want_set, got_set in zip(images.split(data, 0.25, 0), images.split(stream, 0.25, 0)):
      want = image_batches(want_set)
      # A last stage's batches (targets only, in memory and streamed): the same targets, the
      # images zeros (not read): what differs from the inputs' batches is the image alone.
      for read, got in ((True, image_batches(got_set)),
                        (False, image_batches(want_set, images=False)),
                        (False, image_batches(got_set, images=False))):
        for (x, y), (u, v) in zip(want, got):
          assert x.any(), task  # The images are not blank: a read image would show.
          np.testing.assert_array_equal(x if read else np.zeros_like(x), u)
          assert sorted(y) == sorted(v), task
          for k in y:
            np.testing.assert_array_equal(y[k], v[k], err_msg=f"{task} {k}")
  out = str(tmp_path / "classify")
  with pytest.raises(corpus.DataError, match="is a prepared classify set, not a detect set"):
    open_set(out, "detect", image_size=8, channels=1, num_classes=10)
  with pytest.raises(corpus.DataError, match="holds images of 8x8x1, not --image_size=16"):
    open_set(out, "classify", image_size=16, channels=1, num_classes=10)
  with pytest.raises(corpus.DataError, match="has class id 9; --num_classes=5"):
    open_set(out, "classify", image_size=8, channels=1, num_classes=5)
  old = str(tmp_path / "decoded")  # A set of the older format, fixed-size records of pixels.
  shutil.copytree(out, old)
  manifest = json.load(open(os.path.join(old, prepared.MANIFEST)))
  json.dump(dict(manifest, format=image_prepared.DECODED), open(os.path.join(old, "manifest.json"), "w"))
  with pytest.raises(corpus.DataError, match=r"holds decoded pixels \(tfpar.prepared-images/1\), "
                     "a format tfpar no longer reads: prepare it again with --overwrite"):
    open_set(old, "classify", image_size=8, channels=1, num_classes=10)
  os.remove(os.path.join(old, image_prepared.INDEX))
  json.dump(manifest, open(os.path.join(old, "manifest.json"), "w"))
  with pytest.raises(corpus.DataError, match="its index index.bin is missing"):
    open_set(old, "classify", image_size=8, channels=1, num_classes=10)

  def broken():  # A reader that fails at its third example: nothing is published.
    for i, example in enumerate(images.Examples.of(sets["classify"])):
      if i == 2:
        raise corpus.DataError("the third image is not readable")
      yield example
  with pytest.raises(corpus.DataError, match="the third image"):
    image_prepared.write_images(str(tmp_path / "broken"), broken(), "classify", ("label",))
  assert not os.path.exists(tmp_path / "broken")
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # Nothing left aside.
  shard = os.path.join(out, image_prepared.shard_name(1, 3))
  with open(shard, "r+b") as f:
    f.seek(10)
    f.write(b"\xff")
  with pytest.raises(corpus.DataError, match="examples-00001-of-00003.bin is corrupt"):
    open_set(out, "classify", image_size=8, channels=1, num_classes=10)
  os.truncate(shard, 64)
  with pytest.raises(corpus.DataError, match="examples-00001-of-00003.bin is truncated"):
    open_set(out, "classify", image_size=8, channels=1, num_classes=10)


def test_a_prepared_image_set_trains_to_the_losses_of_its_images_in_memory(tmp_path):
  """The digits as TFRecords of PNGs, trained in memory and, prepared by the CLI, streamed:
  the same losses to 1e-5 (augmented, held out by --eval_fraction alike)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data import image_records  # pylint: disable=import-outside-toplevel
  from tfpar.tasks.classify import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits().eval
  records = str(tmp_path / "digits.tfrecord")
  with tf.io.TFRecordWriter(records) as writer:
    for image, label in zip(digits.images, digits.labels):
      writer.write(image_records.classify_example(tf.io.encode_png(image).numpy(),
                                                  label).SerializeToString())
  vit = ["--task=classify", "--image_size=8", "--num_channels=1", "--num_classes=10",
         "--patch_size=2", "--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64",
         "--global_batch_size=16", "--learning_rate=3e-3", "--warmup_steps=0", "--log_every=1",
         "--steps_per_call=1", "--eval_every=0", "--eval_steps=1", "--train_steps=4",
         "--jit_compile=false", "--max_shift=1", "--strategy=one_device"]
  prepared_set, dirs = str(tmp_path / "prep"), {n: str(tmp_path / n) for n in ("mem", "streamed")}
  # The prepare is the CLI's process; both trainings run in this process meanwhile.
  prep = in_background(run_module, "tfpar.data", [
      "prepare", "--task=classify", f"--data={records}", f"--out={prepared_set}",
      "--image_size=8", "--num_channels=1", "--num_classes=10"])
  train_in_process(vit + [f"--data={records}", f"--model_dir={dirs['mem']}"])
  prep.result()
  train_in_process(vit + [f"--data={prepared_set}", f"--model_dir={dirs['streamed']}"])
  assert len(losses(dirs["mem"])) == 4
  np.testing.assert_allclose(losses(dirs["streamed"]), losses(dirs["mem"]), rtol=1e-5)


def test_preparing_4x_the_images_adds_no_memory_and_twice_gives_the_same_bytes(tmp_path):
  """scripts/image_prepare_peak.py, in one process: prepare 300 noise PNGs of 96x96x3, the
  same again (byte-identical shards, index and manifest), then 1,200: the peak RSS grows by
  less than IMAGE_PREPARE_GROWTH (a prepare that held the set grew by 134 MiB), and each
  prepare ends with its progress line (images, MB of records, rates)."""
  proc = subprocess.run([sys.executable, "scripts/image_prepare_peak.py", "--examples=300",
                         "--size=96", f"--root={tmp_path}", "--json"], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  peaks = json.loads(proc.stdout.splitlines()[-1])
  print({k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items() if k not in ("rate", "cpu_ms")})  # Seen with -s.
  assert peaks["big"] - peaks["again"] < IMAGE_PREPARE_GROWTH < peaks["pixels"] / 2, peaks
  names = sorted(os.listdir(tmp_path / "small_set"))
  assert names == sorted(os.listdir(tmp_path / "again_set")) and len(names) == 4, names
  for name in names:
    assert digest(tmp_path / "small_set" / name) == digest(tmp_path / "again_set" / name), name
  assert json.load(open(tmp_path / "big_set" / prepared.MANIFEST))["examples"] == 1200
  assert "\nprepare: 1,200 images, " in proc.stderr, proc.stderr[-2000:]  # Its progress line's end.
