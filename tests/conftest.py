"""Shared test helpers: run tfpar as a real subprocess, read its metrics."""

import concurrent.futures
import getpass
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_file(*path):
  """A file of the repository that is not in a package (scripts/, examples/) as a module."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  name = os.path.splitext(path[-1])[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, *path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
# The one thing beside the checkout a test may read, when present and not
# overridden by TFPAR_K8S_SCHEMAS: the full CRD schemas (tests/test_k8s.py).
OPTIONAL_K8S_SCHEMAS = os.path.join(os.path.dirname(REPO), "shared", "k8s-schemas")


def _beside_repo():
  """The directories beside the checkout, which a user's clone does not have.

  Hidden ones and any holding this Python, its packages, the temp dir or pytest's
  own temp dirs are not counted (a clone in a home directory sits beside ~/.cache,
  one in /tmp beside /tmp/pytest-of-USER); beside a checkout at the filesystem's
  root are the system's own directories, so none is counted.
  """
  parent = os.path.dirname(REPO)
  if parent == os.path.dirname(parent):
    return []
  pytest_temp = os.path.join(tempfile.gettempdir(), f"pytest-of-{getpass.getuser()}")
  needed = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                          tempfile.gettempdir(), pytest_temp, *sys.path) if p]
  beside = []
  for name in os.listdir(parent):
    path = os.path.join(parent, name)
    if (path != REPO and not name.startswith(".") and os.path.isdir(path)
        and not any(n == path or n.startswith(path + os.sep) for n in needed)):
      beside.append(path)
  return beside


BESIDE_REPO = tuple(_beside_repo())
READ_BESIDE_REPO = []  # What this process opened or listed there: must stay empty.


def _audit(event, args):
  if event in ("open", "os.listdir", "os.scandir", "glob.glob") and args:
    path = args[0]
    if isinstance(path, bytes):
      path = os.fsdecode(path)
    if isinstance(path, (str, os.PathLike)):
      path = os.path.abspath(path)
      if (any(path == b or path.startswith(b + os.sep) for b in BESIDE_REPO)
          and not (path + os.sep).startswith(OPTIONAL_K8S_SCHEMAS + os.sep)):
        READ_BESIDE_REPO.append(path)


if BESIDE_REPO:
  sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def reads_nothing_beside_the_repository():
  """A user's clone has nothing beside it: no test (nor tfpar in this process) may read there."""
  yield
  if READ_BESIDE_REPO:
    paths = sorted(set(READ_BESIDE_REPO))
    READ_BESIDE_REPO.clear()
    pytest.fail(f"read beside the repository, which a user's clone does not have: {paths[:5]}")

# A model small enough that a CLI run takes seconds on 2 cores.
TINY = ["--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64", "--seq_len=32",
        "--global_batch_size=8", "--eval_steps=1", "--steps_per_call=1", "--log_every=1",
        "--learning_rate=3e-3", "--warmup_steps=1"]


def run_module(module, args, *, env=None, timeout=600, check=True, preexec_fn=None):
  """Runs `python -m module args` and returns the CompletedProcess (text).

  `preexec_fn` runs in the child before Python starts (e.g. to set a resource limit).
  """
  full_env = dict(os.environ, PYTHONPATH=REPO)
  # tfpar's own default (TensorFlow's C++ start-up lines silenced), not this process's level.
  full_env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  full_env.update(env or {})
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        env=full_env, timeout=timeout, cwd=REPO, preexec_fn=preexec_fn)
  if check and proc.returncode != 0:
    raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}\n"
                         f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
  return proc


def run_modules(calls, *, at_once=2):
  """Runs independent `run_module(module, args, **kwargs)` calls, `at_once` at a time.

  `calls` is a list of (module, args) or (module, args, kwargs); check defaults
  to False. Returns the CompletedProcesses in the order of `calls`. A CLI run
  that ends before training spends its seconds importing TensorFlow, mostly on
  one thread: two such runs side by side keep both cores busy instead of one.
  """
  def one(call):
    module, args, kwargs = (*call, {})[:3]
    return run_module(module, args, **{"check": False, **kwargs})

  with concurrent.futures.ThreadPoolExecutor(max_workers=at_once) as pool:
    return list(pool.map(one, calls))


def run_module_in_background(module, args, **kwargs) -> concurrent.futures.Future:
  """`run_module(module, args, **kwargs)` started now; `.result()` is its CompletedProcess.

  For a module-scoped fixture that starts a CLI run before the in-process tests
  of its file: the child's TensorFlow start (mostly one thread) and the
  in-process tracing (mostly one thread) then share the 2 cores. `.result()`
  raises what run_module raises (a non-zero exit under check=True).
  """
  return in_background(run_module, module, args, **kwargs)


def in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
  """fn(*args, **kwargs) on a thread of its own, started now (for runs of real processes)."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  future = pool.submit(fn, *args, **kwargs)
  pool.shutdown(wait=False)
  return future


def selected_tests_use(request, fixture_name):
  """Does a test of `request`'s module selected in this session request `fixture_name`?

  A module's autouse fixture starts a background run only then (not under a -k that
  leaves its test out).
  """
  return any(fixture_name in item.fixturenames for item in request.session.items
             if item.module is request.module)


def start_module(module, args, *, env=None) -> subprocess.Popen:
  """Starts `python -m module args` (stdout and stderr together, text); the caller waits."""
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  full_env.update(env or {})
  return subprocess.Popen([sys.executable, "-m", module, *args], env=full_env, cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class Watched:
  """`python -m module args` in the background, its stdout read line by line as it comes.

  Tests wait for a line (training has started) before they signal or kill,
  never for a fixed time. stderr is kept apart, or merged into the lines.
  """

  def __init__(self, module, args, *, env=None, merge_stderr=False):
    full_env = dict(os.environ, PYTHONPATH=REPO)
    full_env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # tfpar's own default, as a user gets it
    full_env.update(env or {})
    self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=full_env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                 text=True)
    self.lines, self.stderr_lines, self._queue = [], [], queue.Queue()
    self._readers = [threading.Thread(target=self._read_stdout, daemon=True)]
    if not merge_stderr:
      self._readers.append(threading.Thread(target=self._read_stderr, daemon=True))
    for reader in self._readers:
      reader.start()

  def _read_stdout(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))
      self._queue.put(self.lines[-1])
    self._queue.put(None)

  def _read_stderr(self):
    for line in self.proc.stderr:
      self.stderr_lines.append(line)

  def wait_for(self, pattern, timeout=120):
    """Blocks until a line matches `pattern` and returns the match; kills the process if none."""
    deadline = time.monotonic() + timeout
    while True:
      try:
        line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        line = None
      if line is None:
        self.proc.kill()  # Never left running: it would take the cores from every later test.
        raise AssertionError(f"no line matched {pattern!r}; output:\n{self.output[-4000:]}")
      match = re.search(pattern, line)
      if match:
        return match

  def finish(self, timeout=180):
    """Waits for the exit status (killing the process past `timeout`) and the last lines."""
    try:
      code = self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      raise
    for reader in self._readers:
      reader.join(10)
    return code

  @property
  def output(self):
    return "\n".join(self.lines)

  @property
  def stderr(self):
    return "".join(self.stderr_lines)


def read_metrics(model_dir, kind="train"):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r for r in records if r["kind"] == kind]


# Runs of real processes that start with the session's first test, long before the test
# that reads them: {fixture name: how to start it (module, function name)}.
EARLY = {"bench_run": ("test_bench", "run_bench"),
         "cross_worker_runs": ("test_cross_worker", "run_cross_worker"),
         "stage_worker_faults": ("test_cross_worker", "run_stage_worker_faults")}


class _EarlyRuns(dict):
  """{fixture name: Future} of EARLY runs; one not started yet starts when first asked for."""

  def __init__(self, tmp_path_factory):
    super().__init__()
    self.tmp_path_factory = tmp_path_factory

  def __missing__(self, name):
    module, function = EARLY[name]
    fn = getattr(__import__(module), function)
    self[name] = in_background(fn, self.tmp_path_factory.mktemp(name))
    return self[name]


@pytest.fixture(scope="session", autouse=True)
def early_runs(request, tmp_path_factory):
  """{fixture name: Future} of the EARLY runs some selected test uses, started now.

  scripts/bench.py's smoke run trains two systems in processes of its own; it
  runs beside the tests before its file instead of after them. Under pytest-xdist
  (`-n 2 --dist loadfile`: README's command) a worker does not know which files it
  will be given, so each run starts when its file first asks for it, in the worker
  that runs that file.
  """
  started = _EarlyRuns(tmp_path_factory)
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    for name in EARLY:
      if any(name in item.fixturenames for item in request.session.items):
        started[name]  # pylint: disable=pointless-statement  # Starts it.
  return started


@pytest.fixture(autouse=True)
def float32_policy():
  """Every test starts under Keras' float32 policy, whatever an in-process run before it set."""
  import keras  # pylint: disable=import-outside-toplevel
  keras.mixed_precision.set_global_policy("float32")
  yield


@pytest.fixture
def tiny():
  return list(TINY)


XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"


def pytest_configure(config):
  """Splits the CPU into 8 logical devices once, before TensorFlow starts in this process.

  In-process tests then run any plan up to 8 devices (tfpar uses the first
  --num_cpu_devices of them) without paying a TensorFlow start per test.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # XLA compiles the tests' steps with LLVM's optimisations off, in this process and in every
  # tfpar process a test starts (they inherit the environment): the same HLO and XLA passes,
  # compiled in about half the CPU time, which on tiny models is most of a run's
  # (docs/benchmarks.md, "The suite"). Twins compare XLA runs under the same flags.
  if XLA_TEST_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()
  if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
    return  # pytest-xdist's controller: its workers run the tests.
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)


def make_config(args):
  """A validated Config from '--name=value' strings, as the CLI would build it."""
  from tfpar.config import config, flags  # pylint: disable=import-outside-toplevel
  return config.from_flags(flags.parse(args))


def train_in_process(args):
  """Runs a whole training job in this process (no TF_CONFIG), checked as the CLI checks it.

  Returns its last records.
  """
  from tfpar import runner  # pylint: disable=import-outside-toplevel
  from tfpar.config import rundir  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  cfg = make_config(args)
  rundir.check_run(cfg, Cluster())
  return runner.run(cfg, Cluster())


def build_engine(args, tokens=None, eval_tokens=512):
  """The engine the runner would build for these flags, on `tokens` (default a small
  synthetic corpus), its first `eval_tokens` the held-out split."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tfpar import engines, strategies  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  from tfpar.data.pipeline import Corpus  # pylint: disable=import-outside-toplevel
  cfg = make_config(args)
  tokens = np.arange(4096, dtype=np.uint8) if tokens is None else tokens
  corpus = Corpus(train=tokens, eval=tokens[:eval_tokens], files=())
  return engines.make(cfg, strategies.make_strategy(cfg.dist, Cluster()), corpus)


def train_twin(engine, steps):
  """Trains a built engine `steps` steps (one, then the rest in one call: the same batches, one
  traced function) and returns what a serial twin compares (`assert_twin`): the initial
  weights, the first gradient in full (AdamW's first moment after one step is
  (1 - beta_1) g), the loss and gradient norm per step, the final weights and slots."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tfpar.engines.model_parallel import ModelParallelEngine  # pylint: disable=import-outside-toplevel
  from tfpar.training.checkpoint import model_layout, read_canonical  # pylint: disable=import-outside-toplevel
  split = isinstance(engine, ModelParallelEngine)
  model = engine.copies[0].model if split else engine.model
  # A ZeRO engine's slots are its shards, which its own layout reads (tfpar.parallel.zero).
  sharded = split or getattr(engine, "zero", None) is not None
  layout = engine.layouts[0] if sharded else model_layout(model, engine.optimizer)
  # The weights through the engine's own layout (zero3's template holds no values).
  initial = read_canonical({name: layout[name] for name in model_layout(model)})
  iterator = engine.train_iterator(0)
  first = engine.train(iterator, 1)
  grads = {n[:-2]: v for n, v in read_canonical(layout).items() if n.endswith("@m")}
  rest = engine.train(iterator, steps - 1)
  return dict(engine=engine, model=model, initial=initial, grads=grads,
              losses=np.concatenate([first[0], rest[0]]),
              norms=np.concatenate([first[1], rest[1]]), final=read_canonical(layout))


def assert_twin(run, want):
  """`train_twin` records alike: the same start, losses and norms per step at 1e-5, the first
  gradient and the final weights and slots at 1e-5 (near zero, 1e-5 of the largest of the
  kind)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  for name, value in want["initial"].items():  # Every plan starts from one device's weights.
    np.testing.assert_array_equal(run["initial"][name], value, err_msg=name)
  assert np.all(np.isfinite(want["losses"])) and want["losses"][-1] < want["losses"][0]
  np.testing.assert_allclose(run["losses"], want["losses"], rtol=1e-5)
  np.testing.assert_allclose(run["norms"], want["norms"], rtol=1e-5)
  assert sorted(run["grads"]) == sorted(want["grads"])
  scale = max(np.abs(g).max() for g in want["grads"].values())
  assert scale > 0
  for name, value in want["grads"].items():
    np.testing.assert_allclose(run["grads"][name], value, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=name)
  assert_same_state(run["final"], want["final"], "final state",
                    skip=("compression/", "dropout_rng/"))


def canonical_grads(model, grads):
  """{canonical name: full gradient} of `model`'s trainable variables (shards concatenated
  along their partitioning rule's axis): what a twin compares with one device's."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.training.checkpoint import model_layout  # pylint: disable=import-outside-toplevel
  by_var = {id(v): tf.convert_to_tensor(g) for v, g in zip(model.trainable_variables, grads)}
  return {name: np.concatenate([np.asarray(by_var[id(v)]) for v in shards], axis=axis or 0)
          for name, (axis, shards) in model_layout(model).items() if id(shards[0]) in by_var}


def assert_same_state(got, want, what, skip=()):
  """At 1e-5 relative; near zero, 1e-5 of the largest value of the kind (weights, m or v): the
  key bias's gradient is 0 in exact arithmetic (softmax ignores it) and ~1e-15 in float32.
  Names starting with `skip` (e.g. dropout RNG states, which differ by design) are left out."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  got = {n: v for n, v in got.items() if not n.startswith(skip)}
  want = {n: v for n, v in want.items() if not n.startswith(skip)}
  assert sorted(got) == sorted(want), what
  kind = lambda name: name[-2:] if name[-2:] in ("@m", "@v") else ""
  scale = {}
  for name, value in want.items():
    scale[kind(name)] = max(scale.get(kind(name), 0.0), float(np.max(np.abs(value))))
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * scale[kind(name)],
                               err_msg=f"{what}: {name}")
