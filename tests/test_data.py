"""The data pipeline: packing, order under --seed, resume position, held-out split, readers."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import TINY, make_config
from tfpar.data import corpus, pipeline
from tfpar.data.pipeline import Shard

SEQ = 8
# Position p holds byte p, so a window's first input token / SEQ is its window index.
STREAM = np.arange(30 * SEQ + 1, dtype=np.uint8)  # 30 windows of SEQ + 1 tokens, stride SEQ
WINDOWS = pipeline.num_windows(STREAM, SEQ)


def batches(tokens=STREAM, shard=Shard(5), n=6, **kwargs):
  """The first n (inputs, targets) batches as numpy."""
  kwargs.setdefault("seed", 0)
  ds = pipeline.window_dataset(tokens, SEQ, shard, **kwargs)
  return [(x.numpy(), y.numpy()) for x, y in ds.take(n)]


def window_ids(batch_list):
  return np.concatenate([x[:, 0] // SEQ for x, _ in batch_list])


def test_packing_shifts_targets_by_one():
  for inputs, targets in batches():
    assert inputs.shape == targets.shape == (5, SEQ)
    assert inputs.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    starts = inputs[:, :1] // SEQ * SEQ
    np.testing.assert_array_equal(inputs, starts + np.arange(SEQ))  # a contiguous window
    np.testing.assert_array_equal(targets, starts + np.arange(1, SEQ + 1))


def test_windows_cover_the_stream_once_per_epoch():
  assert WINDOWS == 30
  in_order = window_ids(batches(shuffle=False))  # 6 x 5 = one epoch
  np.testing.assert_array_equal(in_order, np.arange(WINDOWS))
  shuffled = window_ids(batches(n=12))  # two epochs
  for epoch in (shuffled[:WINDOWS], shuffled[WINDOWS:]):
    np.testing.assert_array_equal(np.sort(epoch), np.arange(WINDOWS))
  assert not np.array_equal(shuffled[:WINDOWS], np.arange(WINDOWS))  # it does shuffle
  assert not np.array_equal(shuffled[:WINDOWS], shuffled[WINDOWS:])  # each epoch anew


def test_order_is_a_function_of_the_seed():
  a, b = window_ids(batches(seed=1)), window_ids(batches(seed=1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, window_ids(batches(seed=2)))


@pytest.mark.parametrize("start_step", [1, 5, 7])  # 7 crosses the first epoch boundary
def test_start_step_resumes_where_skipping_would(start_step):
  straight = window_ids(batches(n=10, seed=3))
  resumed = window_ids(batches(n=10 - start_step, seed=3, start_step=start_step))
  np.testing.assert_array_equal(resumed, straight[start_step * 5:])


def test_replica_shards_make_up_the_global_batch():
  """R pipelines' per-replica batches, side by side, are the one-device global batch."""
  whole = window_ids(batches(shard=Shard(8), n=4, seed=5))
  parts = [window_ids(batches(shard=Shard(8, 4, r, 1), n=4, seed=5)).reshape(4, 2)
           for r in range(4)]
  np.testing.assert_array_equal(np.concatenate(parts, axis=1).ravel(), whole)
  # One pipeline feeding 2 local replicas yields them in turn.
  local = window_ids(batches(shard=Shard(8, 4, 2, 2), n=8, seed=5)).reshape(4, 2, 2)
  np.testing.assert_array_equal(local[:, 0], parts[2])
  np.testing.assert_array_equal(local[:, 1], parts[3])


def test_held_out_split_is_the_disjoint_tail(tmp_path):
  path = tmp_path / "text.txt"
  path.write_bytes(b"a" * 900 + b"b" * 99)  # + the document separator = 1000 tokens
  data = pipeline.load_corpus(str(path), seq_len=SEQ, eval_fraction=0.1)
  assert len(data.train) == 900 and len(data.eval) == 100
  assert set(data.train.tolist()) == {ord("a")}
  assert set(data.eval.tolist()) == {ord("b"), 0}
  eval_ids = batches(data.eval, n=2, shuffle=False)
  assert all(set(np.unique(x)) <= {ord("b"), 0} for x, _ in eval_ids)


def test_held_out_split_keeps_a_whole_window():
  train, held_out = pipeline.split_tokens(np.zeros(100, np.uint8), seq_len=SEQ, eval_fraction=0.01)
  assert len(held_out) == SEQ + 1 and len(train) == 100 - SEQ - 1


def test_too_small_corpus_is_a_clear_error(tmp_path):
  path = tmp_path / "tiny.txt"
  path.write_text("too short")
  with pytest.raises(corpus.DataError, match="--seq_len"):
    pipeline.load_corpus(str(path), seq_len=SEQ, eval_fraction=0.05)


def write_tfrecord(path, docs, key="text"):
  with tf.io.TFRecordWriter(str(path)) as writer:
    for doc in docs:
      feature = {key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[doc]))}
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def test_tfrecord_shards_are_read_as_documents(tmp_path):
  write_tfrecord(tmp_path / "part-0.tfrecord", [b"first doc", b"second"])
  write_tfrecord(tmp_path / "part-1.tfrecord", ["third \xe9".encode()])
  files = corpus.list_files(str(tmp_path / "*.tfrecord"))
  assert [f.rsplit("/", 1)[1] for f in files] == ["part-0.tfrecord", "part-1.tfrecord"]
  tokens = corpus.read_tokens(files)
  assert tokens.tobytes() == "first doc\0second\0third \xe9\0".encode()
  with pytest.raises(corpus.DataError, match="--tfrecord_key"):
    corpus.read_tokens(files, tfrecord_key="body")


def test_a_broken_tfrecord_is_a_clear_error(tmp_path):
  path = tmp_path / "broken.tfrecord"
  path.write_bytes(b"this is not a record file at all, just text" * 3)
  with pytest.raises(corpus.DataError, match="not a valid TFRecord"):
    corpus.read_tokens([str(path)])


def test_directory_and_glob(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "b.txt").write_text("bee")
  (tmp_path / "a.txt").write_text("ay")
  (tmp_path / "sub" / "c.md").write_text("sea")
  (tmp_path / ".hidden").write_text("never read")
  from_dir = corpus.list_files(str(tmp_path))
  assert [f[len(str(tmp_path)) + 1:] for f in from_dir] == ["a.txt", "b.txt", "sub/c.md"]
  assert corpus.read_tokens(from_dir).tobytes() == b"ay\0bee\0sea\0"
  assert corpus.list_files(str(tmp_path / "*.txt")) == from_dir[:2]
  with pytest.raises(corpus.DataError, match="--data"):
    corpus.list_files(str(tmp_path / "*.json"))


def test_default_corpus_is_real_text():
  files = corpus.default_corpus_files()
  assert len(files) > 20 and all(f.endswith(".py") for f in files)
  text = corpus.read_tokens(files[:3]).tobytes()
  assert b"import" in text


def test_bytes_round_trip():
  text = "héllo, wörld"
  assert corpus.decode(corpus.encode(text)) == text
  assert corpus.decode([0xff, ord("a")]) == "\ufffda"  # a byte model may emit invalid UTF-8


def test_the_start_up_line_counts_in_words(tmp_path):
  """Once "1 files" and "for 1 steps": a count agrees with its noun (tfpar.console.count)."""
  from tfpar import console, runner, tasks  # pylint: disable=import-outside-toplevel
  (tmp_path / "one.txt").write_text("hello, world. " * 200)
  cfg = make_config(TINY + [f"--data={tmp_path / 'one.txt'}", "--model_dir=/tmp/unused",
                            "--train_steps=1", "--warmup_steps=0"])
  task = tasks.make(cfg)
  data, _ = task.load_data()
  assert task.describe_data(data).startswith("1 file, "), task.describe_data(data)
  line = runner.describe_run(cfg, {"strategy": "one_device", "replicas": 1, "parameters": 10})
  assert "for 1 step of 8 sequences x 32 tokens, on 1 replica (one_device)" in line, line
  assert console.count(1, "box", "boxes") == "1 box" and console.count(0, "box", "boxes") == \
      "0 boxes" and console.count(1200, "step") == "1,200 steps"


def test_the_data_flag_says_what_each_task_reads():
  """Its help spoke of text only, whatever --task."""
  from tfpar.config import flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  help_text = tfpar_flags.parse([])["data"].help
  for words in ("lm: text", "classify: a directory with one sub-directory of images per class",
                "detect: a COCO instances JSON", "segment: a directory with images/",
                "TFRecord shards"):
    assert words in help_text, help_text
