"""Signals to `python -m tfpar.train` itself: real processes, real signals, no launcher.

Kubernetes and launchers may send SIGTERM more than once; a person at a
terminal presses Ctrl-C (SIGINT), maybe twice. Whatever arrives, a stop by
signal saves and exits 75 (tfpar.status.PREEMPTED), except a second SIGINT,
which aborts at once without saving (one line, exit 130). Each signal is sent
once the first progress line is out (training has started), never after a
fixed sleep.

The runs share one --model_dir, each resuming from the one before: so every
saved checkpoint is shown to restore, and to continue from its own step. The
loop stops only through preemption.Agreement.stop(), so the SIGINT run shows
the agreement counting SIGINT as a notice (a multi-worker agreement sums the
same flag over the workers).
"""

import os
import re
import signal
import time

import pytest

from conftest import TINY, Watched, read_metrics
from tfpar import status

STEPS = 100000  # Never reached: every run here ends by a signal.
ARGS = TINY + [f"--train_steps={STEPS}", "--seed=5", "--jit_compile=false", "--eval_steps=0",
               "--checkpoint_every=100000"]
SAVED = re.compile(r"^tfpar: preempted \((SIGTERM|SIGINT)\), saved (\S+/ckpt-(\d+)) at step "
                   r"(\d+); the next start resumes at step (\d+)$", re.M)


class Training(Watched):
  """`python -m tfpar.train` in the background: stdout read line by line, stderr kept apart."""

  def __init__(self, args):
    super().__init__("tfpar.train", args)

  def wait_for(self, pattern, timeout=240):
    return super().wait_for(pattern, timeout)

  def signal_until_exit(self, sig, every, timeout=120):
    """Sends `sig` now and then every `every` s until the process exits (or just once: None)."""
    deadline = time.monotonic() + timeout
    self.proc.send_signal(sig)
    while every is not None and self.proc.poll() is None and time.monotonic() < deadline:
      time.sleep(every)
      self.proc.send_signal(sig)  # A no-op once the process has exited.
    return self.finish(max(1.0, deadline - time.monotonic()))

  @property
  def stdout(self):
    return self.output


def train_and_signal(model_dir, sig, every=None):
  """Starts a run, signals it once it trains (again every `every` s, until it exits)."""
  run = Training(ARGS + [f"--model_dir={model_dir}"])
  run.wait_for(r"^step +\d+/")
  run.code = run.signal_until_exit(sig, every)
  return run


def saved_step(run):
  match = SAVED.search(run.stdout)
  assert match, run.stdout[-3000:]
  assert int(match.group(3)) == int(match.group(4))
  assert int(match.group(5)) == int(match.group(4)) + 1
  return int(match.group(4))


def assert_resumed_at(run, step):
  assert re.search(rf"^resumed from \S+/ckpt-{step} at step {step}$", run.stdout, re.M), \
      run.stdout[-3000:]


def checkpoint_steps(model_dir):
  names = os.listdir(os.path.join(model_dir, "checkpoints"))
  assert not [n for n in names if n.endswith("_temp")], names
  return sorted(int(m.group(1)) for m in map(re.compile(r"^ckpt-(\d+)\.index$").match, names) if m)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("signals") / "run")


@pytest.fixture(scope="module")
def sigterms(model_dir):
  """SIGTERM, then SIGTERM every 0.1 s over the save and the whole shutdown."""
  return train_and_signal(model_dir, signal.SIGTERM, every=0.1)


def test_repeated_sigterms_still_save_and_exit_75(sigterms, model_dir):
  assert sigterms.code == status.PREEMPTED, (sigterms.code, sigterms.stderr[-3000:])
  assert saved_step(sigterms) >= 1
  assert SAVED.search(sigterms.stdout).group(1) == "SIGTERM"
  assert sigterms.stderr == ""
  assert checkpoint_steps(model_dir) == [saved_step(sigterms)]


@pytest.fixture(scope="module")
def sigint(sigterms, model_dir):
  """One Ctrl-C, to the run that resumes from the SIGTERM run's checkpoint."""
  return train_and_signal(model_dir, signal.SIGINT)


ACK = (f"tfpar: SIGINT: saving a checkpoint after this chunk of steps, then exiting with status "
       f"{status.PREEMPTED}; press Ctrl-C again to abort without saving")


def test_a_first_sigint_saves_like_sigterm_and_exits_75(sigterms, sigint, model_dir):
  assert sigint.code == status.PREEMPTED, (sigint.code, sigint.stderr[-3000:])
  assert_resumed_at(sigint, saved_step(sigterms))
  assert SAVED.search(sigint.stdout).group(1) == "SIGINT"
  assert saved_step(sigint) > saved_step(sigterms)
  assert sigint.stderr.splitlines() == [ACK]  # The one line, at once: no traceback.
  assert "Traceback" not in sigint.stdout
  assert checkpoint_steps(model_dir) == [saved_step(sigterms), saved_step(sigint)]


@pytest.fixture(scope="module")
def sigints(sigint, model_dir):
  """Ctrl-C twice, the second once the first is acknowledged, while a long chunk still runs."""
  run = Training(ARGS + [f"--model_dir={model_dir}", "--steps_per_call=300", "--log_every=300"])
  run.wait_for(r"^step +\d+/")
  run.proc.send_signal(signal.SIGINT)
  deadline = time.monotonic() + 60
  while ACK not in run.stderr and time.monotonic() < deadline:
    time.sleep(0.01)
  run.proc.send_signal(signal.SIGINT)
  run.code = run.finish(120)
  return run


def test_a_second_sigint_aborts_at_once_without_saving(sigterms, sigint, sigints, model_dir):
  assert sigints.code == status.ABORTED, (sigints.code, sigints.stderr[-3000:])
  resumed = saved_step(sigint)
  assert_resumed_at(sigints, resumed)
  assert sigints.stderr.splitlines() == [
      ACK, "tfpar: second SIGINT: aborted without saving (the steps since the last checkpoint "
      f"are lost), exiting with status {status.ABORTED}"]
  assert "Traceback" not in sigints.stdout and not SAVED.search(sigints.stdout)
  # At once, mid-chunk: no chunk after the first progress line finished.
  assert read_metrics(model_dir)[-1]["step"] == (resumed // 300 + 1) * 300
  assert checkpoint_steps(model_dir) == [saved_step(sigterms), resumed]
