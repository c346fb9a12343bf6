"""Start a real local cluster: one `python -m tfpar.train` process per task, on 127.0.0.1.

    # Multi-worker mirrored: 2 workers, worker 0 is the chief.
    python -m tfpar.launch --num_workers=2 -- --strategy=multi_worker_mirrored --model_dir=runs/mw

    # Parameter server: a chief (the coordinator), 2 workers, 1 parameter server.
    python -m tfpar.launch --num_workers=2 --num_ps=1 -- --strategy=parameter_server --model_dir=runs/ps

Every task gets its own TF_CONFIG on free loopback ports (or `--port_base`,
`--port_base+1`, ... in the order chief, workers, ps: refused if any is taken),
its output streamed live with a `[worker 1] ` prefix. TensorFlow's servers
listen on those ports on every interface, not only 127.0.0.1, and are
unauthenticated: on a shared or exposed machine, firewall them. The launcher
behaves like a Kubernetes job; task statuses are those of tfpar.status (2 bad
input, 75 preempted, else a failure):

- Multi-worker: the job succeeds when every worker exits 0. When any task
  fails, the others are terminated at once (a peer left in a collective would
  wait for the dead one), and the job fails with that task's status, unless
  `--max_restarts` remain: then, after a backoff (`--restart_backoff` seconds,
  doubled at every restart, at most MAX_BACKOFF), every task is started again
  (on fresh ports, unless --port_base fixes them) and training resumes from the
  latest checkpoint in --model_dir. A task that exits with status 2 (bad
  input), 3 (a NaN or infinite step) or 4 (a full disk) is not restarted: it
  would fail again.
- Preemption: a task that exits 75 saved a checkpoint together with its peers
  (tfpar.training.preemption); the launcher gives the others up to
  `--grace_period` seconds to finish their save, then starts the job again at
  once (not counted in --max_restarts: nothing failed).
- Parameter server: worker and ps tasks are servers for the chief; the job
  ends when the chief (coordinator) exits 0. A worker that dies does not stop
  the job: the chief's ClusterCoordinator runs its steps on the other workers,
  and the launcher starts that worker again (same address, if --max_restarts
  remain), where the coordinator picks it up. A chief that fails or is
  preempted is started again alone (if restarts remain, or always when
  preempted): the servers keep serving and it reconnects to them, as
  TensorFlow's ClusterCoordinator documents. A ps task that dies fails the job
  (TensorFlow needs the coordinator and ps restarted): every task restarts.
- Pipeline stages across workers: every worker runs its own stages
  (tfpar.engines.stage_worker) and the job ends as any multi_worker_mirrored
  job does: when every task exited 0; any task's failure restarts the whole job.
- SIGTERM or Ctrl-C to the launcher: every task gets SIGTERM and up to
  `--grace_period` seconds to save (then SIGKILL); the launcher exits 75 if
  every task saved (exited 75 or 0), else 128 + the signal. If the launcher
  itself is killed, the kernel kills each task (PR_SET_PDEATHSIG), so no task
  outlives it.

These rules are one pure function, `decide`: an attempt's `Outcome` (each
task's exit status, the task that ended the attempt, a signal to the launcher)
and the restarts used so far in, a `Stop`, `Restart` or `GoOn` with the line to
print out. `launch` only runs the tasks, waits for them and acts on it.

Bad launcher input (or training flags that cannot work) ends with one line on
stderr and exit status 2, before any process starts.
"""

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

from tfpar.config import cluster as cluster_lib
from tfpar import status
from tfpar.cli import tool
from tfpar.console import count

USAGE = ("python -m tfpar.launch --num_workers=N [--num_ps=P] [--max_restarts=R] "
         "[--restart_backoff=SECONDS] [--grace_period=SECONDS] [--port_base=PORT] "
         "-- <tfpar.train flags>")
# Seconds a task gets after SIGTERM when a peer has failed, before SIGKILL: a task whose
# peer died cannot finish a step or a save, but given this long it ends on its own with the
# one line that names the peer (TensorFlow's heartbeats notice a dead peer in about 10 s
# when no reset connection tells it sooner: docs/failures.md).
TERMINATE_GRACE = 30.0
# Local tasks are whole TensorFlow processes (~0.5 GB each) sharing one machine's
# cores: 32 is past what a workstation runs usefully; more is a typo.
MAX_LOCAL_TASKS = 32
# The longest wait between two restarts (--restart_backoff doubles up to it).
MAX_BACKOFF = 60.0
# Task statuses that end the job at once, whatever --max_restarts says: a restart
# would fail the same way (tfpar.status).
NOT_RESTARTED = {status.BAD_INPUT: "bad input", status.NONFINITE: "a NaN or infinite step",
                 status.DISK_FULL: "a full disk"}
# Seconds the other workers get to finish once the chief of a multi-worker job
# has succeeded (they only clean up by then), before they count as hung.
FINISH_GRACE = 120.0


class LaunchError(ValueError):
  """Launcher input that cannot work; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  num_workers: int
  num_ps: int = 0
  max_restarts: int = 0
  port_base: int = 0  # 0: pick free ports
  # Seconds a task may take to save after SIGTERM before SIGKILL (preemption,
  # or a signal to the launcher). Kubernetes' terminationGracePeriodSeconds
  # must be at least this.
  grace_period: float = 60.0
  restart_backoff: float = 1.0  # before restart k: restart_backoff * 2**(k-1), <= MAX_BACKOFF
  train_args: Tuple[str, ...] = ()
  module: str = "tfpar.train"


@dataclasses.dataclass(frozen=True)
class Task:
  type: str
  index: int

  @property
  def label(self) -> str:
    return self.type if self.type == "chief" else f"{self.type} {self.index}"


def parse_args(argv: Sequence[str]) -> LaunchConfig:
  """Parses `[launcher flags] -- [train flags]`; raises LaunchError on anything wrong."""
  argv = list(argv)
  if "--" not in argv:
    raise LaunchError(f"no '--' before the training flags: {USAGE}")
  split = argv.index("--")
  own, train_args = argv[:split], argv[split + 1:]
  values = {"num_workers": None, "num_ps": 0, "max_restarts": 0, "port_base": 0,
            "grace_period": 60.0, "restart_backoff": 1.0}
  for arg in own:
    name, eq, value = arg.partition("=")
    key = name[2:] if name.startswith("--") else None
    if key not in values or not eq:
      raise LaunchError(f"unknown launcher argument {arg!r}: {USAGE}")
    kind = float if isinstance(values[key], float) else int
    try:
      values[key] = kind(value)
    except ValueError:
      raise LaunchError(f"--{key}={value} is not {'a number' if kind is float else 'an integer'}"
                        ) from None
    if kind is float and not 0 <= values[key] < float("inf"):
      raise LaunchError(f"--{key}={value} must be a number of seconds >= 0")
  if values["num_workers"] is None:
    raise LaunchError(f"--num_workers is not set: {USAGE}")
  if values["num_workers"] < 1:
    raise LaunchError(f"--num_workers={values['num_workers']} must be at least 1")
  if values["num_ps"] < 0 or values["max_restarts"] < 0:
    raise LaunchError("--num_ps and --max_restarts must be >= 0")
  if values["num_workers"] + values["num_ps"] > MAX_LOCAL_TASKS:
    raise LaunchError(f"--num_workers={values['num_workers']} --num_ps={values['num_ps']}: "
                      f"more than {MAX_LOCAL_TASKS} tasks on this machine; each is a whole "
                      "TensorFlow process (hundreds of MB); for more, use a cluster "
                      "(python -m tfpar.k8s render)")
  cfg = LaunchConfig(train_args=tuple(train_args), **values)
  num_tasks = len(cluster_tasks(cfg))
  if cfg.port_base and not 1024 <= cfg.port_base <= 65535 - num_tasks:
    raise LaunchError(f"--port_base={cfg.port_base} must leave room for {count(num_tasks, 'port')} "
                      f"in 1024..65535 (or 0 to pick free ports)")
  if not train_args:
    raise LaunchError(f"no training flags after '--': {USAGE}")
  _check_train_flags(cfg)
  if cfg.port_base:
    check_ports_free(range(cfg.port_base, cfg.port_base + num_tasks))
  return cfg


def _check_train_flags(cfg: LaunchConfig) -> None:
  """Validates the training flags once, here, instead of N times in N processes."""
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from tfpar.config import config as config_lib  # pylint: disable=import-outside-toplevel
  from tfpar.config import flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  from tfpar.config.schema import ConfigError  # pylint: disable=import-outside-toplevel
  try:
    parsed = tfpar_flags.parse(cfg.train_args)
    strategy = config_lib.from_flags(parsed).dist.strategy
  except absl_flags.Error as e:
    raise LaunchError(f"training flags: {str(e).splitlines()[0]}") from None
  except ConfigError as e:
    raise LaunchError(f"training flags: {e}") from None
  try:
    cluster_lib.check_job_shape(strategy, cfg.num_workers, cfg.num_ps)
  except cluster_lib.ClusterError as e:
    raise LaunchError(str(e)) from None


def cluster_tasks(cfg: LaunchConfig) -> List[Task]:
  """The job's tasks in port order: the chief (parameter-server jobs), workers, ps."""
  return [Task(role, i) for role, n in cluster_lib.job_roles(cfg.num_workers, cfg.num_ps)
          for i in range(n)]


def free_ports(count: int) -> List[int]:
  """`count` distinct ports free right now on every interface (held open until all are chosen)."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("", 0))  # TF's servers bind all interfaces, not just the loopback TF_CONFIG names
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def check_ports_free(ports: Sequence[int]) -> None:
  """Raises LaunchError naming every port some process already listens on.

  TensorFlow's servers listen on all interfaces whatever address TF_CONFIG
  gives, so a port counts as taken if it cannot be bound on all of them. Checked
  for every task before any starts: a task that cannot bind would die late, or
  its peers would talk to a stranger's server.
  """
  taken = []
  for port in ports:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      # SO_REUSEADDR: connections of an earlier job in TIME_WAIT do not count, listeners do.
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(("", port))
      except OSError:
        taken.append(port)
  if taken:
    raise LaunchError(f"port(s) {', '.join(map(str, taken))} already in use: stop what listens "
                      "there, or pass another --port_base (or 0 to pick free ports)")


def tf_configs(tasks: Sequence[Task], ports: Sequence[int]) -> Dict[Task, str]:
  """TF_CONFIG for every task: the same cluster, each its own task entry."""
  spec: Dict[str, List[str]] = {}
  for task, port in zip(tasks, ports):
    spec.setdefault(task.type, []).append(f"127.0.0.1:{port}")
  return {task: cluster_lib.tf_config(spec, task.type, task.index) for task in tasks}


try:
  _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux: tasks then rely on the launcher's own cleanup
  _LIBC = None


def _die_with_parent() -> None:
  """Runs in the child before exec: SIGKILL it if the launcher dies (Linux).

  SIGKILL, not SIGTERM: a multi-worker TF task survives SIGTERM (see
  TERMINATE_GRACE), and with the launcher gone nobody would follow up.
  """
  if _LIBC is not None:
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Output:
  """Streams a task's stdout and stderr, line by line, each line prefixed."""

  _lock = threading.Lock()

  def __init__(self, proc: subprocess.Popen, label: str):
    self.threads = [
        threading.Thread(target=self._pump, args=(proc.stdout, sys.stdout, label), daemon=True),
        threading.Thread(target=self._pump, args=(proc.stderr, sys.stderr, label), daemon=True)]
    for t in self.threads:
      t.start()

  def _pump(self, pipe, out, label):
    prefix = f"[{label}] "
    for raw in iter(pipe.readline, b""):
      line = raw.decode("utf-8", errors="replace").rstrip("\n")
      with self._lock:
        try:
          out.write(prefix + line + "\n")
          out.flush()
        except (OSError, ValueError):
          pass  # our reader is gone (`| head`): keep draining, or the task blocks on a full pipe
    pipe.close()

  def join(self, timeout: float = 5.0) -> None:
    for t in self.threads:
      t.join(timeout)


def say(message: str) -> None:
  with _Output._lock:  # pylint: disable=protected-access
    print(f"tfpar.launch: {message}", file=sys.stderr, flush=True)


def describe_status(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with status {code}"


def job_status(code: int) -> int:
  """A task's status as the job's: a signal -N becomes 128+N, as a shell reports it."""
  return 128 - code if code < 0 else code


class _Stop(Exception):
  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


def backoff(restart: int, base: float) -> float:
  """Seconds to wait before restart number `restart` (1, 2, ...): doubling, capped."""
  return min(base * 2 ** (restart - 1), MAX_BACKOFF)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How one attempt of the job ended: every fact the restart policy decides on.

  Gathered by `launch` from the processes; `decide` then needs no process, no
  clock and no output, so each rule can be tested on its own.

  Attributes:
    codes: every task's exit status when the attempt ended (negative: killed
      by that signal), None for one still running (the launcher stops it).
    ended: the task that ended the attempt (the first to exit, or one still
      running FINISH_GRACE s after the chief finished); None: the job succeeded.
    status: the attempt's status as Job.wait saw it: `ended`'s exit status, or
      1 (CRASH) for a parameter-server worker that exited 0 under a running
      chief or a worker hung after the chief finished.
    gone: parameter-server workers the job already goes on without.
    signal: the signal the launcher itself received, if any; every task has
      then been stopped, `codes` are final and `ended`/`status` are unused.
  """
  codes: Mapping[Task, Optional[int]]
  ended: Optional[Task] = None
  status: int = 0
  gone: FrozenSet[Task] = frozenset()
  signal: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Stop:
  """Stop every task and exit `status`, after saying `reason` ('': nothing to say)."""
  status: int
  reason: str


@dataclasses.dataclass(frozen=True)
class Restart:
  """Say `reason`, wait `delay` s, then start `task` again (None: every task, on fresh ports).

  A whole-job restart stops the tasks still running first; a single task is
  restarted under its running peers (parameter-server jobs only).
  `counted`: it uses up one of --max_restarts (a preemption does not).
  """
  delay: float
  counted: bool
  reason: str
  task: Optional[Task] = None


@dataclasses.dataclass(frozen=True)
class GoOn:
  """A parameter-server job goes on without worker `task` (no restarts left), after `reason`."""
  task: Task
  reason: str


Decision = Union[Stop, Restart, GoOn]


def decide(outcome: Outcome, *, restarts: int, max_restarts: int,
           restart_backoff: float) -> Decision:
  """The restart policy of the module docstring: what the launcher does after an attempt.

  Pure (no processes, no I/O, no clock) so that every rule is unit-tested in
  tests/test_launch.py; `launch` runs the attempt, asks here, and acts.

  Args:
    outcome: how the attempt ended.
    restarts: counted restarts used so far.
    max_restarts: --max_restarts.
    restart_backoff: --restart_backoff, seconds before the first counted restart.

  Returns:
    Stop, Restart or GoOn, with the one line the launcher prints.
  """
  if outcome.signal is not None:  # The launcher's own stop: nothing restarts.
    codes = [c for t, c in outcome.codes.items() if t not in outcome.gone]
    if all(c in (0, status.PREEMPTED) for c in codes) and status.PREEMPTED in codes:
      return Stop(status.PREEMPTED, f"every task saved: exiting with status {status.PREEMPTED} "
                  "(start the same command again to resume)")
    return Stop(128 + outcome.signal, "")
  ended, code = outcome.ended, outcome.status
  if ended is None:
    return Stop(0, f"job succeeded ({count(len(outcome.codes), 'task')})")
  what = f"{ended.label} {describe_status(code)}"
  preempted = code == status.PREEMPTED
  if preempted:  # Name every task that saved, whichever exited first.
    saved = [t.label for t, c in outcome.codes.items() if c == status.PREEMPTED]
    what = f"{', '.join(saved)} {describe_status(code)}"
  if code in NOT_RESTARTED:
    return Stop(code, f"{what} ({NOT_RESTARTED[code]}, see its error line): stopped every task; "
                f"the job failed with status {code}, not restarted: it would fail again")
  ps_job = any(t.type == "ps" for t in outcome.codes)
  ps_worker = ps_job and ended.type == "worker"
  if preempted:  # Nothing failed: at once, and not counted.
    delay, counted, which = 0.0, False, "a preemption restart, not counted in --max_restarts"
  elif restarts >= max_restarts:
    if ps_worker:
      return GoOn(ended, f"{what}: no restarts left (--max_restarts={max_restarts}); the chief "
                  "goes on with the other workers")
    after = f" after {count(max_restarts, 'restart')}" if max_restarts else ""
    return Stop(job_status(code), f"{what}: stopped every task; the job failed with status "
                f"{job_status(code)}{after}")
  else:
    delay, counted = backoff(restarts + 1, restart_backoff), True
    which = f"restart {restarts + 1} of {max_restarts}, in {delay:g} s"
  if ps_worker:
    return Restart(delay, counted, f"{what}: the chief runs its steps on the other workers; "
                   f"starting {ended.label} again ({which})", task=ended)
  if ps_job and ended.type == "chief":
    return Restart(delay, counted, f"{what}: starting the chief again ({which}); the workers "
                   "and ps keep serving, it resumes from the latest checkpoint", task=ended)
  if preempted:
    return Restart(delay, counted, f"{what}: every task saved; restarting the job ({which}), it "
                   "resumes from the saved step")
  return Restart(delay, counted, f"{what}: stopped every task; restarting the job ({which}), it "
                 "resumes from the latest checkpoint")


class Job:
  """Every task of the cluster, started, watched, and stopped together (or one by one)."""

  def __init__(self, cfg: LaunchConfig, attempt: int):
    self.cfg = cfg
    self.attempt = attempt
    self.tasks = cluster_tasks(cfg)
    ports = ([cfg.port_base + i for i in range(len(self.tasks))] if cfg.port_base
             else free_ports(len(self.tasks)))
    self.configs = tf_configs(self.tasks, ports)
    self.procs: Dict[Task, subprocess.Popen] = {}
    self.outputs: Dict[Task, _Output] = {}
    self.all_procs: List[subprocess.Popen] = []  # every process ever started, for cleanup
    self.gone: set = set()  # parameter-server workers left dead (no restarts remained)
    self.stopped = False

  @property
  def ps_job(self) -> bool:
    return self.cfg.num_ps > 0

  def start(self) -> None:
    for task in self.tasks:
      self.start_task(task)

  def start_task(self, task: Task) -> None:
    """Starts (or starts again) one task, with the job's TF_CONFIG for it."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CONFIG=self.configs[task], PYTHONUNBUFFERED="1",
               TFPAR_RESTART=str(self.attempt))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", self.cfg.module, *self.cfg.train_args],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_die_with_parent)
    if task in self.outputs:
      self.outputs[task].join()
    self.procs[task] = proc
    self.all_procs.append(proc)
    self.gone.discard(task)
    self.outputs[task] = _Output(proc, task.label)
    say(f"started {task.label} (pid {proc.pid}) with TF_CONFIG={self.configs[task]}")

  @property
  def chief(self) -> Task:
    return self.tasks[0]  # the chief task, or worker 0 (TF's convention)

  def wait(self) -> Tuple[int, Optional[Task]]:
    """Blocks until the job ends or a task needs a decision; returns (status, that task or None).

    In a parameter-server job a worker that exits is returned too (the job
    goes on without it unless it is started again); a task left `gone` is no
    longer watched.
    """
    chief_done_at = None
    while True:
      codes = {task: proc.poll() for task, proc in self.procs.items() if task not in self.gone}
      chief_code = codes[self.chief]
      if self.ps_job and chief_code is not None:  # the chief: the job
        return chief_code, (self.chief if chief_code else None)
      for task, code in codes.items():
        if code is None:
          continue
        if code == status.PREEMPTED:
          return self._wait_for_preempted_peers(task)
        if code != 0:
          return code, task
        if self.ps_job:
          say(f"{task.label} exited while the chief was still running")
          return status.CRASH, task
      if chief_code == 0:
        if all(code == 0 for code in codes.values()):
          return 0, None
        chief_done_at = chief_done_at or time.monotonic()
        if time.monotonic() - chief_done_at > FINISH_GRACE:
          late = [t.label for t, c in codes.items() if c is None]
          say(f"{', '.join(late)} still running {FINISH_GRACE:.0f} s after the chief finished")
          return 1, next(t for t, c in codes.items() if c is None)
      time.sleep(0.1)

  def _wait_for_preempted_peers(self, first: Task) -> Tuple[int, Task]:
    """A task exited as preempted: its peers are saving the same step; give them the grace period."""
    if self.ps_job:  # Only the chief saves; servers preempted are restarted like failures.
      return status.PREEMPTED, first
    running = [t for t, p in self.procs.items() if p.poll() is None]
    if running:
      say(f"{first.label} was preempted (status {status.PREEMPTED}): waiting up to "
          f"{self.cfg.grace_period:.0f} s for {', '.join(t.label for t in running)} to save")
    deadline = time.monotonic() + self.cfg.grace_period
    for task in running:
      try:
        self.procs[task].wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        say(f"{task.label} did not exit within --grace_period={self.cfg.grace_period:g} s")
    return status.PREEMPTED, first

  def stop(self, grace: float = TERMINATE_GRACE, tasks: Optional[Sequence[Task]] = None) -> None:
    """SIGTERM every task still running (its whole process group), SIGKILL after `grace` s."""
    if self.stopped:
      return
    chosen = self.procs if tasks is None else {t: self.procs[t] for t in tasks}
    running = [(t, p) for t, p in chosen.items() if p.poll() is None]
    for _, proc in running:
      _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for task, proc in running:
      try:
        proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        say(f"{task.label} (pid {proc.pid}) still running {grace:.0f} s after SIGTERM: SIGKILL")
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    if tasks is not None:
      return
    for proc in self.all_procs:
      # Children a task started itself share its process group: none may outlive the job.
      _signal_group(proc, signal.SIGKILL)
      proc.wait()
    for output in self.outputs.values():
      output.join()
    self.stopped = True

  def codes(self) -> Dict[Task, Optional[int]]:
    return {task: proc.poll() for task, proc in self.procs.items()}


def _signal_group(proc: subprocess.Popen, sig) -> None:
  try:
    os.killpg(proc.pid, sig)  # start_new_session: the group id is the task's pid
  except (ProcessLookupError, PermissionError):
    pass


def launch(cfg: LaunchConfig) -> int:
  """Runs the job to its end, restarting it (or one task) as `decide` says.

  Only the processes, the waiting and the printing are here: every decision is
  `decide`'s.
  """
  def on_signal(signum, _frame):
    raise _Stop(signum)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  job, restarts = None, 0
  policy = dict(max_restarts=cfg.max_restarts, restart_backoff=cfg.restart_backoff)
  try:
    job = Job(cfg, attempt=0)
    job.start()
    while True:
      code, ended = job.wait()
      decision = decide(Outcome(job.codes(), ended, code, frozenset(job.gone)),
                        restarts=restarts, **policy)
      if isinstance(decision, GoOn):
        job.gone.add(decision.task)
        say(decision.reason)
        continue
      if isinstance(decision, Stop):
        job.stop()
        say(decision.reason)
        return decision.status
      if decision.counted:
        restarts += 1
      if decision.task is None:
        job.stop()
      say(decision.reason)
      time.sleep(decision.delay)
      if decision.task is not None:
        job.start_task(decision.task)
      else:
        job = Job(cfg, job.attempt + 1)
        job.start()
  except _Stop as stop:
    say(f"received {signal.Signals(stop.signum).name}: stopping every task (up to "
        f"--grace_period={cfg.grace_period:g} s to save)")
    codes, gone = {}, frozenset()
    if job is not None:
      job.stop(grace=cfg.grace_period)
      codes, gone = job.codes(), frozenset(job.gone)
    decision = decide(Outcome(codes, gone=gone, signal=stop.signum), restarts=restarts, **policy)
    if decision.reason:
      say(decision.reason)
    return decision.status
  finally:
    if job is not None:
      job.stop()
    for s, handler in previous.items():
      signal.signal(s, handler)


def main(argv: Sequence[str]) -> int:
  if argv and argv[0] in tool.HELP:
    print(f"usage: {USAGE}\n{__doc__}")
    return 0
  try:
    cfg = parse_args(argv)
  except LaunchError as e:
    return tool.error("launch", str(e))
  return launch(cfg)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
