"""tfpar.launch behaves like a Kubernetes job: real processes on 127.0.0.1, no mocks.

A task that fails (here: SIGKILLed mid-training, as the OOM killer or a node
loss would) ends the whole job with a non-zero status and leaves no process
behind; with --max_restarts the whole job starts again and resumes from the
latest checkpoint; a signal to the launcher stops every task; every line a task
writes carries its task's prefix.

The model is tiny and --jit_compile=false: the launcher is under test here, not
the step, and XLA would add ~30 s of compilation per process on 2 cores.
"""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, TINY, read_metrics, run_module
from tfpar import launch as launch_lib
from tfpar import status

MWMS = TINY + ["--strategy=multi_worker_mirrored", "--jit_compile=false", "--eval_steps=0"]
PREFIXED = re.compile(r"^(tfpar\.launch: |\[(chief|worker \d+|ps \d+)\] )")


class Launched:
  """`python -m tfpar.launch ...` running in the background, its output read line by line."""

  def __init__(self, args):
    # TensorFlow's C++ warnings shown (tfpar.train would hide them): the logs are checked.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", PYTHONPATH=REPO)
    self.proc = subprocess.Popen([sys.executable, "-m", "tfpar.launch", *args], cwd=REPO,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
    self.lines, self._queue = [], queue.Queue()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))
      self._queue.put(self.lines[-1])
    self._queue.put(None)

  def wait_for(self, pattern, timeout=120):
    """Blocks until a line matches `pattern`; returns the match."""
    deadline = time.monotonic() + timeout
    while True:
      try:
        line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        line = None
      if line is None:
        raise AssertionError(f"no line matched {pattern!r}; output:\n" + self.output[-4000:])
      match = re.search(pattern, line)
      if match:
        return match

  def task_pids(self):
    """{'worker 1': [pid of attempt 0, pid of attempt 1, ...], ...} from the launcher's log."""
    pids = {}
    for line in self.lines:
      match = re.match(r"tfpar\.launch: started (.+?) \(pid (\d+)\)", line)
      if match:
        pids.setdefault(match.group(1), []).append(int(match.group(2)))
    return pids

  def finish(self, timeout=180):
    code = self.proc.wait(timeout)
    self._reader.join(10)
    return code

  @property
  def output(self):
    return "\n".join(self.lines)

  def cleanup(self):
    """However a test ended: the launcher stops its tasks on SIGTERM; any survivor is killed."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    for pids in self.task_pids().values():
      for pid in pids:
        if group_alive(pid):
          os.killpg(pid, signal.SIGKILL)


def group_alive(pid):
  """Is any process left of the task started as `pid` (it leads its own process group)?"""
  try:
    os.killpg(pid, 0)
    return True
  except ProcessLookupError:
    return False


@pytest.fixture
def launch():
  started = []

  def start(*args):
    started.append(Launched(list(args)))
    return started[-1]

  yield start
  for job in started:
    job.cleanup()


def assert_every_line_prefixed(job):
  unprefixed = [line for line in job.lines if line and not PREFIXED.match(line)]
  assert not unprefixed, f"lines without a task prefix: {unprefixed[:5]}"


@pytest.mark.parametrize("args, message", [
    (["--num_workers=2"], "no '--' before the training flags"),
    (["--num_workers=0", "--", "--model_dir=/tmp/x"], "--num_workers=0 must be at least 1"),
    (["--num_workers=1000", "--", "--model_dir=/tmp/x"], "more than 32 tasks on this machine"),
    (["--workers=2", "--", "--model_dir=/tmp/x"], "unknown launcher argument '--workers=2'"),
    (["--num_workers=two", "--", "--model_dir=/tmp/x"], "--num_workers=two is not an integer"),
    (["--num_workers=2", "--", "--strategy=multi_worker_mirrored"], "--model_dir is not set"),
    (["--num_workers=2", "--", "--model_dir=/tmp/x", "--no_such_flag=1"], "no_such_flag"),
    (["--num_workers=2", "--", "--model_dir=/tmp/x"], "would train independent copies"),
    (["--num_workers=2", "--num_ps=1", "--", "--model_dir=/tmp/x",
      "--strategy=multi_worker_mirrored"], "pass --strategy=parameter_server"),
    (["--num_workers=2", "--", "--model_dir=/tmp/x", "--strategy=parameter_server"],
     "pass --num_ps=1"),
    (["--num_workers=2", "--port_base=80", "--", "--model_dir=/tmp/x",
      "--strategy=multi_worker_mirrored"], "--port_base=80 must leave room"),
    (["--num_workers=2", "--grace_period=-1", "--", "--model_dir=/tmp/x"],
     "--grace_period=-1 must be a number of seconds >= 0"),
    (["--num_workers=2", "--restart_backoff=soon", "--", "--model_dir=/tmp/x"],
     "--restart_backoff=soon is not a number"),
])
def test_bad_launcher_input_is_one_line_and_exit_2(args, message):
  proc = run_module("tfpar.launch", args, check=False, timeout=60)
  assert proc.returncode == 2, proc.stderr
  assert proc.stdout == ""
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.launch: error: "), proc.stderr
  assert message in lines[0]


def two_free_ports():
  """A port p with p and p + 1 both free now (for --port_base)."""
  for _ in range(50):
    with socket.socket() as a, socket.socket() as b:
      try:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", a.getsockname()[1] + 1))
      except OSError:
        continue
      return a.getsockname()[1]
  raise AssertionError("no two consecutive free ports on 127.0.0.1")


def test_a_failing_task_ends_the_job_non_zero_and_leaves_no_process(launch, tmp_path):
  port = two_free_ports()
  job = launch("--num_workers=2", f"--port_base={port}", "--", *MWMS, f"--model_dir={tmp_path}",
               "--train_steps=100000", "--input_sharding=data", "--log_every=20",
               "--checkpoint_every=100000")
  # The chief has built its replica (so both workers joined the cluster) and goes on into
  # the first step's collectives, where it would wait for its dead peer for good.
  job.wait_for(r"^\[worker 0\] tfpar: ")
  assert f'"worker": ["127.0.0.1:{port}", "127.0.0.1:{port + 1}"]' in job.output
  pids = job.task_pids()
  os.kill(pids["worker 1"][0], signal.SIGKILL)
  code = job.finish(timeout=60)
  assert code == 128 + signal.SIGKILL, job.output[-3000:]
  assert "tfpar.launch: worker 1 was killed by SIGKILL: stopped every task; the job failed " \
         "with status 137" in job.output
  for task, [pid] in pids.items():
    assert not group_alive(pid), f"{task} (pid {pid}) outlived the job"
  assert_every_line_prefixed(job)


def test_max_restarts_restarts_the_whole_job_which_resumes_from_its_checkpoint(launch, tmp_path):
  # --input_sharding=auto: the default corpus has >= 4 files per worker, so file-level.
  job = launch("--num_workers=2", "--max_restarts=1", "--restart_backoff=0.5", "--", *MWMS,
               f"--model_dir={tmp_path}",
               "--train_steps=200", "--checkpoint_every=50", "--steps_per_call=10",
               "--log_every=10")
  job.wait_for(r"^\[worker 0\] saved .*ckpt-50$", timeout=300)
  os.kill(job.task_pids()["worker 1"][0], signal.SIGKILL)
  code = job.finish(timeout=400)
  assert code == 0, job.output[-3000:]
  out = job.output
  assert "worker 1 was killed by SIGKILL: stopped every task; restarting the job " \
         "(restart 1 of 1, in 0.5 s)" in out  # --restart_backoff
  resumed = re.search(r"^\[worker 0\] resumed from .*ckpt-(\d+) at step (\d+)$", out, re.M)
  assert resumed and resumed.group(1) == resumed.group(2) and int(resumed.group(1)) >= 50, out
  assert "tfpar.launch: job succeeded (2 tasks)" in out
  pids = job.task_pids()
  assert all(len(attempts) == 2 for attempts in pids.values()), pids  # every task restarted
  for attempts in pids.values():
    assert not any(group_alive(pid) for pid in attempts)
  # The resumed run logged every step after the checkpoint exactly once.
  steps = [r["step"] for r in read_metrics(str(tmp_path))]
  assert steps == list(range(10, 201, 10)), steps
  share = re.search(r"^\[worker 0\] tfpar: .* data: (\d+) of (\d+) \(this worker's share\) files, "
                    r".* file-level input sharding$", out, re.M)
  assert share and int(share.group(2)) // 2 == int(share.group(1)), out  # half the files each
  assert not re.search(r"auto.?shard", out, re.I), "tf.distribute should not auto-shard our input"
  assert_every_line_prefixed(job)


def test_restart_backoff_doubles_up_to_its_cap():
  assert [launch_lib.backoff(k, 1.0) for k in (1, 2, 3, 6, 7, 20)] == [1, 2, 4, 32, 60, 60]
  assert launch_lib.backoff(3, 0.0) == 0


def test_bad_input_found_by_the_tasks_is_not_restarted(launch, tmp_path):
  """Status 2 from a task (here: --model_dir holds another model) would only repeat."""
  (tmp_path / "config.json").write_text(json.dumps({"model": {"d_model": 999}}))
  job = launch("--num_workers=2", "--max_restarts=3", "--", *MWMS, f"--model_dir={tmp_path}")
  assert job.finish(timeout=120) == 2, job.output[-3000:]
  assert re.search(r"^\[worker \d\] tfpar\.train: error: --model_dir=.* holds a run with other "
                   r"model flags \([^)]*d_model", job.output, re.M), job.output[-3000:]
  assert "not restarted: it would fail again" in job.output
  assert all(len(attempts) == 1 for attempts in job.task_pids().values())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_task(launch, tmp_path, sig):
  job = launch("--num_workers=2", "--grace_period=30", "--", *MWMS, f"--model_dir={tmp_path}",
               "--train_steps=100000")
  # Both tasks have written a line (TensorFlow's start-up or tfpar's own), so
  # both run tfpar's code and have its SIGTERM handler.
  job.wait_for(r"^\[worker 0\] ")
  job.wait_for(r"^\[worker 1\] ")
  job.proc.send_signal(sig)
  # Each task takes the SIGTERM the launcher forwards as a preemption: it exits
  # 75 after saving (or at once, when nothing is trained yet); so does the job.
  assert job.finish(timeout=90) == status.PREEMPTED, job.output[-3000:]
  assert f"received {signal.Signals(sig).name}: stopping every task" in job.output
  for worker in (0, 1):
    assert re.search(rf"^\[worker {worker}\] tfpar: (SIGTERM outside the training loop .*: "
                     r"nothing to save|(worker 1: )?preempted \(SIGTERM\), saved)", job.output, re.M), \
        job.output[-3000:]
  assert "every task saved: exiting with status 75" in job.output
  for task, [pid] in job.task_pids().items():
    assert not group_alive(pid), f"{task} (pid {pid}) outlived the launcher"


def test_no_task_outlives_a_killed_launcher(launch, tmp_path):
  """SIGKILL leaves the launcher no chance to clean up: the kernel ends its tasks."""
  job = launch("--num_workers=2", "--", *MWMS, f"--model_dir={tmp_path}", "--train_steps=100000")
  job.wait_for(r"^tfpar\.launch: started worker 1 ")
  time.sleep(1.0)  # the tasks are importing TensorFlow
  pids = job.task_pids()
  assert all(group_alive(pid) for [pid] in pids.values())
  job.proc.kill()
  assert job.finish(timeout=30) == -signal.SIGKILL
  deadline = time.monotonic() + 10
  while any(group_alive(pid) for [pid] in pids.values()) and time.monotonic() < deadline:
    time.sleep(0.1)
  for task, [pid] in pids.items():
    assert not group_alive(pid), f"{task} (pid {pid}) outlived the launcher"
