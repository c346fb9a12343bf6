"""Sharded state: initialisation slice by slice, checkpoints written and read in slices.

- Each device of a plan makes only its own slices of the weights, and they
  equal one device's values exactly (GPT and Llama, tensor 2, pipeline 2 and
  zero3 x 4, zero3 on a 2 x 2 pipeline plan);
  `initialise.slice_value` makes any slice (ZeRO's row shards) on its own.
- A checkpoint is one TensorFlow checkpoint of canonical full-shape names
  whatever wrote it: tf.train.load_checkpoint reads it whole; a tensor parallel
  run's bundle stores each weight as its shards' slices.
- A checkpoint written by the earlier format (tf.train.Checkpoint of full-shape
  host variables, written here by that code path) restores under any plan.
- Background saves: kill -9 in the middle of a write leaves nothing a restore
  picks (the restart resumes from the last complete checkpoint); SIGTERM in the
  middle of one exits 75 with it finished.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import conftest
from conftest import REPO, TINY

BASE = TINY + ["--train_steps=4", "--eval_every=0", "--checkpoint_every=100"]
LLAMA = ["--architecture=llama", "--num_kv_heads=2", "--seq_len=16", "--jit_compile=false"]
PLANS = {"tensor_2": ["--num_cpu_devices=2", "--tensor_parallel=2"],
         "pipeline_2": ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=2"],
         # Each replica makes its rows of every weight (tfpar.parallel.zero3.Zero3.initialise).
         "zero3_4": ["--strategy=mirrored", "--num_cpu_devices=4", "--optimizer_sharding=zero3"],
         # Each device its rows of its stage's weights (tfpar.engines.hybrid_zero3).
         "zero3_2x2": ["--strategy=mirrored", "--num_cpu_devices=4", "--data_parallel=2",
                       "--pipeline_stages=2", "--optimizer_sharding=zero3"]}


def build(args, model_dir):
  return conftest.build_engine(BASE + args + [f"--model_dir={model_dir}"])


def canonical(engine, copy=0):
  from tfpar.training.checkpoint import read_canonical  # pylint: disable=import-outside-toplevel
  return read_canonical(engine.layouts[copy])


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_each_device_makes_its_slices_equal_to_one_devices(family, tmp_path):
  extra = LLAMA if family == "llama" else []
  want = canonical(build(extra + ["--strategy=one_device"], tmp_path / "one"))
  weights = [n for n in want if "@" not in n and not n.startswith(("optimizer/", "dropout_rng/"))]
  assert len(weights) > 10 and any(np.abs(want[n]).max() > 0 for n in weights)
  for plan, args in PLANS.items():
    engine = build(extra + args, tmp_path / plan)
    got = canonical(engine)
    sharded = [n for n, (axis, shards) in engine.layouts[0].items() if len(shards) > 1]
    assert plan != "tensor_2" or len(sharded) >= 4, sharded  # Really made in slices.
    for name in weights:
      np.testing.assert_array_equal(got[name], want[name], err_msg=f"{family} {plan} {name}")


def test_any_slice_is_the_same_slice_of_the_whole():
  import keras  # pylint: disable=import-outside-toplevel
  from tfpar.training.initialise import slice_value  # pylint: disable=import-outside-toplevel
  shape = (300, 520)  # Tiles of 256: slices cross tile borders.
  for init in (keras.initializers.RandomNormal(stddev=0.02), keras.initializers.GlorotUniform(),
               keras.initializers.TruncatedNormal(stddev=0.1)):
    whole = slice_value(init, 7, "w", shape, (0, 0), shape).numpy()
    assert whole.std() > 0 and len(np.unique(whole)) > 0.9 * whole.size
    rows = [slice_value(init, 7, "w", shape, (r, 0), (75, 520)).numpy()  # ZeRO x 4 rows.
            for r in range(0, 300, 75)]
    np.testing.assert_array_equal(np.concatenate(rows), whole)
    np.testing.assert_array_equal(slice_value(init, 7, "w", shape, (13, 250), (200, 11)).numpy(),
                                  whole[13:213, 250:261])
    assert not np.array_equal(slice_value(init, 8, "w", shape, (0, 0), shape).numpy(), whole)
    assert not np.array_equal(slice_value(init, 7, "v", shape, (0, 0), shape).numpy(), whole)


def test_tensor_parallel_checkpoint_stores_slices_and_reads_whole(tmp_path):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.training.checkpoint import (  # pylint: disable=import-outside-toplevel
      CanonicalCheckpointer, _checkpoint_key)
  engine = build(PLANS["tensor_2"], tmp_path / "t2")
  # A worker the chief waits for no part from (a replica of the chief's state) touches nothing:
  # a ckpt-N.tmp/ it made could outlive the chief's publish, or vanish under its own write.
  assert CanonicalCheckpointer(engine.layouts, str(tmp_path / "ckpt"), is_chief=False,
                               worker_index=1, writers=1).save(3) is None
  assert not tf.io.gfile.exists(str(tmp_path / "ckpt"))
  written = CanonicalCheckpointer(engine.layouts, str(tmp_path / "ckpt")).save(3)
  assert not tf.io.gfile.glob(str(tmp_path / "ckpt" / "*.tmp"))
  reader = tf.train.load_checkpoint(written)
  want = canonical(engine)
  for name, value in want.items():
    np.testing.assert_array_equal(reader.get_tensor(_checkpoint_key(name)), value, err_msg=name)
  # The query kernel was written as its two column shards.
  name = "block_0/attn/query/kernel"
  half = want[name].shape[1] // 2
  spec = f"{want[name].shape[0]} {want[name].shape[1]} -:{half},{half}"
  right, = tf.raw_ops.RestoreV2(prefix=written, tensor_names=[_checkpoint_key(name)],
                                shape_and_slices=[spec], dtypes=[tf.float32])
  np.testing.assert_array_equal(right.numpy(), want[name][:, half:])


def write_old_format(values, directory, step):
  """What tfpar wrote before slices: tf.train.Checkpoint of full-shape host variables."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  host = {name: tf.Variable(value, name=name.replace("/", ".")) for name, value in values.items()}
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(state=host), directory, max_to_keep=3,
                                       checkpoint_name="ckpt")
  return manager.save(checkpoint_number=step)


def test_a_checkpoint_of_the_earlier_format_restores_under_any_plan(tmp_path):
  one = build(["--strategy=one_device"], tmp_path / "one")
  rng = np.random.default_rng(0)
  values = {name: (np.array(5, v.dtype) if v.ndim == 0 else rng.normal(size=v.shape).astype(v.dtype))
            for name, v in canonical(one).items()}
  path = write_old_format(values, str(tmp_path / "old"), 5)
  for plan, args in [("one", ["--strategy=one_device"])] + list(PLANS.items()):
    engine = build(args, tmp_path / f"restore_{plan}")
    assert engine.checkpointer(str(tmp_path / "old")).restore() == path  # zero3: its rows.
    assert engine.step == 5
    got = canonical(engine)
    for name, want in values.items():
      np.testing.assert_array_equal(got[name], want, err_msg=f"{plan} {name}")


# --- background saves ------------------------------------------------------------------------
ASYNC = TINY + ["--d_model=128", "--d_ff=512", "--num_layers=2", "--train_steps=400",
                "--checkpoint_every=2", "--keep_checkpoints=400", "--eval_steps=0",
                "--strategy=one_device"]


def start(model_dir, extra=()):
  env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
  return subprocess.Popen([sys.executable, "-m", "tfpar.train", *ASYNC, *extra,
                           f"--model_dir={model_dir}"], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_mid_write(proc, checkpoints, timeout=300):
  """SIGSTOPs `proc` while a background write is in flight (its ckpt-N.tmp/ there, no
  ckpt-N.index yet) after an earlier one finished; returns N."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    pending = [p for p in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else [])
               if p.startswith("ckpt-") and p.endswith(".tmp")]  # Not checkpoint.tmp, the list's.
    if pending:
      os.kill(proc.pid, signal.SIGSTOP)
      step = int(pending[0][len("ckpt-"):-len(".tmp")])
      published = [p for p in os.listdir(checkpoints) if p.endswith(".index")]
      if (os.path.isdir(os.path.join(checkpoints, pending[0])) and published
          and not os.path.exists(os.path.join(checkpoints, f"ckpt-{step}.index"))):
        return step
      os.kill(proc.pid, signal.SIGCONT)  # It had just finished: catch the next one.
    time.sleep(0.002)
  raise AssertionError("no background write seen in flight")


def test_kill_9_during_a_background_write_restarts_from_the_last_complete_one(tmp_path):
  from tfpar.training.checkpoint import is_readable, list_checkpoints  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  checkpoints = os.path.join(model_dir, "checkpoints")
  proc = start(model_dir)
  try:
    cut = stop_mid_write(proc, checkpoints)
    proc.kill()
  finally:
    proc.kill()
    proc.communicate()
  done = [step for step, _ in list_checkpoints(checkpoints)]
  assert cut not in done and done and max(done) < cut, (cut, done)
  assert all(is_readable(p) for _, p in list_checkpoints(checkpoints))
  assert os.path.isdir(os.path.join(checkpoints, f"ckpt-{cut}.tmp"))  # What the kill cut short.
  again = conftest.run_module("tfpar.train", ASYNC + [f"--train_steps={max(done) + 2}",
                                                      f"--model_dir={model_dir}"])
  assert f"resumed from {checkpoints}/ckpt-{max(done)} at step {max(done)}" in again.stdout
  assert not [p for p in os.listdir(checkpoints) if p.endswith(".tmp")]
  assert max(step for step, _ in list_checkpoints(checkpoints)) == max(done) + 2


def test_sigterm_during_a_background_write_exits_75_with_it_finished(tmp_path):
  from tfpar.training.checkpoint import is_readable, list_checkpoints  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "run")
  checkpoints = os.path.join(model_dir, "checkpoints")
  proc = start(model_dir)
  try:
    cut = stop_mid_write(proc, checkpoints)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)
  finally:
    proc.kill()
  assert proc.returncode == 75, out[-3000:]
  done = dict(list_checkpoints(checkpoints))
  assert cut in done and is_readable(done[cut]), (cut, sorted(done))
  assert f"saved {checkpoints}/ckpt-{cut}" in out
  assert max(done) >= cut and is_readable(done[max(done)])
  assert not [p for p in os.listdir(checkpoints) if p.endswith(".tmp")]


def test_restore_chain_one_device_zero1_pipeline_and_back(tmp_path):
  """One device -> zero1 x 2 -> pipeline 2 -> one device, each saving what it restored: the
  state arrives unchanged (across workers: scripts/sharded_state_rss.py, docs/sharded_state.md)."""
  from tfpar.training.checkpoint import (  # pylint: disable=import-outside-toplevel
      CanonicalCheckpointer, assign_canonical)
  chain = [("one", ["--strategy=one_device"]),
           ("zero1_2", ["--strategy=mirrored", "--num_cpu_devices=2",
                        "--optimizer_sharding=zero1"]),
           ("pipeline_2", PLANS["pipeline_2"]), ("back", ["--strategy=one_device"])]
  engines = [(name, build(args, tmp_path / name)) for name, args in chain]
  rng = np.random.default_rng(1)
  values = {name: (np.array(9, v.dtype) if v.ndim == 0 else rng.normal(size=v.shape).astype(v.dtype))
            for name, v in canonical(engines[0][1]).items()}
  assign_canonical(engines[0][1].layouts[0], values)
  path = CanonicalCheckpointer(engines[0][1].layouts, str(tmp_path / "c0")).save(9)
  for i, (name, engine) in enumerate(engines[1:], 1):
    assert CanonicalCheckpointer(engine.layouts, str(tmp_path / f"c{i - 1}")).restore() == path
    for copy in range(len(engine.layouts)):
      got = canonical(engine, copy)
      for key, want in values.items():
        np.testing.assert_array_equal(got[key], want, err_msg=f"{name} {key}")
    path = CanonicalCheckpointer(engine.layouts, str(tmp_path / f"c{i}")).save(9)


FREED = r'''
import sys
from tfpar import console
console.set_host_allocator(sys.argv[1])
console.import_tensorflow_quietly()
import tensorflow as tf


def resident():
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


base = resident()
x = tf.fill([64 << 20], 1.0)  # 256 MiB, every page written.
held = resident() - base
del x
print(held >> 20, (resident() - base) >> 20)
'''


def test_the_system_host_allocator_gives_a_freed_tensors_pages_back():
  """--host_allocator=system: a freed 256 MiB tensor leaves the process's resident memory at
  once; TensorFlow's default pool (bfc) keeps its pages for the next tensors."""
  mib = {}
  for mode in ("bfc", "system"):
    out = subprocess.run([sys.executable, "-c", FREED, mode], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    mib[mode] = [int(x) for x in out.split()]  # Resident above the start: held, after the free.
  assert mib["bfc"][0] >= 250 and mib["system"][0] >= 250, mib
  assert mib["bfc"][1] >= 250, mib
  assert mib["system"][1] < 32, mib
