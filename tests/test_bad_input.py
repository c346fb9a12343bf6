"""Bad input: one validator (tfpar.config) before TensorFlow starts, one line, exit 2, nothing lost.

The table runs in this process through the same two calls the CLI makes before
TensorFlow starts (config.from_flags, then config.check_run against the run
directory and TF_CONFIG); a handful of cases run as real `python -m tfpar.train`
processes to show what a user sees. The property tests throw random numbers at
the numeric flags: from_flags raises ConfigError or returns a config that
makes sense, never anything else.
"""

import json
import math
import os
import resource

import numpy as np
import pytest
from absl import flags as absl_flags
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import TINY, make_config, run_modules, train_in_process
from tfpar.config import rundir
from tfpar.config.cluster import Cluster
from tfpar.config.schema import ConfigError

MWMS = lambda n: Cluster(spec={"worker": [f"127.0.0.1:{2000 + i}" for i in range(n)]},  # noqa: E731
                         task_type="worker", task_index=0)
PS = Cluster(spec={"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"],
                   "ps": ["127.0.0.1:2002"]}, task_type="chief", task_index=0)
PIPELINE = ["--pipeline_stages=2", "--num_cpu_devices=2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Paths the table points at: a file, a broken link, an unreadable glob, a saved run."""
  root = tmp_path_factory.mktemp("bad_input")
  (root / "a_file").write_text("not a directory")
  (root / "texts").mkdir()
  (root / "texts" / "good.txt").write_text("hello " * 100)
  os.symlink(root / "gone.txt", root / "texts" / "broken.txt")
  os.symlink(root / "gone.txt", root / "dangling.txt")
  run = root / "run"
  run.mkdir()
  saved = make_config(TINY + [f"--model_dir={run}"]).to_dict()
  (run / "config.json").write_text(json.dumps(saved))
  broken = root / "broken_run"
  broken.mkdir()
  (broken / "config.json").write_text('{"model": {"d_model": 3')
  return root


# (extra flags on top of TINY, the cluster or None, the flag the one line must name)
BAD = [
    (["--seed=-1"], None, "seed"),
    (["--seed=4294967296"], None, "seed"),
    (["--learning_rate=nan"], None, "learning_rate"),
    (["--learning_rate=inf"], None, "learning_rate"),
    (["--dropout=nan"], None, "dropout"),
    (["--eval_fraction=inf"], None, "eval_fraction"),
    (["--min_lr_ratio=nan"], None, "min_lr_ratio"),
    (["--weight_decay=-inf"], None, "weight_decay"),
    (["--clip_norm=nan"], None, "clip_norm"),
    (["--collective_timeout=0"], None, "collective_timeout"),
    (["--collective_timeout=-5"], None, "collective_timeout"),
    (["--collective_timeout=604800"], None, "collective_timeout"),  # a week: unbounded in effect
    (["--strategy=mirrored", "--num_cpu_devices=65", "--global_batch_size=65"], None,
     "num_cpu_devices"),
    (["--train_steps=2147483648"], None, "train_steps"),
    (["--seq_len=99999999999"], None, "seq_len"),
    (["--steps_per_call=2147483648"], None, "steps_per_call"),
    # Checks that used to run only once TensorFlow had started.
    (["--remat", "--dropout=0.1"] + PIPELINE, None, "remat"),
    (["--precision=mixed_float16"] + PIPELINE, None, "precision"),
    (["--virtual_stages=2", "--microbatches=2"] + PIPELINE, None, "virtual_stages"),
    (["--pipeline_schedule=interleaved", "--microbatches=2"] + PIPELINE, None, "virtual_stages"),
    (["--pipeline_schedule=interleaved", "--virtual_stages=2", "--microbatches=1",
      "--num_layers=4"] + PIPELINE, None, "microbatches"),
    (["--pipeline_schedule=interleaved", "--virtual_stages=2", "--num_layers=2",
      "--microbatches=2"] + PIPELINE, None, "num_layers"),
    (["--strategy=mirrored", "--num_cpu_devices=3"], None, "global_batch_size"),
    (["--strategy=multi_worker_mirrored"], MWMS(3), "global_batch_size"),
    # A TF_CONFIG left in the environment: each task would train alone (issue 18).
    (["--strategy=one_device"], MWMS(2), "strategy"),
    (["--strategy=mirrored", "--num_cpu_devices=2"], PS, "strategy"),
    (["--strategy=parameter_server", "--ps_shards=2"], PS, "ps_shards"),
    (["--strategy=multi_worker_mirrored", "--data_parallel=3"] + PIPELINE, MWMS(2),
     "data_parallel"),
    (["--strategy=multi_worker_mirrored", "--microbatches=3"] + PIPELINE, MWMS(2),
     "microbatches"),
    # Files and directories.
    (["--data={root}/dangling.txt"], None, "data"),
    (["--data={root}/texts/*.txt"], None, "data"),  # one of them a broken link
    (["--model_dir={root}/a_file"], None, "model_dir"),
    (["--model_dir={root}/a_file/run"], None, "model_dir"),
    (["--model_dir=/proc/1/tfpar-run"], None, "model_dir"),  # not writable, even for root
    (["--model_dir=/proc/tfpar_run"], None, "model_dir"),  # access() says yes; mkdir fails
    (["--model_dir={root}/broken_run"], None, "model_dir"),  # config.json cut short
    # A resume must keep what fixes the data order, and the model.
    (["--model_dir={root}/run", "--global_batch_size=16"], None, "global_batch_size"),
    (["--model_dir={root}/run", "--seed=7"], None, "seed"),
    (["--model_dir={root}/run", "--d_model=64"], None, "model_dir"),
    # Images decode to 1, 3 or 4 channels: another count is the flag's fault, not an image's.
    (["--task=classify", "--data={root}/texts", "--num_channels=2"], None, "num_channels"),
    (["--task=detect", "--data={root}/a_file", "--num_channels=5"], None, "num_channels"),
]


@pytest.mark.parametrize("extra,cluster,flag", BAD,
                         ids=[" ".join(e) + (" +TF_CONFIG" if c else "") for e, c, _ in BAD])
def test_bad_input_is_one_line_naming_the_flag(files, extra, cluster, flag):
  args = TINY + ["--model_dir=/tmp/tfpar-bad-input-unused"]
  args += [a.format(root=files) for a in extra]
  with pytest.raises(ConfigError) as info:
    rundir.check_run(make_config(args), cluster)
  message = str(info.value)
  assert f"--{flag}" in message, message
  assert "\n" not in message


def test_a_resume_with_the_same_flags_passes(files):
  rundir.check_run(make_config(TINY + [f"--model_dir={files / 'run'}",
                                           "--train_steps=500"]), None)


# --- the CLI: one line, exit 2, no traceback, the run directory untouched ----------------------


def snapshot(path):
  out = {}
  for root, _, names in os.walk(path):
    for name in names:
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        out[os.path.relpath(full, path)] = f.read()
  return out


def assert_one_line(proc, *words):
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout
  assert proc.stderr.count("\n") == 1, proc.stderr  # that line, and nothing else
  assert proc.stderr.startswith("tfpar.train: error: ")
  for word in words:
    assert word in proc.stderr, proc.stderr


OFFLINE = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "none", "GCS_RETRY_CONFIG_MAX_RETRIES": "1"}


def cap_memory():
  """Caps the child's address space (RLIMIT_AS, `ulimit -v 10G`) below what a 2.4B-parameter
  model and its AdamW slots need: TensorFlow used to segfault in an initializer (exit 139)."""
  resource.setrlimit(resource.RLIMIT_AS, (10 * 2 ** 30, 10 * 2 ** 30))


OOM_MODEL_DIR = "/tmp/tfpar_oom_never_written"


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
  """The CLI cases below, each its own `python -m tfpar.train`, started side by side once.

  One run for each way train.main ends on bad input: refused by from_flags or against
  TF_CONFIG before TensorFlow starts (seed, tf_config, channels), by the run directory
  once TensorFlow reads it (batch), by unreachable storage (gs, exit 1), by the runner
  when it reads the data (coco) or against `ulimit -v` (oom). Other cases of those paths
  run in this process through the same calls (the in-process tests among these).
  {case: (CompletedProcess, its directory, what the test compares after: a snapshot or a path)}.
  """
  from PIL import Image  # pylint: disable=import-outside-toplevel
  d = {case: tmp_path_factory.mktemp(case) for case in (
      "seed", "tf_config", "batch", "gs", "coco", "channels")}
  calls, kept = {}, {}
  # The two longest first: the short ones fill in beside them.
  calls["oom"] = ("tfpar.train", ["--num_layers=12", "--d_model=4096", "--num_heads=16",
                                  "--seq_len=32", "--global_batch_size=2", "--train_steps=2",
                                  f"--model_dir={OOM_MODEL_DIR}"], {"preexec_fn": cap_memory})

  data = d["coco"] / "instances.json"
  data.write_text(json.dumps(COCO))
  args, model_dir = DETECT + [f"--data={data}"], d["coco"] / "run"
  kept["coco"] = (data, a_started_run(model_dir, args))
  calls["coco"] = ("tfpar.train", args + [f"--model_dir={model_dir}"])

  calls["seed"] = ("tfpar.train", TINY + [f"--model_dir={d['seed'] / 'run'}", "--seed=-1"])

  # A TF_CONFIG naming worker 1 of two used to train as a non-chief: no output, exit 0, no files.
  tf_config = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                          "task": {"type": "worker", "index": 1}})
  calls["tf_config"] = ("tfpar.train", ["--flagfile=configs/gpt_tiny.flags",
                                        "--strategy=one_device",
                                        f"--model_dir={d['tf_config'] / 'run'}",
                                        "--train_steps=2"], {"env": {"TF_CONFIG": tf_config}})

  model_dir = d["batch"] / "run"
  args = TINY + ["--train_steps=2", "--jit_compile=false", f"--model_dir={model_dir}"]
  train_in_process(args)
  kept["batch"] = snapshot(model_dir)
  calls["batch"] = ("tfpar.train", args + ["--train_steps=4", "--global_batch_size=16"])

  # gs:// without network: the proxy points at a closed local port, so the case fails alike
  # with or without a network; the token variable skips the metadata server's retries.
  calls["gs"] = ("tfpar.train", TINY + ["--model_dir=gs://tfpar-no-such-bucket/run"],
                 {"env": OFFLINE})

  for name in ("cat", "dog"):
    (d["channels"] / "images" / name).mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(d["channels"] / "images" / name / "0.png")
  calls["channels"] = ("tfpar.train", TINY + ["--task=classify", "--num_classes=2",
                                              f"--data={d['channels'] / 'images'}",
                                              "--num_channels=2",
                                              f"--model_dir={d['channels'] / 'run'}"])
  procs = dict(zip(calls, run_modules(list(calls.values()))))
  return {case: (procs[case], d.get(case), kept.get(case)) for case in calls}


def test_cli_seed_out_of_range(cli):
  proc, tmp_path, _ = cli["seed"]
  assert_one_line(proc, "--seed=-1")
  assert not (tmp_path / "run").exists()


def test_model_dir_that_is_a_file_is_refused_and_the_file_kept(tmp_path):
  """The check train.main makes once TensorFlow can read --model_dir (the CLI's exit 2 and one
  line from that check: test_cli_resume_with_another_batch_leaves_the_run_untouched)."""
  path = tmp_path / "a_file"
  path.write_text("keep me")
  with pytest.raises(ConfigError) as info:
    rundir.check_run(make_config(TINY + [f"--model_dir={path}"]))
  assert "--model_dir" in str(info.value) and "is a file" in str(info.value)
  assert "\n" not in str(info.value)
  assert path.read_text() == "keep me"


def test_cli_tf_config_of_a_cluster_with_one_device_is_refused(cli):
  """A TF_CONFIG naming worker 1 of two used to train as a non-chief: no output, exit 0, no files."""
  proc, tmp_path, _ = cli["tf_config"]
  assert_one_line(proc, "TF_CONFIG", "--strategy=one_device", "unset TF_CONFIG",
                  "--strategy=multi_worker_mirrored")
  assert not (tmp_path / "run").exists()


def test_cli_resume_with_another_batch_leaves_the_run_untouched(cli):
  proc, tmp_path, before = cli["batch"]
  assert_one_line(proc, "--global_batch_size=16", "started with 8")
  assert snapshot(tmp_path / "run") == before


def test_tfrecord_of_other_records_is_one_user_error(tmp_path):
  """Found only when read (after TF starts): an error train.main turns into one line and exit 2
  (runner.USER_ERRORS; the CLI's side: test_cli_bad_coco_file_is_one_line_and_the_run_is_untouched),
  and no run directory."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  data = tmp_path / "notes.tfrecord"
  with tf.io.TFRecordWriter(str(data)) as writer:
    for i in range(20):  # serialized tf.train.Features, not tf.train.Example
      feature = tf.train.Feature(float_list=tf.train.FloatList(value=[float(i)] * 50))
      writer.write(tf.train.Features(feature={"x": feature}).SerializeToString())
  with pytest.raises(runner.USER_ERRORS) as info:
    train_in_process(TINY + [f"--model_dir={tmp_path / 'run'}", f"--data={data}",
                             "--jit_compile=false"])
  assert str(data) in str(info.value) and "\n" not in str(info.value), str(info.value)
  assert not (tmp_path / "run").exists()


def test_cli_address_space_below_the_models_state_is_one_line_before_tensorflow_runs(cli):
  """A model too large for `ulimit -v`: bad input (a restart would fail alike), refused from the
  plan's prediction before the runtime starts (tfpar.parallel.address_space), not a SIGSEGV."""
  proc, _, _ = cli["oom"]
  assert_one_line(proc, "10.00 GiB (ulimit -v)", "weights, gradients and AdamW slots take",
                  "python -m tfpar.plan")
  assert not os.path.exists(OOM_MODEL_DIR)


def test_model_dir_that_cannot_be_created_is_refused_before_the_data():
  """Under /proc even root's access() says writable; the directory cannot be made there.
  The run-directory check refuses it, and train.main makes it before the runner reads data."""
  with pytest.raises(ConfigError, match="--model_dir=/proc/tfpar_run cannot be created"):
    rundir.check_run(make_config(TINY + ["--model_dir=/proc/tfpar_run"]))


def test_cli_unreachable_gs_model_dir_is_one_line_and_exit_1(cli):
  """gs:// without network: exit 1 (the same command may work later), one line, no traceback."""
  proc, _, _ = cli["gs"]
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout
  assert proc.stderr.count("\n") == 1, proc.stderr
  assert "gs://tfpar-no-such-bucket/run cannot be reached" in proc.stderr
  assert "network" in proc.stderr


def a_started_run(model_dir, args):
  """A run directory as the chief leaves it once it has read the data: its config.json."""
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  runner.write_run_files(make_config(args + [f"--model_dir={model_dir}"]), ())
  return snapshot(model_dir)


DETECT = TINY + ["--task=detect", "--num_classes=2", "--image_size=8", "--num_channels=3",
                 "--jit_compile=false", "--train_steps=2"]
COCO = {"images": [{"id": 1, "file_name": "a.png", "width": 16, "height": 16}],
        "annotations": [{"id": 5, "image_id": 1, "category_id": 1}],  # no bbox
        "categories": [{"id": 1, "name": "one"}]}


def test_cli_bad_coco_file_is_one_line_and_the_run_is_untouched(cli):
  """Found only when read: once a KeyError traceback, exit 1 (test_image_readers has the rest)."""
  proc, tmp_path, (data, before) = cli["coco"]
  assert_one_line(proc, str(data), "annotation 0 (id 5) has no 'bbox'",
                  "add [x, y, width, height]")
  assert snapshot(tmp_path / "run") == before


def test_cli_num_channels_no_image_decodes_to_blames_the_flag(cli):
  """Once "0.png is not a readable image", of a good image, after TensorFlow had started."""
  proc, tmp_path, _ = cli["channels"]
  assert_one_line(proc, "--num_channels=2", "use 1 (greyscale), 3 (RGB) or 4")
  assert "0.png" not in proc.stderr
  assert not (tmp_path / "run").exists()


# --- properties over the numeric flags ---------------------------------------------------------

INT_FLAGS = ["seq_len", "num_layers", "d_model", "num_heads", "d_ff", "train_steps",
             "global_batch_size", "seed", "log_every", "eval_every", "eval_steps",
             "checkpoint_every", "keep_checkpoints", "steps_per_call", "num_cpu_devices",
             "collective_timeout", "ps_shards", "warmup_steps"]
FLOAT_FLAGS = ["learning_rate", "dropout", "eval_fraction", "min_lr_ratio", "weight_decay",
               "clip_norm"]
ints = st.one_of(st.integers(-3, 70), st.integers(-2 ** 64, 2 ** 64),
                 st.sampled_from([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(-2.0, 2.0), st.sampled_from([0.0, -0.0, 0.5, 1.0]))


def assert_sensible(cfg):
  """What every accepted config must hold, stated apart from the validator's own code."""
  m, d, o, t, s = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.dist
  for value in (o.learning_rate, m.dropout, d.eval_fraction, o.min_lr_ratio, o.weight_decay,
                o.clip_norm):
    assert math.isfinite(value)
  assert o.learning_rate > 0 and 0 <= m.dropout < 1 and 0 < d.eval_fraction < 0.5
  assert 0 <= o.min_lr_ratio <= 1 and o.weight_decay >= 0 and o.clip_norm >= 0
  for value in (m.seq_len, m.num_layers, m.d_model, m.num_heads, m.d_ff, t.train_steps,
                t.global_batch_size, t.log_every, t.checkpoint_every, t.keep_checkpoints,
                t.steps_per_call, s.ps_shards):
    assert 1 <= value < 2 ** 31
  assert 0 <= t.seed < 2 ** 32
  assert 0 < s.collective_timeout <= 24 * 3600
  assert 1 <= s.num_cpu_devices <= 64
  assert m.d_model % m.num_heads == 0
  assert 0 <= o.warmup_steps < t.train_steps
  assert t.eval_every >= 0 and t.eval_steps >= 0
  if s.strategy == "mirrored":
    assert t.global_batch_size % s.num_cpu_devices == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(INT_FLAGS), ints, max_size=4),
       st.dictionaries(st.sampled_from(FLOAT_FLAGS), floats, max_size=3),
       st.sampled_from(["one_device", "mirrored", "parameter_server"]))
def test_numeric_flags_give_a_config_error_or_a_sensible_config(int_values, float_values,
                                                                strategy):
  args = TINY + ["--model_dir=/tmp/tfpar-bad-input-unused", f"--strategy={strategy}"]
  args += [f"--{k}={v}" for k, v in int_values.items()]
  args += [f"--{k}={v!r}" for k, v in float_values.items()]
  try:
    cfg = make_config(args)
  except ConfigError as e:
    assert "\n" not in str(e)
    return
  except absl_flags.Error:  # absl's own parse errors: the CLI turns them into one line too.
    return
  assert_sensible(cfg)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(FLOAT_FLAGS), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_non_finite_float_flag_is_always_refused(flag, value):
  with pytest.raises(ConfigError, match=f"--{flag}="):
    make_config(TINY + ["--model_dir=/tmp/tfpar-bad-input-unused", f"--{flag}={value!r}"])


# --- the same properties for the other commands ------------------------------------------------

some_ints = st.one_of(st.integers(-3, 300), st.integers(-2 ** 64, 2 ** 64),
                      st.sampled_from([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 63]))


def _fake_run(root, task):
  """What generate's and predict's flag checks look for: config.json and a checkpoint index."""
  run = root.mktemp(f"fake_{task}_run")
  config = make_config(TINY + [f"--model_dir={run}", f"--task={task}"]).to_dict()
  (run / "config.json").write_text(json.dumps(config))
  (run / "checkpoints").mkdir()
  (run / "checkpoints" / "ckpt-1.index").write_bytes(b"")
  return run


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
  return _fake_run(tmp_path_factory, "lm")


@pytest.fixture(scope="module")
def fake_vision_run(tmp_path_factory):
  return _fake_run(tmp_path_factory, "classify")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(["max_new_tokens", "top_k", "seed"]), some_ints,
                              max_size=3),
       temperature=floats, logits=st.lists(st.floats(-1e30, 1e30), min_size=256, max_size=256))
def test_generate_flags_are_refused_in_one_line_or_sample_a_byte(values, temperature, logits,
                                                                 fake_run):
  """Whatever generate's check accepts samples: e.g. --temperature=1e-310 used to give NaNs."""
  from tfpar.cli import generate  # pylint: disable=import-outside-toplevel
  fv = generate.define_flags()
  try:
    fv(["generate", f"--model_dir={fake_run}", f"--temperature={temperature!r}"]
       + [f"--{k}={v}" for k, v in values.items()])
    generate.check(fv)
  except generate.GenerateError as e:
    assert "\n" not in str(e)
    return
  except absl_flags.Error:
    return
  rng = np.random.default_rng(fv.seed)
  assert 0 <= generate.pick(np.array(logits), fv.temperature, fv.top_k, rng) < 256


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=floats)
def test_predict_score_threshold_is_refused_in_one_line_or_in_range(value, fake_vision_run):
  from tfpar.cli import predict  # pylint: disable=import-outside-toplevel
  fv = predict.define_flags()
  fv(["predict", f"--model_dir={fake_vision_run}", f"--image={fake_vision_run}",
      f"--score_threshold={value!r}"])
  try:
    predict.check(fv)
  except predict.PredictError as e:
    assert "\n" not in str(e) and "--score_threshold" in str(e)
    return
  assert 0 <= fv.score_threshold <= 1


PLAN_INTS = ["num_layers", "d_model", "num_heads", "d_ff", "seq_len", "vocab_size",
             "global_batch_size", "top", "data_parallel", "pipeline_stages", "tensor_parallel",
             "microbatches", "virtual_stages"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(PLAN_INTS), some_ints, max_size=4),
       st.sampled_from(["cpu:8", "a100-80gb:64", "tpu-v4:16"]))
def test_plan_flags_are_refused_in_one_line_or_give_a_plan_that_prints(values, cluster):
  """A zero degree used to divide by zero, a huge model to fill memory with its stage splits."""
  from tfpar.config import flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  from tfpar.cli import plan as plan_cli  # pylint: disable=import-outside-toplevel
  from tfpar.planner import clusters, report  # pylint: disable=import-outside-toplevel
  fv = tfpar_flags.define_plan_flags(absl_flags.FlagValues())
  fv(["plan", "--flagfile=configs/gpt_tiny.flags", f"--cluster={cluster}"]
     + [f"--{k}={v}" for k, v in values.items()])
  try:
    m, c, system, ranked = plan_cli.answer(fv)
  except (ConfigError, clusters.ClusterError, plan_cli.PlanError) as e:
    assert "\n" not in str(e)
    return
  assert ranked.results["fits"][ranked.order[0]]
  assert report.text(m, c, ranked, fv.top, fv.precision, system)
  assert json.dumps(report.to_json(m, c, ranked, fv.top, fv.precision, system))


K8S_INTS = ["workers", "ps", "gpus_per_worker", "port", "grace_seconds", "max_restarts",
            "peer_timeout"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(K8S_INTS), some_ints, max_size=4),
       st.sampled_from(["tfjob", "jobset", "indexed-job"]),
       st.sampled_from(["multi_worker_mirrored", "parameter_server"]),
       st.dictionaries(st.sampled_from(["global_batch_size", "ps_shards"]), some_ints, max_size=1))
def test_k8s_flags_are_refused_in_one_line_or_render_valid_manifests(values, kind, strategy,
                                                                     train_values):
  import k8s_validate  # pylint: disable=import-outside-toplevel
  import yaml  # pylint: disable=import-outside-toplevel
  from tfpar.cli import k8s as k8s_cli  # pylint: disable=import-outside-toplevel
  values = {"workers": 2, **values}
  argv = (["render", f"--kind={kind}", "--name=gpt", "--image=registry.example/tfpar:1"]
          + [f"--{k}={v}" for k, v in values.items()]
          + ["--", "--flagfile=configs/gpt_tiny.flags", f"--strategy={strategy}",
             "--model_dir=gs://bucket/runs/gpt"] + [f"--{k}={v}" for k, v in train_values.items()])
  try:
    job = k8s_cli.parse(argv)
  except k8s_cli.RenderError as e:
    assert "\n" not in str(e)
    return
  for obj in yaml.safe_load_all(k8s_cli.to_yaml(job, argv)):
    k8s_validate.validate_offline(obj)


OUT_PATHS = ["/proc/sp.model", "/proc/1/sp.model", "{root}/a_file", "{root}/a_file/sp.model",
             "{root}/texts", "{root}/new/dir/sp.model", "{root}/sp.model", "", "sp\udcff.model"]


def tree(root):
  """Every path under root (directories and links too), and a_file's bytes: what a refused
  command must leave as it was."""
  paths = sorted(os.path.join(d, n) for d, dirs, names in os.walk(root) for n in dirs + names)
  return paths, (root / "a_file").read_bytes()


def refused_by_the_cli(main, argv, tool, root):
  """main(argv) in this process, as `python -m` calls it: exit 2 and one line on stderr naming
  a flag (a traceback would be an exception raised here), and nothing written under root."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  before, stderr = tree(root), io.StringIO()
  with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as info:
    main(argv)
  assert info.value.code == 2, stderr.getvalue()
  assert stderr.getvalue().count("\n") == 1, stderr.getvalue()
  assert stderr.getvalue().startswith(f"{tool}: error: --"), stderr.getvalue()
  assert tree(root) == before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab_size=some_ints, out=st.sampled_from(OUT_PATHS),
       data=st.sampled_from([None, "{root}/texts", "{root}/\udcfe*.txt"]))
def test_tokenizer_train_flags_are_refused_in_one_line_or_make_sense(vocab_size, out, data, files):
  """tfpar.tokenizer train's checks (all made before any text is read): exit 2 and one line,
  nothing written, or a vocabulary SentencePiece can count and an --out where a new file can
  be written."""
  from tfpar import tokenizer  # pylint: disable=import-outside-toplevel
  from tfpar.cli import tokenizer as tokenizer_cli  # pylint: disable=import-outside-toplevel
  fv = tokenizer_cli.define_train_flags()
  argv = ["tokenizer", "train", f"--vocab_size={vocab_size}", f"--out={out.format(root=files)}"]
  argv += [f"--data={data.format(root=files)}"] if data else []
  fv(argv)
  try:
    tokenizer_cli.check_train_flags(fv)
  except tokenizer.TokenizerError as e:
    assert "\n" not in str(e) and "--" in str(e)
    refused_by_the_cli(tokenizer_cli.main, argv, "tfpar.tokenizer", files)
    return
  assert 260 <= fv.vocab_size < 2 ** 31
  assert not os.path.isdir(fv.out)
  assert_can_be_made(os.path.dirname(os.path.abspath(fv.out)))
  fv.out.encode("utf-8")
  assert fv.data is None or fv.data.encode("utf-8")


def assert_can_be_made(path):
  """`path` exists, or its nearest existing ancestor is a directory outside /proc."""
  while not os.path.exists(path):
    path = os.path.dirname(path)
  assert os.path.isdir(path) and not path.startswith("/proc")


PREPARE_OUTS = ["/proc/prep", "/proc/1/prep", "{root}/a_file", "{root}/a_file/prep",
                "{root}/new/dir/prep", "{root}/prep", "{root}/texts", "", "prep\udcff"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(["num_shards", "workers"]), some_ints, max_size=2),
       out=st.sampled_from(PREPARE_OUTS),
       data=st.sampled_from([None, "{root}/texts", "{root}/\udcfe*.txt"]),
       spec=st.sampled_from(["bytes", "sentencepiece:{root}/\udcff.model"]),
       task=st.sampled_from(["lm", "classify"]))
def test_data_prepare_flags_are_refused_in_one_line_or_make_sense(values, out, data, spec, task,
                                                                   files):
  """tfpar.data prepare's checks (all made before the tokenizer or any text is read): exit 2
  and one line, nothing written, or counts it can use and an --out where a directory can go
  (--workers > 1 for text only: image prepare runs in one process)."""
  from tfpar.cli import data as data_cli  # pylint: disable=import-outside-toplevel
  from tfpar.data import corpus  # pylint: disable=import-outside-toplevel
  fv = data_cli.define_prepare_flags()
  argv = ["data", "prepare", f"--out={out.format(root=files)}",
          f"--tokenizer={spec.format(root=files)}", f"--task={task}"]
  argv += [f"--{k}={v}" for k, v in values.items()]
  argv += [f"--data={data.format(root=files)}"] if data else []
  try:
    fv(argv)
  except absl_flags.Error:  # Past int64: absl's own error, which the CLI turns into one line.
    refused_by_the_cli(data_cli.main, argv, "tfpar.data", files)
    return
  try:
    data_cli.check_prepare_flags(fv)
  except corpus.DataError as e:
    assert "\n" not in str(e) and "--" in str(e)
    refused_by_the_cli(data_cli.main, argv, "tfpar.data", files)
    return
  assert 1 <= fv.num_shards < 2 ** 31 and 1 <= fv.workers <= data_cli.MAX_WORKERS
  assert fv.workers == 1 or fv.task == "lm"
  assert not os.path.isfile(fv.out)
  assert_can_be_made(os.path.abspath(fv.out))
  for value in (fv.out, fv.data or "", fv.tokenizer):
    value.encode("utf-8")
