"""SIGTERM mid-run: every worker saves at one agreed step, exits 75, and the next start resumes there.

Each job runs under `python -m tfpar.launch` (real processes, a real SIGTERM
to one task, as a Kubernetes eviction sends it to one pod). The task exits 75
(tfpar.status.PREEMPTED) after its checkpoint; the launcher starts the job
again at once; the new start resumes at the saved step. So metrics.jsonl holds
every step exactly once, and each step's loss is the uninterrupted run's
(relative 1e-5): a lost or repeated step would shift the data order and the
weights, and with them every later loss.

Under multi_worker_mirrored the signal goes to worker 1, not the chief: both
workers must save at the same step (they agree by an all-reduce after each
chunk), or the chief's checkpoint and worker 1's state would disagree.
The tiny model runs without XLA (the launcher and the loop are under test).
The four jobs run two at a time from the file's first test on (a job is
mostly one busy process), beside the in-process uninterrupted run.
"""

import concurrent.futures
import os
import re
import signal

import numpy as np
import pytest

from conftest import TINY, read_metrics, train_in_process
from test_launch import Launched, assert_every_line_prefixed, group_alive
from tfpar import status

# Steps enough that the SIGTERM, sent once step 3 is logged, lands before the end: one device's
# ~10 ms steps finished all 24 before it on a fresh clone once (2026-12-05).
STEPS = 100
ARGS = TINY + [f"--train_steps={STEPS}", "--seed=3", "--input_sharding=data",
               "--jit_compile=false", "--eval_steps=0", "--checkpoint_every=1000"]
REL_TOL = 1e-5

CASES = {
    "one_device": (1, ["--strategy=one_device"]),
    "mirrored": (1, ["--strategy=mirrored", "--num_cpu_devices=2"]),
    "pipeline": (1, ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=2"]),
    "multi_worker_mirrored": (2, ["--strategy=multi_worker_mirrored"]),
}


def preempted_job(case, model_dir):
  """Launches `case`, sends SIGTERM to one task once it trains, and waits for the job to end."""
  num_workers, strategy_args = CASES[case]
  job = Launched([f"--num_workers={num_workers}", "--", *ARGS, *strategy_args,
                  f"--model_dir={model_dir}"])
  job.model_dir = model_dir
  try:
    job.wait_for(r"^\[worker 0\] step +3/", timeout=300)
    job.target = "worker 1" if num_workers == 2 else "worker 0"
    os.kill(job.task_pids()[job.target][0], signal.SIGTERM)
    job.code = job.finish(timeout=300)
  finally:
    job.cleanup()
  return job


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
  """{case: Future of its preempted_job}: the selected cases' jobs, two at a time on threads
  of their own from the file's first test on (a job is mostly one busy process at a time)."""
  selected = {item.callspec.params["case"] for item in request.session.items
              if item.module is request.module and "jobs" in item.fixturenames}
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
  futures = {case: pool.submit(preempted_job, case, tmp_path_factory.mktemp(case))
             for case in CASES if case in selected}
  pool.shutdown(wait=False)
  return futures


@pytest.fixture(scope="module")
def uninterrupted(jobs, tmp_path_factory):  # pylint: disable=unused-argument
  """Per-step losses of the same run on one device, never interrupted (trained here while
  the jobs, started first, run)."""
  model_dir = tmp_path_factory.mktemp("uninterrupted")
  train_in_process(ARGS + ["--strategy=one_device", f"--model_dir={model_dir}"])
  return [r["loss"] for r in read_metrics(str(model_dir))]


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_saves_at_an_agreed_step_and_the_restart_resumes_exactly_there(
    case, jobs, uninterrupted):
  num_workers, _ = CASES[case]
  job = jobs[case].result()
  target, code, tmp_path = job.target, job.code, job.model_dir
  out = job.output
  assert code == 0, out[-4000:]
  # The launcher names every task that saved and exited 75 (either may exit first).
  preempted = re.search(rf"^tfpar\.launch: ((?:worker \d, )*worker \d) exited with status "
                        rf"{status.PREEMPTED}: every task saved", out, re.M)
  assert preempted and target in preempted.group(1).split(", "), out[-4000:]
  assert "restarting the job (a preemption restart, not counted in --max_restarts)" in out
  saved = re.search(r"^\[worker 0\] tfpar: (?:worker 0: )?preempted \(SIGTERM\), saved .*ckpt-(\d+) at step "
                    r"(\d+); the next start resumes at step (\d+)$", out, re.M)
  assert saved, out[-4000:]
  step = int(saved.group(2))
  assert int(saved.group(1)) == step and int(saved.group(3)) == step + 1
  assert 3 <= step < STEPS  # Saved mid-run, within a chunk or two of the signal.
  if num_workers == 2:  # Worker 1 got the signal; both stopped after the same step.
    assert re.search(rf"^\[worker 1\] tfpar: worker 1: preempted \(SIGTERM\), saved its part "
                     rf"at step {step};", out, re.M), out[-4000:]
  assert re.search(rf"^\[worker 0\] resumed from .*ckpt-{step} at step {step}$", out, re.M)
  records = read_metrics(str(tmp_path))
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
  np.testing.assert_allclose([r["loss"] for r in records], uninterrupted, rtol=REL_TOL, atol=0)
  for attempts in job.task_pids().values():
    assert len(attempts) == 2 and not any(group_alive(pid) for pid in attempts)
  assert_every_line_prefixed(job)


def test_a_lost_peer_is_reported_in_one_line_that_names_it():
  """The error TensorFlow 2.21 raised on worker 0 when worker 1 was SIGSTOPped (docs/failures.md)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  message = ("Graph execution error:\n\nDetected at node while/CollectiveReduceV2 defined at "
             "(most recent call last):\n  File \"<frozen runpy>\", line 198\n"
             "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
             "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n"
             "The tasks have crashed.")
  cluster = Cluster(spec={"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}, task_type="worker",
                    task_index=0)
  line = runner._peer_message(tf.errors.UnavailableError(None, None, message), cluster)  # pylint: disable=protected-access
  assert "\n" not in line
  assert line.startswith("worker 0 waited for worker 1 (127.0.0.1:2222), which stopped answering")
  assert "UnavailableError: Collective ops is aborted by: Error reported from /job:worker/task:1: " \
         "The following tasks are unhealthy (stopped sending heartbeats)" in line
  assert "restart the job" in line
