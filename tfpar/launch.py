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
behaves like a Kubernetes job:

- Multi-worker: the job succeeds when every worker exits 0. When any task
  fails, the others are terminated at once (a peer left in a collective would
  wait for the dead one), and the job fails with that task's status, unless
  `--max_restarts` remain: then every task is started again (on fresh ports,
  unless --port_base fixes them), and training resumes from the latest
  checkpoint in --model_dir. A task that exits with status 2 (tfpar.train's
  "bad input") is not restarted: it would fail again.
- Parameter server: worker and ps tasks are servers for the chief; the job
  ends when the chief (coordinator) exits, with its status, and the servers
  are then terminated. A server that ends before the chief is a task failure
  as above.
- Ctrl-C or SIGTERM to the launcher stops every task; if the launcher itself is
  killed, the kernel kills each task (PR_SET_PDEATHSIG), so no task outlives it.

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
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar import cluster as cluster_lib

USAGE = ("python -m tfpar.launch --num_workers=N [--num_ps=P] [--max_restarts=R] "
         "[--port_base=PORT] -- <tfpar.train flags>")
# Seconds a task gets to exit after SIGTERM before SIGKILL. Short on purpose: a
# multi-worker TF task takes SIGTERM as a preemption notice (its coordination
# service catches it) and goes on waiting for its peers, so SIGTERM alone does
# not end it; and a task whose peer died cannot finish a step or a save anyway.
TERMINATE_GRACE = 5.0
# tfpar.train's status for bad input (flags, data, a model_dir of another
# model): restarting cannot help, as a Kubernetes podFailurePolicy would say.
USAGE_ERROR = 2
# Local tasks are whole TensorFlow processes (~0.5 GB each) sharing one machine's
# cores: 32 is past what a workstation runs usefully; more is a typo.
MAX_LOCAL_TASKS = 32
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
  values = {"num_workers": None, "num_ps": 0, "max_restarts": 0, "port_base": 0}
  for arg in own:
    name, eq, value = arg.partition("=")
    key = name[2:] if name.startswith("--") else None
    if key not in values or not eq:
      raise LaunchError(f"unknown launcher argument {arg!r}: {USAGE}")
    try:
      values[key] = int(value)
    except ValueError:
      raise LaunchError(f"--{key}={value} is not an integer") from None
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
    raise LaunchError(f"--port_base={cfg.port_base} must leave room for {num_tasks} ports "
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
  from tfpar import config as config_lib  # pylint: disable=import-outside-toplevel
  from tfpar import flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  try:
    parsed = tfpar_flags.parse(cfg.train_args)
    strategy = config_lib.from_flags(parsed).dist.strategy
  except absl_flags.Error as e:
    raise LaunchError(f"training flags: {str(e).splitlines()[0]}") from None
  except config_lib.ConfigError as e:
    raise LaunchError(f"training flags: {e}") from None
  try:
    cluster_lib.check_job_shape(strategy, cfg.num_workers, cfg.num_ps)
  except cluster_lib.ClusterError as e:
    raise LaunchError(str(e)) from None


def cluster_tasks(cfg: LaunchConfig) -> List[Task]:
  """The job's tasks in port order: the chief (parameter-server jobs), workers, ps."""
  tasks = [Task("chief", 0)] if cfg.num_ps else []
  tasks += [Task("worker", i) for i in range(cfg.num_workers)]
  tasks += [Task("ps", i) for i in range(cfg.num_ps)]
  return tasks


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


class Job:
  """One attempt: every task started, watched, and stopped together."""

  def __init__(self, cfg: LaunchConfig, attempt: int):
    self.cfg = cfg
    self.attempt = attempt
    self.tasks = cluster_tasks(cfg)
    ports = ([cfg.port_base + i for i in range(len(self.tasks))] if cfg.port_base
             else free_ports(len(self.tasks)))
    self.configs = tf_configs(self.tasks, ports)
    self.procs: Dict[Task, subprocess.Popen] = {}
    self.outputs: Dict[Task, _Output] = {}
    self.stopped = False

  def start(self) -> None:
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for task in self.tasks:
      env = dict(os.environ, TF_CONFIG=self.configs[task], PYTHONUNBUFFERED="1",
                 TFPAR_RESTART=str(self.attempt))
      env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
      proc = subprocess.Popen([sys.executable, "-m", self.cfg.module, *self.cfg.train_args],
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True,
                              preexec_fn=_die_with_parent)
      self.procs[task] = proc
      self.outputs[task] = _Output(proc, task.label)
      say(f"started {task.label} (pid {proc.pid}) with TF_CONFIG={self.configs[task]}")

  @property
  def chief(self) -> Task:
    return self.tasks[0]  # the chief task, or worker 0 (TF's convention)

  def wait(self) -> Tuple[int, Optional[Task]]:
    """Blocks until the job ends; returns (status, the failed task or None)."""
    ps_job = self.cfg.num_ps > 0
    chief_done_at = None
    while True:
      codes = {task: proc.poll() for task, proc in self.procs.items()}
      chief_code = codes[self.chief]
      if ps_job and chief_code is not None:  # the coordinator is the job
        return chief_code, (self.chief if chief_code else None)
      for task, code in codes.items():
        if code is None:
          continue
        if code != 0:
          return code, task
        if ps_job:
          say(f"{task.label} exited while the chief was still running")
          return 1, task
      if chief_code == 0:
        if all(code == 0 for code in codes.values()):
          return 0, None
        chief_done_at = chief_done_at or time.monotonic()
        if time.monotonic() - chief_done_at > FINISH_GRACE:
          late = [t.label for t, c in codes.items() if c is None]
          say(f"{', '.join(late)} still running {FINISH_GRACE:.0f} s after the chief finished")
          return 1, next(t for t, c in codes.items() if c is None)
      time.sleep(0.1)

  def stop(self) -> None:
    """SIGTERM every task still running (its whole process group), SIGKILL after a grace."""
    if self.stopped:
      return
    running = [(t, p) for t, p in self.procs.items() if p.poll() is None]
    for _, proc in running:
      _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE
    for task, proc in running:
      try:
        proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        say(f"{task.label} (pid {proc.pid}) still running {TERMINATE_GRACE:.0f} s after SIGTERM: SIGKILL")
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    for proc in self.procs.values():
      # Children a task started itself share its process group: none may outlive the job.
      _signal_group(proc, signal.SIGKILL)
    for output in self.outputs.values():
      output.join()
    self.stopped = True


def _signal_group(proc: subprocess.Popen, sig) -> None:
  try:
    os.killpg(proc.pid, sig)  # start_new_session: the group id is the task's pid
  except (ProcessLookupError, PermissionError):
    pass


def launch(cfg: LaunchConfig) -> int:
  """Runs the job to its end (restarting it up to cfg.max_restarts times); returns its status."""
  def on_signal(signum, _frame):
    raise _Stop(signum)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  job = None
  try:
    for attempt in range(cfg.max_restarts + 1):
      job = Job(cfg, attempt)
      job.start()
      code, failed = job.wait()
      job.stop()
      if failed is None:
        say(f"job succeeded ({len(job.tasks)} tasks)")
        return 0
      status = job_status(code)
      if code == USAGE_ERROR:
        say(f"{failed.label} {describe_status(code)} (bad input, see its error line): stopped "
            f"every task; the job failed with status {status}, not restarted: it would fail "
            "again")
        return status
      if attempt < cfg.max_restarts:
        say(f"{failed.label} {describe_status(code)}: stopped every task; restarting the job "
            f"(restart {attempt + 1} of {cfg.max_restarts}), it resumes from the latest checkpoint")
        continue
      say(f"{failed.label} {describe_status(code)}: stopped every task; the job failed "
          f"with status {status}" + (f" after {cfg.max_restarts} restarts" if cfg.max_restarts
                                     else ""))
      return status
    return 1  # unreachable: the loop returns
  except _Stop as stop:
    say(f"received {signal.Signals(stop.signum).name}: stopping every task")
    if job is not None:
      job.stop()
    return 128 + stop.signum
  finally:
    if job is not None:
      job.stop()
    for s, handler in previous.items():
      signal.signal(s, handler)


def main(argv: Sequence[str]) -> int:
  if argv and argv[0] in ("-h", "--help"):
    print(f"usage: {USAGE}\n{__doc__}")
    return 0
  try:
    cfg = parse_args(argv)
  except LaunchError as e:
    print(f"tfpar.launch: error: {e}", file=sys.stderr, flush=True)
    return 2
  return launch(cfg)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
