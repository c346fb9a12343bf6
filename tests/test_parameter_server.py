"""--strategy=parameter_server on a real local cluster: a chief, 2 workers, ps tasks.

Each job is started with `python -m tfpar.launch` (one process per task on
127.0.0.1). The chief writes `ps_steps.jsonl`, one record per step: which worker
ran it, the optimizer-step counter it read the weights at and the one after its
update, and its start and end time on the worker. From those the tests show
that both workers trained and that their steps overlapped in time and applied
updates to weights the other worker had already changed (stale gradients:
the asynchronous part).

The checkpoint a PS job writes restores under one_device with the same
weights: its held-out loss there equals the loss the chief measured on the
ps-resident weights. With --ps_shards=2 over 2 ps, weights and AdamW slots are
ShardedVariables, and a restarted chief resumes from the checkpoint into them.
Two jobs in all (a job is 4-5 TensorFlow processes): one to watch the
asynchronous steps undisturbed, one to kill, preempt and resume.

--jit_compile=false keeps each job near a minute on 2 cores (XLA compiles the
step once per worker process, ~20 s more each); the XLA path of
`RemoteVariableTrainStep` ran by hand (see docs/strategies_ps_tpu.md).
"""

import json
import math
import os
import re
import signal

import numpy as np
import pytest

from conftest import TINY, make_config, read_metrics, run_module

# Steps big enough that a worker's compute, not the chief's dispatch, takes
# most of a step: then the two workers' steps overlap.
PS_FLAGS = TINY + ["--strategy=parameter_server", "--jit_compile=false", "--seq_len=64",
                   "--global_batch_size=16", "--steps_per_call=20", "--log_every=20",
                   "--eval_every=0", "--eval_steps=2", "--checkpoint_every=1000"]


def run_ps_job(model_dir, *, num_ps, train_steps, extra=()):
  args = ["--num_workers=2", f"--num_ps={num_ps}", "--",
          *PS_FLAGS, f"--model_dir={model_dir}", f"--train_steps={train_steps}", *extra]
  # run_module's timeout kills the launcher, whose tasks die with it (PDEATHSIG).
  return run_module("tfpar.launch", args, timeout=240)


def step_records(model_dir):
  with open(os.path.join(model_dir, "ps_steps.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def overlapping_pairs(records):
  """Pairs of steps on different workers whose [start, end] intervals intersect."""
  pairs = 0
  for i, a in enumerate(records):
    for b in records[i + 1:]:
      if a["worker"] != b["worker"] and a["start_time"] < b["end_time"] \
          and b["start_time"] < a["end_time"]:
        pairs += 1
  return pairs


def restored_one_device_eval(model_dir):
  """The held-out loss of the latest checkpoint, restored into a one_device engine."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
  from tfpar.training import checkpoint  # pylint: disable=import-outside-toplevel
  from tfpar.engines.data_parallel import DataParallelEngine  # pylint: disable=import-outside-toplevel
  with open(os.path.join(model_dir, "config.json")) as f:
    saved = json.load(f)
  args = [a for a in PS_FLAGS if not a.startswith("--strategy")] + [
      "--strategy=one_device", f"--model_dir={model_dir}",
      f"--train_steps={saved['train']['train_steps']}"]
  cfg = make_config(args)
  corpus = pipeline.load_corpus(None, seq_len=cfg.model.seq_len,
                                eval_fraction=cfg.data.eval_fraction)
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  engine = DataParallelEngine(cfg, strategy, corpus)
  checkpointer = checkpoint.CanonicalCheckpointer(engine.layouts,
                                                  os.path.join(model_dir, "checkpoints"))
  assert checkpointer.restore()
  saved_values = checkpoint.read_checkpoint(checkpointer.latest)
  restored = checkpoint.read_canonical(engine.layouts[0])
  assert set(saved_values) == set(restored)
  for name, value in saved_values.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)  # Full shapes, bit-exact.
  return engine.step, engine.evaluate(engine.eval_iterator(), cfg.train.eval_steps)


def test_two_workers_train_asynchronously_and_the_checkpoint_restores_under_one_device(
    tmp_path):
  """One job, asserted many ways: asynchronous training, the one-device restore.

  Two workers train 60 steps over 1 ps. Sharded variables (2 ps) and a resume
  into them are the killed-worker test's job below.
  """
  model_dir = str(tmp_path / "ps")
  steps = 60
  proc = run_ps_job(model_dir, num_ps=1, train_steps=steps)
  assert "ParameterServerStrategy (async)" in proc.stdout

  records = step_records(model_dir)
  assert len(records) == steps
  # Every step incremented the (atomic) step counter exactly once.
  assert max(r["write_version"] for r in records) == steps
  # The tiny GPT learns: from ~ln(256) = 5.55 to clearly lower.
  first = np.mean([r["loss"] for r in records[:5]])
  evals = read_metrics(model_dir, "eval")
  assert first > 5.0 and evals[-1]["loss"] < first - 1.2, (first, evals)

  # Both workers ran steps.
  per_worker = {w: sum(r["worker"] == w for r in records) for w in (0, 1)}
  assert min(per_worker.values()) >= steps // 5, per_worker
  # ... at the same time, without waiting for each other: steps of the two
  # workers overlapped, and updates landed on weights the other had changed.
  assert overlapping_pairs(records) >= 5, records
  stale = sum(r["staleness"] >= 1 for r in records)
  assert stale >= 5, [r["staleness"] for r in records]
  print(f"steps per worker {per_worker}, overlapping pairs {overlapping_pairs(records)}, "
        f"stale steps {stale}/{steps}, loss {first:.2f} (first 5 steps) -> "
        f"eval {evals[-1]['loss']:.2f}")
  train = read_metrics(model_dir)
  assert train[-1]["workers"] == 2 and train[-1]["replicas"] == 2

  # The unsharded checkpoint of one ps restores under one_device: identical weights, and
  # the held-out loss the chief measured on the ps-resident weights.
  step, loss = restored_one_device_eval(model_dir)
  assert step == steps
  assert math.isclose(loss, evals[-1]["loss"], rel_tol=1e-5), (loss, evals[-1])


def test_ps_shards_more_than_ps_and_missing_tasks_are_clear_errors():
  from tfpar.config.cluster import Cluster, ClusterError  # pylint: disable=import-outside-toplevel
  from tfpar.config import rundir  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  from tfpar.engines.parameter_server import server as parameter_server  # pylint: disable=import-outside-toplevel
  spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
  cfg = make_config(PS_FLAGS + ["--model_dir=unused", "--ps_shards=2"])
  # Checked against TF_CONFIG before TensorFlow starts (tfpar.config.rundir.check_run).
  with pytest.raises(ConfigError, match=r"--ps_shards=2 is more than the 1 parameter server"):
    rundir.check_run(cfg, Cluster(spec=spec, task_type="chief"))
  with pytest.raises(ClusterError, match="missing: ps"):
    parameter_server.serve(Cluster(spec={"chief": spec["chief"], "worker": spec["worker"]},
                                   task_type="worker"))


def test_the_job_survives_a_killed_worker_and_a_preempted_chief(tmp_path):
  """kill -9 of a worker, then SIGTERM to the chief, in one job under tfpar.launch, every
  weight and AdamW slot cut over 2 ps (--ps_shards=2).

  The worker's loss costs its in-flight step: the chief's ClusterCoordinator
  runs the steps on worker 0, and the launcher starts worker 1 again at the
  same address. The chief, on SIGTERM, saves and exits 75; the launcher starts
  the chief alone, and it reconnects to the very same worker and ps processes
  (servers no longer exit when their chief goes away), restores the checkpoint
  into its ShardedVariables and finishes the job.
  """
  from test_launch import Launched  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / "ps_shards")
  steps = 120
  job = Launched(["--num_workers=2", "--num_ps=2", "--max_restarts=1", "--restart_backoff=0.5",
                  "--", *PS_FLAGS, "--steps_per_call=10", "--log_every=10", "--ps_shards=2",
                  f"--model_dir={model_dir}", f"--train_steps={steps}"])
  try:
    job.wait_for(r"^\[chief\] step +20/", timeout=300)
    os.kill(job.task_pids()["worker 1"][0], signal.SIGKILL)
    job.wait_for(r"^\[chief\] step +60/", timeout=300)  # Training went on after the kill.
    os.kill(job.task_pids()["chief"][0], signal.SIGTERM)
    code = job.finish(timeout=400)
  finally:
    job.cleanup()
  out = job.output
  assert code == 0, out[-4000:]
  assert "worker 1 was killed by SIGKILL: the chief runs its steps on the other workers; " \
         "starting worker 1 again (restart 1 of 1, in 0.5 s)" in out, out[-4000:]
  saved = re.search(r"^\[chief\] tfpar: preempted \(SIGTERM\), saved .*ckpt-(\d+) at step (\d+);",
                    out, re.M)
  assert saved and saved.group(1) == saved.group(2), out[-4000:]
  assert "chief exited with status 75: starting the chief again (a preemption restart, not " \
         "counted in --max_restarts); the workers and ps keep serving" in out
  resumed_at = re.search(rf"^\[chief\] resumed from .*ckpt-{saved.group(1)} at step (\d+)$",
                         out, re.M)
  assert resumed_at, out[-4000:]
  pids = job.task_pids()
  # The servers outlived the chief's restart: one process each, the chief two.
  assert [len(pids[t]) for t in ("chief", "worker 0", "worker 1", "ps 0", "ps 1")] == \
      [2, 1, 2, 1, 1], pids
  for server in ("worker 0", "ps 0", "ps 1"):
    assert re.search(rf"^\[{server}\] tfpar: {server}: chief .* unreachable; serving on", out, re.M)
  # Every weight of rank >= 1 and its two AdamW slots are cut over the 2 ps (both chiefs).
  described = re.findall(r"^\[chief\] tfpar: .*sharded variables (\d+), sharded slots (\d+)",
                         out, re.M)
  assert len(described) == 2, out[-4000:]
  for variables, slots in described:
    assert int(variables) > 0 and int(slots) == 2 * int(variables)
  train = [r["step"] for r in read_metrics(model_dir)]
  assert train == sorted(set(train)) and train[-1] == steps, train  # each step logged once
  evals = read_metrics(model_dir, "eval")
  assert evals[-1]["step"] == steps
  # Resuming assigned the full checkpoint tensors into the ShardedVariables: the restarted
  # chief's steps (each incrementing the atomic counter once) go on from the trained weights
  # (a mis-assigned shard would throw the loss back up): lower than the job's start.
  records = step_records(model_dir)
  first = np.mean([r["loss"] for r in records[:5]])
  resumed = [r for r in records if r["write_version"] > int(resumed_at.group(1))]
  assert len(resumed) == steps - int(resumed_at.group(1)), resumed
  assert max(r["write_version"] for r in resumed) == steps
  assert first > 5.0 and np.mean([r["loss"] for r in resumed[:3]]) < first - 0.5, (first, resumed)
  # ShardedVariables read as full tensors: the canonical checkpoint restores under one_device
  # bit for bit, with the held-out loss the chief measured on the ps-resident weights.
  step, loss = restored_one_device_eval(model_dir)
  assert step == steps
  assert math.isclose(loss, evals[-1]["loss"], rel_tol=1e-5), (loss, evals[-1])
