"""SIGTERM (or Ctrl-C) as a preemption notice: every worker saves at one agreed step, then exits 75.

Kubernetes (eviction, node drain, spot reclaim) and TPU maintenance send
SIGTERM, then SIGKILL after a grace period; a person at a terminal presses
Ctrl-C (SIGINT). tfpar turns either into a flag; the loop checks it between
two `engine.train` calls (so at most one --steps_per_call chunk runs after the
signal), and then, if any worker was signalled, every worker saves a
checkpoint at the same step and exits with `tfpar.status.PREEMPTED`. The next
start resumes from that checkpoint: no step is lost or repeated.

More signals. Kubernetes and launchers may send SIGTERM again while a worker
saves or shuts down: it changes nothing, the save goes on and the status is
75. Once the process has decided to exit 75, `stand_down` sets both signals to
SIG_IGN: CPython's finalization (3.11, `_PySignal_Fini`) restores SIG_DFL for
every handler Python installed and leaves SIG_IGN alone, so a SIGTERM during
the seconds of teardown after `sys.exit` (TensorFlow's threads) would kill a
process that had saved, with status 143. A second SIGINT is a person who will
not wait for the save: a thread (woken through `signal.set_wakeup_fd`, so it
runs even while the main thread is inside a TensorFlow call, where Python
handlers wait) prints one line and exits 130 at once, without saving; the
checkpoints already written stay as they are. Only tfpar.train watches SIGINT
(`watch(interrupt=True)`); a run inside another program (the tests) leaves its
Ctrl-C alone.

Agreement. A signal reaches one pod, not all of them. Workers of a
synchronous multi-worker job (multi_worker_mirrored, also under model
parallelism) run the same chunks in the same order, so after each chunk they
all-reduce their flags (one SUM of a scalar per chunk): all see the same sum,
and all stop after the same chunk. Every other run has a single training
process (one_device, mirrored, model parallel on one host, tpu with its one
client, and the parameter-server chief, whose workers and ps only serve): its
own flag decides. SIGTERM and SIGINT set the same flag.

Why not tf.distribute.experimental.PreemptionCheckpointHandler: it counts its
own `run` calls and saves and restores its own tf.train.Checkpoint (with that
count in it), while tfpar's checkpoint is canonical (tfpar.training.checkpoint,
restorable under any plan) and its position is the optimizer step; it does
not support parameter servers; and its agreement goes through the coordination
service's key-value store, which single-host strategies do not start. The
all-reduce above is the same agreement in the strategy's own collectives.

What TensorFlow 2.21 does with SIGTERM by itself: creating a
MultiWorkerMirroredStrategy installs a C++ handler (the coordination
service's preemption notifier, `preemption_notifier.cc: SIGTERM caught`) that
only logs and lets the process run on, so without tfpar's handler a worker
ignores SIGTERM until SIGKILL. Python's `signal.signal` replaces that C
handler, which is why `watch` runs again after the strategy is created.
"""

import os
import signal
import threading
import time

from tfpar import status


def _say(line: str) -> None:
  """One line on stderr, written whole: safe in a handler, whatever sys.stderr is doing."""
  os.write(2, (line + "\n").encode())


class _Watcher:
  """The process-wide notice flag (signal handlers are process-wide too)."""

  def __init__(self):
    self.armed = False  # True while the loop runs: before that, a notice exits at once.
    self.signalled_at = None
    self.notice = None  # The first signal's name, 'SIGTERM' or 'SIGINT'.
    self.signals = [signal.SIGTERM]  # What `watch` installs the handler for.
    self.interrupts = 0  # SIGINTs seen by the interrupt thread.
    self.standing_down = False  # Exiting 75 after the save: nothing aborts it any more.

  def _on_signal(self, signum, frame):  # pylint: disable=unused-argument
    if self.signalled_at is None:
      self.signalled_at = time.monotonic()
      self.notice = signal.Signals(signum).name
    if not self.armed:
      # Nothing trained since the last checkpoint: exit now, as preempted.
      _say(f"tfpar: {signal.Signals(signum).name} outside the training loop (before it "
           f"started, or after its last save): nothing to save, exiting with status "
           f"{status.PREEMPTED}")
      os._exit(status.PREEMPTED)  # pylint: disable=protected-access  # TF threads may be mid-call.

  def _count_interrupts(self, fd: int) -> None:
    """The interrupt thread: a second SIGINT aborts at once, even mid-step or mid-save."""
    while True:
      for signum in os.read(fd, 64):
        if signum != signal.SIGINT or self.standing_down:
          continue
        self.interrupts += 1
        if self.interrupts == 1 and self.armed:
          _say("tfpar: SIGINT: saving a checkpoint after this chunk of steps, then exiting with "
               f"status {status.PREEMPTED}; press Ctrl-C again to abort without saving")
        elif self.interrupts > 1:
          _say("tfpar: second SIGINT: aborted without saving (the steps since the last checkpoint "
               f"are lost), exiting with status {status.ABORTED}")
          os._exit(status.ABORTED)  # pylint: disable=protected-access


_WATCHER = _Watcher()


def _start_interrupt_thread() -> None:
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)  # set_wakeup_fd's rule: a signal never blocks on it.
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  count = _WATCHER._count_interrupts  # pylint: disable=protected-access
  threading.Thread(target=count, args=(read_fd,), name="tfpar-interrupts", daemon=True).start()


def watch(interrupt: bool = False) -> None:
  """Installs (again) tfpar's handlers; call at start-up and after a strategy is made.

  Args:
    interrupt: also take SIGINT as a notice, and a second one as an abort
      (tfpar.train's start-up; later calls keep what it chose).
  """
  if threading.current_thread() is not threading.main_thread():  # Python's rule for handlers.
    return
  if interrupt and signal.SIGINT not in _WATCHER.signals:
    _WATCHER.signals.append(signal.SIGINT)
    _start_interrupt_thread()
  for signum in _WATCHER.signals:
    signal.signal(signum, _WATCHER._on_signal)  # pylint: disable=protected-access


def arm() -> None:
  """From now on a notice only sets the flag; the loop saves and stops at the next check."""
  watch()
  _WATCHER.armed = True


def disarm() -> None:
  _WATCHER.armed = False


def signalled() -> bool:
  """Whether this process has received SIGTERM or SIGINT."""
  return _WATCHER.signalled_at is not None


def notice() -> str:
  """The signal that stopped this process, for its last line ('SIGTERM' when a peer's did)."""
  return _WATCHER.notice or "SIGTERM"


def stand_down() -> None:
  """Call once the process will exit 75: every later SIGTERM or SIGINT is ignored.

  SIG_IGN, not a handler: interpreter finalization keeps it (see the module
  docstring), so the status stays 75 however many signals the teardown meets.
  """
  _WATCHER.standing_down = True
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, signal.SIG_IGN)


class Agreement:
  """Decides, the same way on every worker, whether to stop after this chunk.

  Args:
    strategy: the engine's strategy (None for a model-parallel copy on one host).
  """

  def __init__(self, strategy):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    self._count = None
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):

      @tf.function
      def count(flag):
        # Each replica's copy of its worker's flag, summed over every replica of every worker.
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

      self._count = count
      self._tf = tf

  def stop(self) -> bool:
    """True on every worker iff some worker has been signalled (a collective when multi-worker)."""
    if self._count is None:
      return signalled()
    return float(self._count(self._tf.constant(float(signalled())))) > 0


class Preempted(Exception):
  """Raised by the loop once the preemption checkpoint is written."""

  def __init__(self, step: int):
    super().__init__(step)
    self.step = step
