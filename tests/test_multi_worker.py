"""multi_worker_mirrored with 2 real worker processes on 127.0.0.1, against one device.

Two workers started by tfpar.launch (each its own TF_CONFIG, a RING all-reduce
over gRPC) with --input_sharding=data read, at every step, the two halves of
the global batch one device reads whole; their loss is the one device's, step
for step. The chief alone writes metrics, summaries, config.json and
checkpoints, and checkpoints move between one_device, mirrored and
multi_worker_mirrored in both directions.

The two workers shard AdamW's state (tfpar.parallel.zero): the first job with
--optimizer_sharding=zero1 (each worker holds m and v of half the parameters;
its checkpoint, gathered from both, holds one device's slots and restores
unsharded), the resumed one with zero2 from an unsharded checkpoint; a third job,
beside the first, with zero3 (each worker holds half of every weight's rows, and of m
and v; tfpar.parallel.zero3) clipping every step under --on_nonfinite=skip, the twin of
one device with the same flags: loss and gradient norm per step, and its checkpoints'
weights, m and v (m carries the gradients). Plain
unsharded multi-worker runs are tested in test_launch, test_compression and
test_preemption.

--jit_compile=false in every run: XLA compiles the step once per process,
~30 s per worker on 2 cores, and changes nothing checked here (the gradient
all-reduce runs outside the compiled function, in the replica context).
"""

import glob
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from conftest import (TINY, assert_same_state, make_config, read_metrics,
                      run_module_in_background, selected_tests_use, train_in_process)
from tfpar import strategies
from tfpar.config.cluster import Cluster
from tfpar.config.schema import ConfigError
from tfpar.data import pipeline
from tfpar.training.checkpoint import CanonicalCheckpointer, read_canonical, read_checkpoint
from tfpar.engines.data_parallel import DataParallelEngine

STEPS = 6
ARGS = TINY + [f"--train_steps={STEPS}", "--seed=3", "--input_sharding=data",
               "--jit_compile=false"]
TWO_WORKERS = ["--num_workers=2", "--", *ARGS, "--strategy=multi_worker_mirrored"]
MIRRORED = ["--strategy=mirrored", "--num_cpu_devices=4"]
REL_TOL = 1e-4


def losses(model_dir):
  return np.array([r["loss"] for r in read_metrics(str(model_dir))])


def assert_same_losses(actual, expected):
  assert len(actual) == len(expected)
  np.testing.assert_allclose(actual, expected, rtol=REL_TOL, atol=0)


@pytest.fixture(scope="module")
def one_device_dir(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("one_device")
  train_in_process(ARGS + ["--strategy=one_device", f"--model_dir={model_dir}"])
  return model_dir


ZERO3 = ["--clip_norm=0.05", "--on_nonfinite=skip", "--checkpoint_every=3"]


@pytest.fixture(scope="module", autouse=True)
def started_zero3(request, tmp_path_factory):
  """The 2-worker zero3 job of `zero3_workers`, started before this module's in-process runs."""
  if not selected_tests_use(request, "zero3_workers"):
    return None
  model_dir = tmp_path_factory.mktemp("zero3_workers")
  return model_dir, run_module_in_background(
      "tfpar.launch", TWO_WORKERS + ZERO3 + [f"--model_dir={model_dir}", "--collective=ring",
                                             "--optimizer_sharding=zero3"], timeout=600)


@pytest.fixture(scope="module")
def zero3_workers(started_zero3, tmp_path_factory):
  """(model_dir, launcher output, one device's model_dir with the same flags)."""
  one_dir = tmp_path_factory.mktemp("one_device_zero3")
  train_in_process(ARGS + ZERO3 + ["--strategy=one_device", f"--model_dir={one_dir}"])
  model_dir, future = started_zero3
  proc = future.result()
  return model_dir, proc.stdout + proc.stderr, one_dir


def test_two_zero3_workers_are_one_devices_twin(zero3_workers):
  """Loss and gradient norm per step (clipped every step) at 1e-5; both checkpoints' weights,
  m and v, gathered from the two workers' rows, one device's; each worker holds half."""
  model_dir, output, one_dir = zero3_workers
  assert "optimizer sharding zero3" in output
  got, want = read_metrics(str(model_dir)), read_metrics(str(one_dir))
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
  assert min(r["grad_norm"] for r in want) > 0.05  # Clipping binds on every step.
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5)
  for step in (3, STEPS):
    assert_same_state(read_checkpoint(str(model_dir / "checkpoints" / f"ckpt-{step}")),
                      read_checkpoint(str(one_dir / "checkpoints" / f"ckpt-{step}")),
                      f"zero3 on 2 workers, step {step}")
  plan = json.loads((model_dir / "plan.json").read_text())
  single = json.loads((one_dir / "plan.json").read_text())["measured_bytes_per_device"]
  assert plan["measured_bytes_per_device"] == plan["bytes_per_device"]
  (measured,), (single,) = plan["measured_bytes_per_device"].values(), single.values()
  assert abs(measured["parameters"] / (single["parameters"] / 2) - 1) < 0.1


def test_zero3_workers_end_with_the_threads_they_started_with(zero3_workers):
  """No thread per collective: TensorFlow enforces a collective's timeout with a thread that
  sleeps it out, one per collective launched, and a zero3 step launches dozens (each part's
  gathers and sums), so with a timeout on each (300 s) a worker gained hundreds of threads
  a step until it could start no more and aborted (docs/failures.md). tfpar sets none."""
  output = zero3_workers[1]
  threads = lambda when: int(re.search(
      rf"^\[worker 0\] memory {when}, process \(worker 0\).*?, (\d+) threads;", output,
      re.M).group(1))
  assert threads(f"after step {STEPS}") < threads("at start-up") + 50, output[-3000:]


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
  """The 2-worker job of `two_workers`, started before this module's in-process runs."""
  if not selected_tests_use(request, "two_workers"):
    return None
  model_dir = tmp_path_factory.mktemp("two_workers")
  # TF_CPP_MIN_LOG_LEVEL=0: TensorFlow's C++ warnings (tf.data's auto-shard one among them)
  # are shown, not hidden as tfpar.train does by default, since the logs are checked.
  return model_dir, run_module_in_background(
      "tfpar.launch", TWO_WORKERS + [f"--model_dir={model_dir}", "--collective=ring",
                                     "--checkpoint_every=3", "--optimizer_sharding=zero1"],
      env={"TF_CPP_MIN_LOG_LEVEL": "0"}, timeout=600)


@pytest.fixture(scope="module")
def two_workers(started, one_device_dir):
  """(model_dir, launcher output) of a 2-worker run that saves at steps 3 and 6.

  (one_device_dir first: it trains in this process while the two workers run.)
  """
  del one_device_dir
  model_dir, future = started
  proc = future.result()
  return model_dir, proc.stdout + proc.stderr


def test_two_workers_train_with_the_loss_of_one_device_step_for_step(two_workers, one_device_dir):
  model_dir, _ = two_workers
  assert_same_losses(losses(model_dir), losses(one_device_dir))
  records = read_metrics(str(model_dir))
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for record in records:
    assert record["replicas"] == 2 and record["workers"] == 2
    assert record["step_time"] > 0
  single = read_metrics(str(one_device_dir))
  assert single[-1]["replicas"] == 1 and single[-1]["workers"] == 1


def test_two_zero1_workers_hold_half_the_slots_and_save_one_devices(two_workers, one_device_dir):
  """zero1's checkpoint, m and v gathered from both workers, is one device's at 1e-5."""
  model_dir, output = two_workers
  sharded = read_checkpoint(str(model_dir / "checkpoints" / f"ckpt-{STEPS}"))
  serial = read_checkpoint(str(one_device_dir / "checkpoints" / f"ckpt-{STEPS}"))
  assert_same_state(sharded, serial, "zero1 on 2 workers")
  (plan,) = json.loads((model_dir / "plan.json").read_text())["measured_bytes_per_device"].values()
  slots = sum(v.size * 4 for n, v in serial.items() if n.endswith(("@m", "@v")))
  assert plan["optimizer"] == 8 * -(-slots // 16) + 8  # Half of m and v, and the step counter.
  assert "optimizer sharding zero1" in output


def test_the_console_line_shows_replicas_workers_and_step_time(two_workers):
  _, output = two_workers
  assert re.search(rf"^\[worker 0\] step +{STEPS}/{STEPS} \| loss \d+\.\d+ \| .* tok/s \| "
                   r" *\d+\.\d ms/step \| .* \| 2 replicas on 2 workers$", output, re.M), output
  assert "[worker 1] step" not in output  # only the chief reports


def test_only_the_chief_writes_and_worker_temp_dirs_are_gone(two_workers):
  model_dir, output = two_workers
  pids = dict(re.findall(r"started (worker \d) \(pid (\d+)\)", output))
  assert (model_dir / "config.json").exists()
  assert len(read_metrics(str(model_dir), "eval")) == 1
  # TensorBoard event files are named ...tfevents.<time>.<host>.<pid>.<n>.v2: the chief's pid.
  events = glob.glob(str(model_dir / "*" / "events.out.tfevents.*"))
  assert {os.path.basename(os.path.dirname(e)) for e in events} == {"train", "eval"}
  assert {e.split(".")[-3] for e in events} == {pids["worker 0"]}, events
  # Both saves published (an index each, over their data files: one bundle per host whose
  # slices were written), nothing left of the writes in between (ckpt-N.tmp/).
  names = sorted(os.listdir(model_dir / "checkpoints"))
  assert [n for n in names if ".data-" not in n] == ["checkpoint", "ckpt-3.index", "ckpt-6.index"]
  assert {n.split(".")[0] for n in names if ".data-" in n} == {"ckpt-3", "ckpt-6"}, names
  assert sorted(os.listdir(model_dir)) == ["checkpoints", "config.json", "eval",
                                           "metrics.jsonl", "plan.json", "train"]


def test_the_logs_are_prefixed_and_free_of_auto_shard_warnings(two_workers):
  _, output = two_workers
  assert not re.search(r"auto.?shard", output, re.I), "we shard ourselves: AutoShardPolicy.OFF"
  for line in output.splitlines():
    if line:
      assert re.match(r"^(tfpar\.launch: |\[worker [01]\] )", line), line


def test_multi_worker_without_tf_config_or_with_nccl_on_cpu_is_a_clear_error():
  cfg = make_config(ARGS + ["--strategy=multi_worker_mirrored", "--model_dir=/tmp/unused"])
  with pytest.raises(ConfigError, match="needs TF_CONFIG: start the job with python -m "
                                        "tfpar.launch --num_workers=N"):
    strategies.make_strategy(cfg.dist, Cluster())
  nccl = make_config(ARGS + ["--strategy=multi_worker_mirrored", "--collective=nccl",
                             "--model_dir=/tmp/unused"])
  two = Cluster(spec={"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, task_type="worker")
  with pytest.raises(ConfigError, match="--collective=nccl needs GPUs"):
    strategies.make_strategy(nccl.dist, two)


def restored_engine(strategy_args, checkpoint, model_dir):
  """A fresh engine under another strategy, the checkpoint restored into it as the loop does."""
  cfg = make_config(ARGS + strategy_args + [f"--model_dir={model_dir}"])
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  strategy = strategies.make_strategy(cfg.dist, Cluster())
  corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                eval_fraction=cfg.data.eval_fraction)
  engine = DataParallelEngine(cfg, strategy, corpus)
  assert CanonicalCheckpointer(engine.layouts, str(model_dir)).restore(checkpoint)
  return engine


ZERO1_X2 = ["--strategy=mirrored", "--num_cpu_devices=2", "--optimizer_sharding=zero1"]


@pytest.mark.parametrize("job, strategy_args", [
    ("two_workers", ["--strategy=one_device"]), ("two_workers", MIRRORED),
    ("zero3_workers", ["--strategy=one_device"]), ("zero3_workers", ZERO1_X2)],
                         ids=["one_device", "mirrored", "zero3_one_device", "zero3_zero1_x2"])
def test_a_two_worker_checkpoint_restores_under_one_device_and_mirrored(request, tmp_path, job,
                                                                        strategy_args):
  """zero1's checkpoint (gathered by the chief), and zero3's (each worker wrote its own rows),
  restore exactly under one device, and under 4 mirrored replicas or zero1 on 2."""
  model_dir = request.getfixturevalue(job)[0]
  checkpoint = str(model_dir / "checkpoints" / f"ckpt-{STEPS}")
  saved = read_checkpoint(checkpoint)
  engine = restored_engine(strategy_args, checkpoint, tmp_path)
  restored = read_canonical(engine.layouts[0])
  assert sorted(restored) == sorted(saved)
  for name, value in saved.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  assert engine.step == STEPS
  # Every replica's copy, not only the first one read_canonical gathers.
  for var in engine.model.trainable_variables:
    name = next(n for n, (_, shards) in engine.layouts[0].items() if shards[0] is var)
    for copy in engine.strategy.experimental_local_results(var):
      np.testing.assert_array_equal(np.asarray(tf.convert_to_tensor(copy)), saved[name], name)


def test_zero3_resumes_its_rows_under_zero1_and_zero1s_under_two_zero3_workers(
    zero3_workers, tmp_path):
  """zero3's step-3 checkpoint (two bundles, each worker's rows) resumed by zero1 on 2 mirrored
  replicas, whose step-4 checkpoint (written whole) two zero3 workers resume, each reading
  only its rows: every step's loss and gradient norm is the uninterrupted zero3 run's and
  one device's at 1e-5, and the final state one device's."""
  model_dir, _, one_dir = zero3_workers
  zero1, workers = tmp_path / "zero1", tmp_path / "workers"
  for run in (zero1, workers):
    (run / "checkpoints").mkdir(parents=True)
  for path in glob.glob(str(model_dir / "checkpoints" / "ckpt-3.*")):
    shutil.copy(path, zero1 / "checkpoints")
  train_in_process(ARGS + ZERO3 + ZERO1_X2 + ["--checkpoint_every=1", "--eval_steps=0",
                                              f"--model_dir={zero1}"])
  for path in glob.glob(str(zero1 / "checkpoints" / "ckpt-4.*")):
    shutil.copy(path, workers / "checkpoints")
  proc = run_module_in_background("tfpar.launch", TWO_WORKERS + ZERO3 + [
      f"--model_dir={workers}", "--collective=ring", "--optimizer_sharding=zero3",
      "--eval_steps=0"], timeout=600).result()
  assert re.search(r"\[worker 0\] resumed from .*ckpt-4 at step 4", proc.stdout), proc.stdout
  for run, steps in ((zero1, [4, 5, 6]), (workers, [5, 6])):
    got = read_metrics(str(run))
    assert [r["step"] for r in got] == steps
    for want in (read_metrics(str(model_dir)), read_metrics(str(one_dir))):
      for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [want[s - 1][key] for s in steps],
                                   rtol=1e-5, err_msg=f"{run.name} {key}")
  assert_same_state(read_checkpoint(str(workers / "checkpoints" / "ckpt-6")),
                    read_checkpoint(str(one_dir / "checkpoints" / "ckpt-6")), "resumed zero3")


def test_a_mirrored_checkpoint_resumes_under_two_workers_as_under_one_device(one_device_dir,
                                                                           tmp_path):
  """The other way round: a checkpoint written under 4 mirrored replicas, resumed by two workers.

  The mirrored engine restores one device's step-6 checkpoint and writes its
  own (the same numbers, or the canonical layout would be broken); two workers
  resume from it to step 8, one device from its own. Both workers must have
  restored exactly the saved weights: the loss of step 7 is computed with them
  before any update, half of it on each worker, and equals one device's.
  """
  saved_by_one = read_checkpoint(str(one_device_dir / "checkpoints" / f"ckpt-{STEPS}"))
  two_dir, one_dir = tmp_path / "two_workers", tmp_path / "one_device"
  shutil.copytree(one_device_dir, one_dir)
  engine = restored_engine(MIRRORED, str(one_device_dir / "checkpoints" / f"ckpt-{STEPS}"),
                           tmp_path)
  written = CanonicalCheckpointer(engine.layouts, str(two_dir / "checkpoints")).save(STEPS)
  saved_by_mirrored = read_checkpoint(written)
  for name, value in saved_by_one.items():
    np.testing.assert_array_equal(saved_by_mirrored[name], value, err_msg=name)

  resumed = ["--train_steps=8", "--eval_steps=0"]  # eval under 2 workers is tested above
  job = run_module_in_background("tfpar.launch", TWO_WORKERS + resumed + [
      f"--model_dir={two_dir}", "--optimizer_sharding=zero2"], timeout=600)
  train_in_process(ARGS + resumed + ["--strategy=one_device", f"--model_dir={one_dir}"])
  proc = job.result()  # The two workers ran beside the one-device run of this process.
  assert re.search(rf"\[worker 0\] resumed from .*ckpt-{STEPS} at step {STEPS}", proc.stdout)
  two = read_metrics(str(two_dir))
  one = [r for r in read_metrics(str(one_dir)) if r["step"] > STEPS]
  assert [r["step"] for r in two] == [r["step"] for r in one] == [7, 8]
  assert_same_losses([r["loss"] for r in two], [r["loss"] for r in one])
  after_two = read_checkpoint(str(two_dir / "checkpoints" / "ckpt-8"))  # Sharded by zero2.
  after_one = read_checkpoint(str(one_dir / "checkpoints" / "ckpt-8"))
  assert_same_state(after_two, after_one, "zero2 on 2 workers, resumed")
