"""Gradient compression (tfpar.parallel.compression): the math, the bytes, and real runs.

The reducer alone runs under a MirroredStrategy over 4 of the logical CPUs
conftest makes, on hand-made gradients: PowerSGD reproduces a rank-R sum
exactly, error feedback loses nothing, fp16 scaling neither overflows nor
flushes, and the counted bytes equal the docstring's formula. Then whole
runs: 80 steps of the TINY model on 4 mirrored replicas per method against
uncompressed, a PowerSGD run resumed from its midway checkpoint, a hybrid
data 2 x pipeline 2 run, and two multi_worker_mirrored processes whose weights
must stay identical. The runs of real processes start with the file's first
test, beside the in-process ones (process_runs).
"""

import concurrent.futures
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, TINY, read_metrics, run_module, selected_tests_use, train_in_process

# --min_lr_ratio=1: a constant rate after warmup, so a run stopped halfway is the
# first half of the longer run. --powersgd_min_size=0: TINY's matrices are small.
RUN = TINY + ["--jit_compile=false", "--min_lr_ratio=1.0", "--eval_steps=0",
              "--checkpoint_every=40", "--strategy=mirrored", "--num_cpu_devices=4",
              "--powersgd_min_size=0", "--steps_per_call=10", "--log_every=10"]
STEPS = 80


# --- the reducer on hand-made gradients -------------------------------------------------

@pytest.fixture(scope="module")
def mirrored4():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:4]]
  return tf.distribute.MirroredStrategy(devices,
                                        cross_device_ops=tf.distribute.ReductionToOneDevice())


def reduce_steps(strategy, method, shapes, grads, **settings):
  """Runs the reducer for each step of grads[step][replica][tensor]; returns (outputs, reducer).

  outputs[step][replica][tensor] are the reduced gradients each replica got.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import CompressionConfig  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import compression  # pylint: disable=import-outside-toplevel
  devices = list(strategy.extended.worker_devices)
  variables = [tf.Variable(tf.zeros(s)) for s in shapes]
  reducer = compression.GradientReducer(
      CompressionConfig(method=method, **settings), variables,
      num_replicas=strategy.num_replicas_in_sync,
      state_devices=[[d] * len(shapes) for d in devices])

  @tf.function
  def step(per_replica):
    def replica_fn(values):
      device = tf.nest.flatten(tf.distribute.get_replica_context().devices)[0]
      return reducer.reduce(list(values), replica=devices.index(device))
    return strategy.run(replica_fn, args=(per_replica,))

  outputs = []
  for step_grads in grads:
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx, g=step_grads: [tf.constant(x) for x in g[ctx.replica_id_in_sync_group]])
    out = step(values)
    outputs.append([[np.asarray(x) for x in r]
                    for r in zip(*[strategy.experimental_local_results(t) for t in out])])
  return outputs, reducer


def test_powersgd_reproduces_a_rank_r_gradient_exactly(mirrored4):
  rng = np.random.default_rng(0)
  rank, (m, n) = 4, (64, 48)
  basis = rng.normal(size=(m, rank)).astype(np.float32)  # Shared columns: the sum has rank 4.
  grads = [[[basis @ rng.normal(size=(rank, n)).astype(np.float32)] for _ in range(4)]]
  outputs, _ = reduce_steps(mirrored4, "powersgd", [(m, n)], grads, rank=rank, min_size=0)
  total = sum(g[0] for g in grads[0])
  for replica in outputs[0]:  # Every replica applies the same, exact sum.
    np.testing.assert_allclose(replica[0], total, rtol=1e-4, atol=1e-4 * np.abs(total).max())
  # A full-rank sum is NOT reproduced by rank 4: the check above can fail.
  full = [[[rng.normal(size=(m, n)).astype(np.float32)] for _ in range(4)]]
  outputs, _ = reduce_steps(mirrored4, "powersgd", [(m, n)], full, rank=rank, min_size=0)
  assert np.abs(outputs[0][0][0] - sum(g[0] for g in full[0])).max() > 0.1


def test_powersgd_error_feedback_loses_nothing(mirrored4):
  """sum over steps of what was applied + sum over replicas of the residual == sum of all grads."""
  rng = np.random.default_rng(1)
  shapes = [(40, 24), (24,), (8, 8)]  # A compressed matrix, a vector, a matrix below min_size.
  grads = [[[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(4)]
           for _ in range(5)]
  outputs, reducer = reduce_steps(mirrored4, "powersgd", shapes, grads, rank=2, min_size=100)
  assert reducer.compressed == [True, False, False]
  applied = sum(out[0][0] for out in outputs)
  residuals = sum(np.asarray(e[0]) for e in reducer.error)
  truth = sum(g[r][0] for g in grads for r in range(4))
  assert np.abs(residuals).max() > 0.1  # Rank 2 of a random 40 x 24: much is held back.
  np.testing.assert_allclose(applied + residuals, truth, rtol=1e-4, atol=1e-4)
  for i in (1, 2):  # Sent uncompressed: exact sums every step.
    for out, g in zip(outputs, grads):
      np.testing.assert_allclose(out[0][i], sum(g[r][i] for r in range(4)), rtol=1e-5, atol=1e-6)


SHAPES = [(256, 32), (32, 32), (32, 64), (32,), (64,), (8, 8)]


@pytest.mark.parametrize("method", ["none", "fp16", "bf16", "powersgd"])
def test_counted_bytes_equal_the_formula(mirrored4, method):
  rng = np.random.default_rng(2)
  grads = [[[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(4)]]
  _, reducer = reduce_steps(mirrored4, method, SHAPES, grads, rank=4, min_size=100)
  float32 = 4 * sum(int(np.prod(s)) for s in SHAPES)
  want = {
      "none": float32,
      "bf16": float32 // 2,
      "fp16": float32 // 2 + 4 * len(SHAPES),  # + one float32 scale per tensor
      # P and Q for each compressed m x n matrix; vectors and the 8 x 8 (< min_size) whole.
      "powersgd": 4 * 4 * ((256 + 32) + (32 + 32) + (32 + 64)) + 4 * (32 + 64 + 64),
  }[method]
  assert reducer.traffic[True].bytes == want
  assert reducer.traffic[True].uncompressed == float32


def test_powersgd_rank_4_sends_30x_fewer_bytes_at_the_benchmark_shape():
  """The benchmark GPT (4 layers, d_model 256, d_ff 1024): the formula the test above checks."""
  from conftest import make_config  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import CompressionConfig  # pylint: disable=import-outside-toplevel
  from tfpar.parallel.traffic import expected_bytes  # pylint: disable=import-outside-toplevel
  from tfpar.engines.base import build_model  # pylint: disable=import-outside-toplevel
  cfg = make_config(["--model_dir=/tmp/unused", "--num_layers=4", "--d_model=256",
                     "--d_ff=1024", "--seq_len=256"])
  shapes = [tuple(v.shape) for v in build_model(cfg).trainable_variables]
  full = expected_bytes(shapes, CompressionConfig())
  ratio = full / expected_bytes(shapes, CompressionConfig(method="powersgd", rank=4))
  assert ratio >= 30, ratio


@pytest.mark.parametrize("settings", [{"rank": 100000}, {"min_size": 10 ** 8}])
def test_powersgd_with_nothing_to_compress_is_refused_in_one_line(settings):
  """Not an IndexError in the traced step: a setting no restart can fix (exit 2 from the CLI)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import CompressionConfig, ConfigError  # pylint: disable=import-outside-toplevel
  from tfpar.parallel import compression  # pylint: disable=import-outside-toplevel
  variables = [tf.Variable(tf.zeros(s)) for s in [(256, 32), (32, 64), (64,)]]
  with pytest.raises(ConfigError, match="compresses none of the model's weights "
                                        r"\(the largest is 256x32 = 8192 elements"):
    compression.GradientReducer(CompressionConfig(method="powersgd", **settings), variables,
                                num_replicas=2, state_devices=[["/cpu:0"] * 3])


def test_fp16_neither_overflows_nor_flushes_to_zero(mirrored4):
  rng = np.random.default_rng(3)
  big = [[(3e4 * rng.uniform(0.5, 1.0, size=(16,))).astype(np.float32)] for _ in range(4)]
  tiny = [[(1e-9 * rng.uniform(0.5, 1.0, size=(16,))).astype(np.float32)] for _ in range(4)]
  for grads in (big, tiny):  # Sums to 1e5 (> float16's 65504); values below 2^-24.
    outputs, _ = reduce_steps(mirrored4, "fp16", [(16,)], [grads])
    np.testing.assert_allclose(outputs[0][0][0], sum(g[0] for g in grads), rtol=2e-3)


# --- whole runs -------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def process_runs(request, tmp_path_factory):
  """{fixture name: Future} of the PROCESS_RUNS (end of file) a selected test uses, started
  one after the other on a thread of their own with the file's first test: the child
  processes take the second core while this process trains in-process runs on the first."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  futures = {name: pool.submit(fn, tmp_path_factory.mktemp(name))
             for name, fn in PROCESS_RUNS.items() if selected_tests_use(request, name)}
  pool.shutdown(wait=False)
  return futures


@pytest.fixture(scope="module")
def powersgd_resume(process_runs):
  return process_runs["powersgd_resume"].result()


@pytest.fixture(scope="module")
def two_workers(process_runs):
  return process_runs["two_workers"].result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """run(method) -> model_dir of 80 steps on 4 mirrored replicas (each method runs once)."""
  dirs = {}

  def run(method):
    if method not in dirs:
      model_dir = str(tmp_path_factory.mktemp(method))
      train_in_process(RUN + [f"--train_steps={STEPS}", f"--grad_compression={method}",
                                      f"--model_dir={model_dir}"])
      dirs[method] = model_dir
    return dirs[method]

  return run


def final_loss(model_dir):
  """Mean training loss over the last 10 steps."""
  records = read_metrics(model_dir)
  return float(np.mean([r["loss"] for r in records if r["step"] > STEPS - 10]))


@pytest.mark.parametrize("method,tolerance", [("fp16", 0.03), ("bf16", 0.03),
                                              ("powersgd", 0.10)])
def test_compressed_training_ends_near_uncompressed(runs, method, tolerance):
  loss, reference = final_loss(runs(method)), final_loss(runs("none"))
  assert reference < 4.0  # It learned something (uniform over 256 bytes is 5.5).
  assert abs(loss - reference) <= tolerance * reference, (loss, reference)
  records = read_metrics(runs(method))
  assert all(r["comm_bytes"] < r["comm_bytes_uncompressed"] for r in records)
  assert records[-1]["comm_bytes_uncompressed"] == read_metrics(runs("none"))[-1]["comm_bytes"]


RESUME_STEPS, RESUME_AT = 20, 10
RESUME_ARGS = RUN + ["--log_every=1", "--steps_per_call=1", "--grad_compression=powersgd",
                     f"--checkpoint_every={RESUME_AT}", f"--train_steps={RESUME_STEPS}"]


def run_powersgd_and_resume_it_midway(root):
  """A PowerSGD run of RESUME_STEPS, then, in a new process, the same run again from its
  checkpoint at RESUME_AT (the newer one removed, as if the job had stopped there).

  Returns (model_dir, the uninterrupted run's records, the resumed start's stdout).
  """
  env = {"TF_NUM_INTEROP_THREADS": "1"}
  model_dir = root / "run"
  run_module("tfpar.train", RESUME_ARGS + [f"--model_dir={model_dir}"], env=env)
  straight = read_metrics(str(model_dir))
  for path in glob.glob(str(model_dir / "checkpoints" / f"ckpt-{RESUME_STEPS}.*")):
    os.remove(path)
  out = run_module("tfpar.train", RESUME_ARGS + [f"--model_dir={model_dir}"], env=env).stdout
  return model_dir, straight, out


def test_powersgd_stopped_midway_and_resumed_matches_the_uninterrupted_run(powersgd_resume):
  """Real processes, one inter-op thread: the two runs are then bit-reproducible.

  20 steps, resumed at 10: every step compresses (no PowerSGD warmup), so the
  residuals and Q restored at step 10 decide every step after it.

  With TensorFlow's default inter-op pool, two identical mirrored PowerSGD runs
  on CPU have differed by up to 8e-5 relative after tens of steps (a rare
  scheduling race, docs/compression.md); a resume can only be held to the
  uninterrupted run where the uninterrupted run is held to itself.
  """
  model_dir, straight, out = powersgd_resume
  from tfpar.training.checkpoint import read_checkpoint  # pylint: disable=import-outside-toplevel
  saved = read_checkpoint(str(model_dir / "checkpoints" / f"ckpt-{RESUME_AT}"))
  errors = saved["compression/powersgd@error"]
  assert errors.shape[0] == 4  # The residuals of each replica, each its own.
  assert len(set(np.asarray(errors[r]).tobytes() for r in range(4))) == 4
  assert f"at step {RESUME_AT}" in out, out[-2000:]
  resumed = read_metrics(str(model_dir))
  assert [r["step"] for r in resumed] == list(range(1, RESUME_STEPS + 1))
  # The uninterrupted run's later steps were set aside; the resumed start trained them again.
  with open(model_dir / "metrics.jsonl.superseded") as f:
    superseded = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in superseded if r["kind"] == "train"] == list(
      range(RESUME_AT + 1, RESUME_STEPS + 1))
  assert [r["step"] for r in straight] == list(range(1, RESUME_STEPS + 1))
  np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in straight],
                             rtol=1e-5)
  np.testing.assert_allclose([r["grad_norm"] for r in resumed],
                             [r["grad_norm"] for r in straight], rtol=1e-5)


def test_hybrid_data_2_x_pipeline_2_with_powersgd_trains(tmp_path):
  train_in_process(TINY + ["--jit_compile=false", "--eval_steps=0", "--train_steps=12",
                           "--strategy=mirrored", "--num_cpu_devices=4", "--data_parallel=2",
                           "--pipeline_stages=2", "--microbatches=2", "--grad_compression=powersgd",
                           "--powersgd_rank=2", "--powersgd_min_size=0",
                           f"--model_dir={tmp_path}"])
  records = read_metrics(str(tmp_path))
  losses = np.array([r["loss"] for r in records])
  assert np.all(np.isfinite(losses)) and losses[-3:].mean() < losses[:3].mean() - 0.1, losses
  assert all(r["replicas"] == 2 for r in records)
  assert records[-1]["comm_bytes"] < records[-1]["comm_bytes_uncompressed"] / 3


# --- two multi_worker_mirrored processes ------------------------------------------------

MW_STEPS = 6


def run_two_workers(tmp_path):
  """Two multi_worker_mirrored workers, each saving its own weights after training (see
  __main__ below). Returns (tmp_path, their exit statuses, their outputs)."""
  from tfpar.cli import launch  # pylint: disable=import-outside-toplevel
  tasks = [launch.Task("worker", i) for i in range(2)]
  configs = launch.tf_configs(tasks, launch.free_ports(2))
  args = TINY + ["--jit_compile=false", "--eval_steps=0", f"--train_steps={MW_STEPS}",
                 "--strategy=multi_worker_mirrored", "--grad_compression=powersgd",
                 "--powersgd_min_size=0", "--checkpoint_every=3", "--input_sharding=data",
                 "--all_reduce_pack_mb=1", f"--model_dir={tmp_path}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  procs = [subprocess.Popen([sys.executable, __file__, str(tmp_path), *args],
                            env=dict(env, TF_CONFIG=configs[t]), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for t in tasks]
  try:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return tmp_path, [p.returncode for p in procs], outputs


def test_two_workers_with_powersgd_train_and_keep_identical_weights(two_workers):
  """Each worker saves its own weights after training: they must agree."""
  tmp_path, codes, outputs = two_workers
  assert codes == [0, 0], outputs
  records = read_metrics(str(tmp_path))
  losses = np.array([r["loss"] for r in records])
  assert [r["step"] for r in records] == list(range(1, MW_STEPS + 1))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert all(r["workers"] == 2 and r["comm_bytes"] < r["comm_bytes_uncompressed"] / 3
             for r in records)
  first, second = (np.load(tmp_path / f"weights_{i}.npz") for i in range(2))
  assert sorted(first.files) == sorted(second.files)
  for name in first.files:
    np.testing.assert_array_equal(first[name], second[name], err_msg=name)
  # The chief's checkpoint holds both workers' residuals, gathered at save.
  from tfpar.training.checkpoint import read_checkpoint  # pylint: disable=import-outside-toplevel
  saved = read_checkpoint(str(tmp_path / "checkpoints" / f"ckpt-{MW_STEPS}"))
  errors = saved["compression/powersgd@error"]
  assert errors.shape[0] == 2 and not np.array_equal(errors[0], errors[1])


# This file's runs of real processes: {fixture name: fn(directory) -> what its test reads}.
PROCESS_RUNS = {"powersgd_resume": run_powersgd_and_resume_it_midway,
                "two_workers": run_two_workers}


def _worker_main(out_dir, argv):
  """One multi_worker_mirrored worker: trains as tfpar.train does, then saves its weights."""
  # pylint: disable=import-outside-toplevel
  from tfpar.config import cluster as cluster_lib, config, flags
  from tfpar import strategies
  from tfpar.data import pipeline
  from tfpar.training import loop
  from tfpar.training.checkpoint import model_layout, read_canonical
  from tfpar.engines.data_parallel import DataParallelEngine
  cfg = config.from_flags(flags.parse(argv))
  cluster = cluster_lib.from_env()
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  strategy = strategies.make_strategy(cfg.dist, cluster)
  corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                eval_fraction=cfg.data.eval_fraction,
                                worker_index=cluster.worker_index, num_workers=cluster.num_workers,
                                sharding="data")
  engine = DataParallelEngine(cfg, strategy, corpus)
  loop.run(cfg, engine, is_chief=cluster.is_chief, worker_index=cluster.worker_index,
           num_workers=cluster.num_workers)
  np.savez(os.path.join(out_dir, f"weights_{cluster.worker_index}.npz"),
           **read_canonical(model_layout(engine.model, engine.optimizer)))
  print(json.dumps({"worker": cluster.worker_index, "step": engine.step}))


if __name__ == "__main__":
  _worker_main(sys.argv[1], sys.argv[2:])
