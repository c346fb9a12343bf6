"""tfpar.launch behaves like a Kubernetes job: real processes on 127.0.0.1, no mocks.

A task that fails (here: SIGKILLed mid-training, as the OOM killer or a node
loss would) ends the whole job with a non-zero status and leaves no process
behind; with --max_restarts the whole job starts again and resumes from the
latest checkpoint; a signal to the launcher stops every task; every line a task
writes carries its task's prefix.

The restart policy itself (launch.decide) is a pure function: its rules are
tested row by row, in-process, without starting anything.

The model is tiny and --jit_compile=false: the launcher is under test here, not
the step, and XLA would add ~30 s of compilation per process on 2 cores.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from conftest import TINY, Watched, in_background, read_metrics, run_module, selected_tests_use
from tfpar.cli import launch as launch_lib
from tfpar import status

MWMS = TINY + ["--strategy=multi_worker_mirrored", "--jit_compile=false", "--eval_steps=0"]
PREFIXED = re.compile(r"^(tfpar\.launch: |\[(chief|worker \d+|ps \d+)\] )")


class Launched(Watched):
  """`python -m tfpar.launch ...` running in the background, its output read line by line."""

  def __init__(self, args):
    # TensorFlow's C++ warnings shown (tfpar.train would hide them): the logs are checked.
    super().__init__("tfpar.launch", args, env={"TF_CPP_MIN_LOG_LEVEL": "0"}, merge_stderr=True)

  def task_pids(self):
    """{'worker 1': [pid of attempt 0, pid of attempt 1, ...], ...} from the launcher's log."""
    pids = {}
    for line in self.lines:
      match = re.match(r"tfpar\.launch: started (.+?) \(pid (\d+)\)", line)
      if match:
        pids.setdefault(match.group(1), []).append(int(match.group(2)))
    return pids

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
def test_bad_launcher_input_is_one_line_and_exit_2(args, message, capsys):
  """launch.main, in this process: no task may start (the command's own wiring is below)."""
  assert launch_lib.main(args) == 2
  out, err = capsys.readouterr()
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.launch: error: "), err
  assert message in lines[0]


def test_the_command_refuses_bad_input_with_status_2_and_one_line():
  """`python -m tfpar.launch` exits with main's status and prints only its line."""
  proc = run_module("tfpar.launch", ["--num_workers=2", "--", "--model_dir=/tmp/x",
                                     "--no_such_flag=1"], check=False, timeout=60)
  assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tfpar.launch: error: "), proc.stderr
  assert "no_such_flag" in lines[0]


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


def test_restart_backoff_doubles_up_to_its_cap():
  assert [launch_lib.backoff(k, 1.0) for k in (1, 2, 3, 6, 7, 20)] == [1, 2, 4, 32, 60, 60]
  assert launch_lib.backoff(3, 0.0) == 0


# The restart policy, rule by rule: launch.decide needs no process, so each row
# runs in microseconds. Tasks of a multi-worker job (MW) and of a
# parameter-server job (PS: the chief, 2 workers, 1 ps).
Task, Stop, Restart, GoOn = launch_lib.Task, launch_lib.Stop, launch_lib.Restart, launch_lib.GoOn
W0, W1, CHIEF, PS0 = Task("worker", 0), Task("worker", 1), Task("chief", 0), Task("ps", 0)
MW, PS = (W0, W1), (CHIEF, W0, W1, PS0)
SAVED = "every task saved: exiting with status 75 (start the same command again to resume)"
NOT_RESTARTED_TAIL = "stopped every task; the job failed with status {}, not restarted: it would " \
                     "fail again"


def ended(tasks, codes, task=None, code=0, gone=()):
  """An attempt that ended: `codes` in the order of `tasks`; `task` ended it with `code`."""
  return launch_lib.Outcome(dict(zip(tasks, codes)), task, code, frozenset(gone))


def signalled(tasks, codes, signum=signal.SIGTERM, gone=()):
  """The launcher received `signum`; `codes` are its tasks' after the stop."""
  return launch_lib.Outcome(dict(zip(tasks, codes)), gone=frozenset(gone), signal=signum)


# (outcome, restarts used, --max_restarts, --restart_backoff, decision)
POLICY = [
    pytest.param(ended(MW, (0, 0)), 0, 0, 1.0, Stop(0, "job succeeded (2 tasks)"),
                 id="every-worker-exits-0"),
    pytest.param(ended((W0,), (0,)), 0, 0, 1.0, Stop(0, "job succeeded (1 task)"),
                 id="one-task-singular"),
    pytest.param(ended(PS, (0, None, None, None)), 0, 0, 1.0, Stop(0, "job succeeded (4 tasks)"),
                 id="ps-job-chief-exits-0"),
    pytest.param(ended(MW, (None, 2), W1, 2), 0, 3, 1.0,
                 Stop(2, "worker 1 exited with status 2 (bad input, see its error line): "
                      + NOT_RESTARTED_TAIL.format(2)), id="bad-input-not-restarted"),
    pytest.param(ended(MW, (3, None), W0, 3), 0, 3, 1.0,
                 Stop(3, "worker 0 exited with status 3 (a NaN or infinite step, see its error "
                      "line): " + NOT_RESTARTED_TAIL.format(3)), id="nonfinite-not-restarted"),
    pytest.param(ended(MW, (4, 4), W0, 4), 0, 3, 1.0,
                 Stop(4, "worker 0 exited with status 4 (a full disk, see its error line): "
                      + NOT_RESTARTED_TAIL.format(4)), id="disk-full-not-restarted"),
    pytest.param(ended(PS, (None, 2, None, None), W0, 2), 0, 3, 1.0,
                 Stop(2, "worker 0 exited with status 2 (bad input, see its error line): "
                      + NOT_RESTARTED_TAIL.format(2)), id="ps-worker-bad-input-stops-the-job"),
    # Both exited by the same poll: the task that ended the attempt decides.
    pytest.param(ended(MW, (2, 1), W0, 2), 0, 3, 1.0,
                 Stop(2, "worker 0 exited with status 2 (bad input, see its error line): "
                      + NOT_RESTARTED_TAIL.format(2)), id="mix-2-first-then-1"),
    pytest.param(ended(MW, (2, 1), W1, 1), 0, 3, 1.0,
                 Restart(1.0, True, "worker 1 exited with status 1: stopped every task; "
                         "restarting the job (restart 1 of 3, in 1 s), it resumes from the latest "
                         "checkpoint"), id="mix-1-first-then-2"),
    # None: still running when the attempt ended, the launcher kills it.
    pytest.param(ended(MW, (None, -9), W1, -9), 0, 2, 0.5,
                 Restart(0.5, True, "worker 1 was killed by SIGKILL: stopped every task; "
                         "restarting the job (restart 1 of 2, in 0.5 s), it resumes from the "
                         "latest checkpoint"), id="first-restart-peer-still-running"),
    pytest.param(ended(MW, (1, None), W0, 1), 1, 2, 1.0,
                 Restart(2.0, True, "worker 0 exited with status 1: stopped every task; "
                         "restarting the job (restart 2 of 2, in 2 s), it resumes from the latest "
                         "checkpoint"), id="the-last-restart-doubles-the-backoff"),
    pytest.param(ended(MW, (1, None), W0, 1), 10, 20, 1.0,
                 Restart(60.0, True, "worker 0 exited with status 1: stopped every task; "
                         "restarting the job (restart 11 of 20, in 60 s), it resumes from the "
                         "latest checkpoint"), id="backoff-capped"),
    pytest.param(ended(MW, (None, 1), W1, 1), 2, 2, 1.0,
                 Stop(1, "worker 1 exited with status 1: stopped every task; the job failed with "
                      "status 1 after 2 restarts"), id="restarts-used-up"),
    pytest.param(ended(MW, (None, 1), W1, 1), 1, 1, 1.0,
                 Stop(1, "worker 1 exited with status 1: stopped every task; the job failed with "
                      "status 1 after 1 restart"), id="restarts-used-up-singular"),
    pytest.param(ended(MW, (None, -9), W1, -9), 0, 0, 1.0,
                 Stop(137, "worker 1 was killed by SIGKILL: stopped every task; the job failed "
                      "with status 137"), id="max-restarts-0-signal-status-as-a-shell"),
    pytest.param(ended(MW, (-99, None), W0, -99), 0, 0, 1.0,
                 Stop(227, "worker 0 was killed by signal 99: stopped every task; the job failed "
                      "with status 227"), id="unnamed-signal"),
    pytest.param(ended(MW, (130, None), W0, 130), 0, 1, 0.0,
                 Restart(0.0, True, "worker 0 exited with status 130: stopped every task; "
                         "restarting the job (restart 1 of 1, in 0 s), it resumes from the latest "
                         "checkpoint"), id="aborted-130-is-a-failure"),
    # Preempted: at once, not counted, even with no restarts left.
    pytest.param(ended(MW, (75, 75), W1, 75), 0, 0, 1.0,
                 Restart(0.0, False, "worker 0, worker 1 exited with status 75: every task saved; "
                         "restarting the job (a preemption restart, not counted in "
                         "--max_restarts), it resumes from the saved step"),
                 id="75-from-every-task-names-them-all"),
    pytest.param(ended(MW, (0, 75), W1, 75), 3, 3, 1.0,
                 Restart(0.0, False, "worker 1 exited with status 75: every task saved; "
                         "restarting the job (a preemption restart, not counted in "
                         "--max_restarts), it resumes from the saved step"),
                 id="75-from-one-task"),
    # Parameter servers: a worker or the chief restarts alone, a ps restarts all.
    pytest.param(ended(PS, (None, None, 1, None), W1, 1), 0, 1, 1.0,
                 Restart(1.0, True, "worker 1 exited with status 1: the chief runs its steps on "
                         "the other workers; starting worker 1 again (restart 1 of 1, in 1 s)",
                         task=W1), id="ps-worker-restarts-alone"),
    pytest.param(ended(PS, (None, None, 1, None), W1, 1), 1, 1, 1.0,
                 GoOn(W1, "worker 1 exited with status 1: no restarts left (--max_restarts=1); "
                      "the chief goes on with the other workers"), id="ps-worker-left-gone"),
    pytest.param(ended(PS, (None, 75, None, None), W0, 75), 0, 0, 1.0,
                 Restart(0.0, False, "worker 0 exited with status 75: the chief runs its steps on "
                         "the other workers; starting worker 0 again (a preemption restart, not "
                         "counted in --max_restarts)", task=W0), id="ps-worker-preempted"),
    pytest.param(ended(PS, (1, None, None, None), CHIEF, 1), 0, 3, 1.0,
                 Restart(1.0, True, "chief exited with status 1: starting the chief again "
                         "(restart 1 of 3, in 1 s); the workers and ps keep serving, it resumes "
                         "from the latest checkpoint", task=CHIEF), id="ps-chief-restarts-alone"),
    pytest.param(ended(PS, (75, None, None, None), CHIEF, 75), 0, 0, 1.0,
                 Restart(0.0, False, "chief exited with status 75: starting the chief again (a "
                         "preemption restart, not counted in --max_restarts); the workers and ps "
                         "keep serving, it resumes from the latest checkpoint", task=CHIEF),
                 id="ps-chief-preempted"),
    pytest.param(ended(PS, (1, None, None, None), CHIEF, 1), 0, 0, 1.0,
                 Stop(1, "chief exited with status 1: stopped every task; the job failed with "
                      "status 1"), id="ps-chief-no-restarts-left"),
    pytest.param(ended(PS, (None, None, None, -9), PS0, -9), 0, 1, 1.0,
                 Restart(1.0, True, "ps 0 was killed by SIGKILL: stopped every task; restarting "
                         "the job (restart 1 of 1, in 1 s), it resumes from the latest "
                         "checkpoint"), id="ps-task-restarts-the-job"),
    # A signal to the launcher stops the job, whatever restarts remain.
    pytest.param(signalled(MW, (75, 75)), 0, 3, 1.0, Stop(75, SAVED), id="signal-every-task-saved"),
    pytest.param(signalled(MW, (0, 75)), 0, 3, 1.0, Stop(75, SAVED), id="signal-saved-or-done"),
    pytest.param(signalled(MW, (0, 0)), 0, 3, 1.0, Stop(143, ""), id="signal-nothing-saved"),
    pytest.param(signalled(MW, (75, -9), signal.SIGINT), 0, 3, 1.0, Stop(130, ""),
                 id="signal-one-task-killed"),
    pytest.param(signalled(MW, (75, None)), 0, 3, 1.0, Stop(143, ""), id="signal-task-not-done"),
    pytest.param(signalled((), ()), 0, 3, 1.0, Stop(143, ""), id="signal-before-any-task"),
    pytest.param(signalled(PS, (75, 75, 1, 75), gone=(W1,)), 0, 0, 1.0, Stop(75, SAVED),
                 id="signal-gone-worker-ignored"),
]


@pytest.mark.parametrize("outcome, restarts, max_restarts, restart_backoff, decision", POLICY)
def test_restart_policy(outcome, restarts, max_restarts, restart_backoff, decision):
  assert launch_lib.decide(outcome, restarts=restarts, max_restarts=max_restarts,
                           restart_backoff=restart_backoff) == decision


def test_the_launcher_refuses_to_restart_what_kubernetes_fails():
  """One list of statuses no restart fixes, for the launcher and the manifests alike."""
  assert sorted(launch_lib.NOT_RESTARTED) == sorted(status.NOT_RESTARTABLE)


@pytest.mark.parametrize("num_ps, labels", [
    (0, ["worker 0", "worker 1"]),
    (2, ["chief", "worker 0", "worker 1", "ps 0", "ps 1"]),
])
def test_a_chief_only_with_parameter_servers(num_ps, labels):
  cfg = launch_lib.LaunchConfig(num_workers=2, num_ps=num_ps)
  assert [t.label for t in launch_lib.cluster_tasks(cfg)] == labels


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


# Last in the file: its job runs from the first test on, beside all the others.

def killed_and_restarted(model_dir):
  """A two-worker job under --max_restarts=1 whose worker 1 dies of SIGSEGV (a native crash, as
  TensorFlow's own would end it) once a checkpoint is saved; waits for the job to end (its exit
  status in job.code)."""
  # --input_sharding=auto: the default corpus has >= 4 files per worker, so file-level.
  job = Launched(["--num_workers=2", "--max_restarts=1", "--restart_backoff=0.5", "--", *MWMS,
                  f"--model_dir={model_dir}", "--train_steps=200", "--checkpoint_every=50",
                  "--steps_per_call=10", "--log_every=10"])
  try:
    job.wait_for(r"^\[worker 0\] saved .*ckpt-50$", timeout=300)
    os.kill(job.task_pids()["worker 1"][0], signal.SIGSEGV)
    job.code = job.finish(timeout=400)
  finally:
    job.cleanup()
  return job


@pytest.fixture(scope="module", autouse=True)
def restarted_started(request, tmp_path_factory):
  """(model_dir, Future of killed_and_restarted), started with the file's first test when a
  selected test reads it: its processes take the second core beside the other tests."""
  if selected_tests_use(request, "restarted"):
    model_dir = tmp_path_factory.mktemp("restarted")
    return model_dir, in_background(killed_and_restarted, model_dir)
  return None


@pytest.fixture(scope="module")
def restarted(restarted_started):
  model_dir, future = restarted_started
  return model_dir, future.result()


def test_max_restarts_restarts_the_whole_job_which_resumes_from_its_checkpoint(restarted):
  tmp_path, job = restarted
  code = job.code
  assert code == 0, job.output[-3000:]
  out = job.output
  assert "worker 1 was killed by SIGSEGV: stopped every task; restarting the job " \
         "(restart 1 of 1, in 0.5 s)" in out  # --restart_backoff
  assert "[worker 1] Fatal Python error: Segmentation fault" in out  # faulthandler's stacks
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
  share = re.search(r"^\[worker 0\] tfpar: .* data: (\d+) files of (\d+) \(this worker's share\), "
                    r".* file-level input sharding$", out, re.M)
  assert share and int(share.group(2)) // 2 == int(share.group(1)), out  # half the files each
  assert not re.search(r"auto.?shard", out, re.I), "tf.distribute should not auto-shard our input"
  assert_every_line_prefixed(job)
