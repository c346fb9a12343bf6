"""Training throughput, each system in its own fresh process, rounds alternated.

    python scripts/bench.py --rounds=3 --out=bench.json
    python scripts/bench.py --sections=data_parallel --steps=12 --rounds=1 --out=bench_dp.json

The data_parallel section (mirrored and multi_worker_mirrored against one
device, per gradient compression; whole CLI jobs, some of two processes) is
scripts/bench_dp.py, which says how it measures; the rest of this docstring
is about the other sections.

runs these sections (`--sections`), each a table:

  * peer: tfpar beside keras-hub on the same GPT (4 layers, d_model 256, 4
    heads, d_ff 1024, seq 256, batch 16, byte vocabulary of 256, learned
    positions, output logits through the tied token embedding, no dropout)
    with the same AdamW (warmup + cosine, weight decay 0.1 on matrices and
    embeddings, global-norm clip 1.0) on the same packed byte windows of
    tfpar's embedded corpus. tfpar runs its real code path
    (`DataParallelEngine` on `one_device`, its own tf.data pipeline,
    `--steps_per_call` steps per tf.function call); keras-hub runs
    `GPT2Backbone` + `token_embedding(h, reverse=True)` (the tied head
    GPT2CausalLM uses) under `model.fit(jit_compile=True)`. With
    `--precision=float32,mixed_bfloat16` each precision gets its own rows,
    both systems under the same Keras policy.
  * variants: tfpar on the peer section's shapes as it is, with
    --fused_projections (one Q/K/V matmul per shard) and with
    --causal_attention=online_softmax (query and key blocks, a running
    softmax): each change's own gain against tfpar as it is.
  * model_parallel: tfpar on configs/gpt_tiny.flags' shapes (4 layers,
    d_model 128, seq 128, batch 16) on one device, as a 2-stage x 4
    micro-batch pipeline and 2-way tensor parallel on 2 logical CPUs, and as
    the same pipeline across 2 worker processes (`pipeline_across`: the child
    is worker 0 and starts worker 1, each running its own stage's program;
    activations cross by collective send/recv on loopback), all under GPipe,
    and both pipelines under 1F1B (`pipeline_1f1b`, `pipeline_across_1f1b`). The
    logical devices and local workers share the same cores, so the ratio to
    one_device measures the overhead of splitting, not a speed-up:

      python scripts/bench.py --sections=model_parallel \\
        --systems=one_device,pipeline,pipeline_across --rounds=3
  * precision (only when named): tfpar on the peer shapes as it is (its
    --jit_compile default: off under mixed_bfloat16) and with XLA on and off
    explicitly, per --precision; scripts/bf16.py's step table runs its systems.

Every measurement is a child process (`bench.py --only=SYSTEM`, which prints
one JSON line) that builds its system, runs `--warmup` untimed steps (the
first compiles), times `--steps` steps, and measures the matmul peak (the
best of several XLA-compiled 2048x2048 float32 matmuls) before and after, in
that same process. The parent starts the children one after another,
alternating the systems for `--rounds` rounds, so a drift in machine load
hits every system alike, and records the 1-minute load average around each
child. A user runs one trainer per process: a system sharing its process
with another runs at a different speed, so none ever does here.

Reported per system: median and best tokens/s over the rounds, the spread
((max - min) / median), the ratio of medians to the section's reference
system, and MFU: achieved FLOP/s over the same process's peak (median over
rounds), twice. Model FLOPs per token are 6N + 12*L*d*T (Kaplan et al. 2020 /
PaLM appendix B), N counting every trainable parameter including both
embedding tables, the same rule for every system: the conventional count,
which charges causal attention the whole T x T square. Executed FLOPs count
the attention a system really computes: 6N + 12*L*d*T*f, f the share of the
square it computes (tfpar's blocked causal attention: (n + 1)/(2n) with n
query blocks, 10/16 at T = 256; keras-hub computes the whole square, f = 1).
"MFU" in the tables is the model-FLOPs one; "executed MFU" says how busy the
hardware was. Numbers are only meaningful on an otherwise idle machine: the
load column says how idle it was.
"""

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from absl import app, flags  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", ["peer", "variants", "model_parallel"],
                  "Tables to measure, in order.")
flags.DEFINE_list("systems", None, "Only these systems of the chosen sections (default: all).")
flags.DEFINE_integer("rounds", 3, "Processes per system, alternated between the systems.")
flags.DEFINE_integer("steps", 20, "Timed training steps in each process.")
flags.DEFINE_integer("warmup", 10, "Untimed steps first (the first one compiles).")
flags.DEFINE_list("precision", ["float32"],
                  "Keras precision policies to measure the peer section under "
                  "(float32, mixed_bfloat16); each gets its own rows.")
flags.DEFINE_bool("quick", False, "Tiny shapes and a small matmul: a smoke test, not a benchmark.")
flags.DEFINE_integer("steps_per_call", 10, "tfpar's --steps_per_call.")
flags.DEFINE_integer("steps_per_execution", 1, "keras-hub's compile(steps_per_execution=...).")
flags.DEFINE_string("out", None, "Also write every run and the tables here as JSON.")
flags.DEFINE_bool("peer", False, "Child mode, with --only: worker 1 of a job of one program "
                  "per worker (AcrossWorkersSystem), running the steps worker 0 times.")
flags.DEFINE_string("only", None, "Child mode: measure this one system in this process and "
                    "print its result as one JSON line.")

VOCAB = 256
MATMUL = 2048
# The shapes of each section, and tiny ones for --quick.
PEER = dict(num_layers=4, d_model=256, num_heads=4, d_ff=1024, seq_len=256, batch=16)
TINY = dict(num_layers=4, d_model=128, num_heads=4, d_ff=512, seq_len=128, batch=16)
QUICK = dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, seq_len=32, batch=8)
QUICK_MATMUL = 256
RESULT = "BENCH_RESULT "  # Prefix of the child's JSON line.


# --- what one child process measures ------------------------------------------------


def matmul_peak(n: int, repeats: int = 10) -> float:
  """Best FLOP/s of an XLA-compiled n x n float32 matmul, in this process."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  a = tf.random.normal([n, n], seed=1)
  b = tf.random.normal([n, n], seed=2)
  matmul = tf.function(tf.matmul, jit_compile=True)
  matmul(a, b).numpy()  # Compile.
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).numpy()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def flops_per_token(params: int, shape: dict, attention_share: float = 1.0) -> float:
  """6N + 12 L d T: model FLOPs (attention_share 1), or executed ones (the share of the
  causal attention square a system computes)."""
  return 6 * params + 12 * shape["num_layers"] * shape["d_model"] * shape["seq_len"] * \
      attention_share


def tfpar_args(shape: dict, precision: str, total_steps: int, extra_flags: List[str],
               model_dir: str) -> List[str]:
  """tfpar.train's flags for a system of this section's shapes."""
  return [f"--model_dir={model_dir}", f"--precision={precision}",
          f"--num_layers={shape['num_layers']}", f"--d_model={shape['d_model']}",
          f"--num_heads={shape['num_heads']}", f"--d_ff={shape['d_ff']}",
          f"--seq_len={shape['seq_len']}", f"--global_batch_size={shape['batch']}",
          f"--train_steps={total_steps}", f"--steps_per_call={FLAGS.steps_per_call}",
          "--dropout=0", "--positions=learned"] + extra_flags


class TfparSystem:
  """tfpar's own engine for these flags (as tfpar.runner builds it), fed by its own pipeline.

  Under TF_CONFIG, with stages on other workers (tfpar.config.rules.stages_across_workers),
  this process runs its own stages (tfpar.engines.stage_worker), as the runner does.
  """

  def __init__(self, shape: dict, precision: str, total_steps: int, extra_flags: List[str],
               model_dir: Optional[str] = None):
    from tfpar.config import config  # pylint: disable=import-outside-toplevel
    from tfpar import console, strategies  # pylint: disable=import-outside-toplevel
    from tfpar.config import flags as tfpar_flags  # pylint: disable=import-outside-toplevel

    self.model_dir = model_dir or tempfile.mkdtemp(prefix="tfpar_bench_")
    cfg = config.from_flags(tfpar_flags.parse(
        tfpar_args(shape, precision, total_steps, extra_flags, self.model_dir)))
    strategies.setup_devices(cfg.dist.num_cpu_devices)  # Before TensorFlow starts.
    console.set_xla_auto_clustering(cfg.train.xla_auto_clustering)  # Before XLA reads its flags.
    import keras  # pylint: disable=import-outside-toplevel
    from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
    from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
    from tfpar import engines  # pylint: disable=import-outside-toplevel
    from tfpar.layers import attention  # pylint: disable=import-outside-toplevel
    from tfpar.config.cluster import from_env  # pylint: disable=import-outside-toplevel

    keras.mixed_precision.set_global_policy(precision)
    cluster = from_env() if os.environ.get("TF_CONFIG") else Cluster()
    strategy = strategies.make_strategy(cfg.dist, cluster)
    corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                  eval_fraction=cfg.data.eval_fraction)
    self.engine = engines.make(cfg, strategy, corpus)
    self.iterator = self.engine.train_iterator(0)
    self.steps_per_call = cfg.train.steps_per_call
    self.params = int(self.engine.describe()["parameters"])
    self.attention_share = attention.causal_fraction(cfg.model.seq_len)
    self.last_loss = float("nan")

  def run(self, steps: int) -> float:
    """Trains `steps` steps; returns the seconds they took."""
    start = time.perf_counter()
    while steps > 0:
      k = min(self.steps_per_call, steps)
      losses, _ = self.engine.train(self.iterator, k)  # numpy: the steps have finished.
      steps -= k
    self.last_loss = float(losses[-1])
    return time.perf_counter() - start

  def close(self) -> None:
    shutil.rmtree(self.model_dir, ignore_errors=True)


class AcrossWorkersSystem(TfparSystem):
  """TfparSystem as worker 0 of a 2-worker job on free loopback ports. Worker 1 is started
  here: this child again (`--peer`), running the same steps as worker 1, each worker its own
  program (tfpar.engines.stage_worker). (`--peer` itself: the plain TfparSystem of worker 1.)"""

  def __init__(self, shape: dict, precision: str, total_steps: int, extra_flags: List[str]):
    if FLAGS.peer:
      super().__init__(shape, precision, total_steps, extra_flags)
      return
    from tfpar.cli import launch  # pylint: disable=import-outside-toplevel
    from tfpar.config import cluster  # pylint: disable=import-outside-toplevel
    spec = {"worker": [f"127.0.0.1:{port}" for port in launch.free_ports(2)]}
    model_dir = tempfile.mkdtemp(prefix="tfpar_bench_")
    self.server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--peer"],
        env=dict(os.environ, TF_CONFIG=cluster.tf_config(spec, "worker", 1), PYTHONPATH=REPO),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    os.environ["TF_CONFIG"] = cluster.tf_config(spec, "worker", 0)
    super().__init__(shape, precision, total_steps, extra_flags, model_dir)

  def close(self) -> None:
    if not FLAGS.peer:
      self.server.kill()
      self.server.wait()
    super().close()


class KerasHubSystem:
  """keras-hub GPT2Backbone with its tied reverse-embedding head, model.fit(jit_compile=True);
  or, with `jit_compile=False`, model.fit without XLA under tfpar's --xla_auto_clustering
  (tfpar's mixed_bfloat16 default, given to keras-hub alike)."""

  def __init__(self, shape: dict, precision: str, total_steps: int, jit_compile: bool = True):
    from tfpar import console  # pylint: disable=import-outside-toplevel
    if not jit_compile:
      console.set_xla_auto_clustering("fusible")  # Before XLA reads its flags.
    import keras  # pylint: disable=import-outside-toplevel
    import keras_hub  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.config import schema  # pylint: disable=import-outside-toplevel
    from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
    from tfpar.training import optimizer as tfpar_optimizer  # pylint: disable=import-outside-toplevel

    keras.mixed_precision.set_global_policy(precision)  # The same policy tfpar runs under.
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=shape["num_layers"], num_heads=shape["num_heads"],
        hidden_dim=shape["d_model"], intermediate_dim=shape["d_ff"], dropout=0.0,
        max_sequence_length=shape["seq_len"])
    logits = backbone.token_embedding(backbone.output, reverse=True)  # Tied, as GPT2CausalLM.
    self.model = keras.Model(backbone.input, logits)
    # The same AdamW settings as tfpar's defaults (keras' own class: no tfpar override).
    optim = schema.OptimConfig()
    opt = keras.optimizers.AdamW(
        learning_rate=tfpar_optimizer.learning_rate_schedule(optim, total_steps),
        weight_decay=optim.weight_decay, beta_1=0.9, beta_2=0.95, epsilon=1e-8,
        global_clipnorm=optim.clip_norm)
    opt.exclude_from_weight_decay(var_names=tfpar_optimizer.NO_DECAY)
    self.spe = FLAGS.steps_per_execution
    self.model.compile(optimizer=opt,
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       jit_compile=jit_compile, steps_per_execution=self.spe)
    corpus = pipeline.load_corpus(None, seq_len=shape["seq_len"], eval_fraction=0.05)
    windows = pipeline.window_dataset(corpus.train, shape["seq_len"],
                                      pipeline.Shard(shape["batch"]), seed=0)
    self.data = windows.map(lambda x, y: ({"token_ids": x, "padding_mask": tf.ones_like(x)}, y))
    self.params = int(sum(v.numpy().size for v in self.model.trainable_variables))
    self.attention_share = 1.0  # The whole masked T x T square.
    self.last_loss = float("nan")

  def run(self, steps: int) -> float:
    """One model.fit of one untimed execution + `steps` steps; returns the steps' seconds."""
    import keras  # pylint: disable=import-outside-toplevel

    ends = []

    class StepEnds(keras.callbacks.Callback):
      def on_train_batch_end(self, batch, logs=None):
        ends.append((time.perf_counter(), float(logs["loss"])))  # float(): the step finished.

    executions = -(-steps // self.spe)  # Whole executions of steps_per_execution steps.
    self.model.fit(self.data, epochs=1, steps_per_epoch=(executions + 1) * self.spe, verbose=0,
                   shuffle=False, callbacks=[StepEnds()])
    # Timed from the end of the first (untimed) execution: fit's own start-up is excluded.
    self.last_loss = ends[-1][1]
    return (ends[-1][0] - ends[0][0]) * steps / (executions * self.spe)

  def close(self) -> None:
    """Nothing outlives the process."""


# --- sections: which systems, on which shapes, against which reference --------------


@dataclasses.dataclass(frozen=True)
class System:
  """One row of a table: a label and how a child process builds it."""
  label: str
  build: Callable[[dict, str, int], object]  # (shape, precision, total_steps) -> a system
  env: Optional[Dict[str, str]] = None  # Added to the child's environment (and its peer's).


@dataclasses.dataclass(frozen=True)
class Section:
  """One table: its systems (in the order rounds alternate them) on one set of shapes."""
  title: str
  shape: dict
  systems: Dict[str, System]
  reference: str  # The system the ratios divide by.
  precisions: Optional[List[str]] = None  # None: float32 only.


def _tfpar(*extra_flags):
  return lambda shape, precision, steps: TfparSystem(shape, precision, steps, list(extra_flags))


def _across(*extra_flags):
  return lambda shape, precision, steps: AcrossWorkersSystem(shape, precision, steps,
                                                             list(extra_flags))


def _kerashub(shape, precision, steps):
  return KerasHubSystem(shape, precision, steps)


PIPELINE = ["--num_cpu_devices=2", "--pipeline_stages=2", "--microbatches=4"]
# The same pipeline with each stage in its own worker process (tfpar.engines.stage_worker).
ACROSS = ["--strategy=multi_worker_mirrored", "--pipeline_stages=2", "--microbatches=4"]
TENSOR = ["--num_cpu_devices=2", "--tensor_parallel=2"]
ONE_F_ONE_B = "--pipeline_schedule=1f1b"  # Both pipelines' default is GPipe.

# Whole CLI jobs (two of its configurations are two processes each), measured by
# scripts/bench_dp.py rather than as SECTIONS systems.
DATA_PARALLEL = "data_parallel"
# tfpar as it is: the peer section's contender and the other peer-shape sections' reference.
AS_IS = System("tfpar (one_device, steps_per_call=10)", _tfpar("--strategy=one_device"))
KERASHUB = System("keras-hub GPT2Backbone (model.fit, jit_compile=True)", _kerashub)

SECTIONS = {
    "peer": Section(
        title="tfpar beside keras-hub (same model, same AdamW, same data)",
        shape=PEER, reference="kerashub", precisions=["float32", "mixed_bfloat16"],
        systems={
            "tfpar": AS_IS,
            "kerashub": KERASHUB,
        }),
    "variants": Section(
        title="tfpar's own changes, each against tfpar as it is (peer shapes)",
        shape=PEER, reference="tfpar", precisions=["float32", "mixed_bfloat16"],
        systems={
            "tfpar": AS_IS,
            "tfpar_fused": System("tfpar --fused_projections",
                                  _tfpar("--strategy=one_device", "--fused_projections")),
            "tfpar_online_softmax": System(
                "tfpar --causal_attention=online_softmax",
                _tfpar("--strategy=one_device", "--causal_attention=online_softmax")),
        }),
    "precision": Section(  # Not a default section: scripts/bf16.py's step table runs it.
        title="tfpar with and without XLA under each precision (peer shapes)",
        shape=PEER, reference="tfpar", precisions=["float32", "mixed_bfloat16"],
        systems={
            "tfpar": AS_IS,
            "tfpar_xla": System("tfpar --jit_compile",
                                _tfpar("--strategy=one_device", "--jit_compile=true")),
            "tfpar_noxla": System("tfpar --nojit_compile (bf16: XLA auto-clustering of the "
                                  "fusible ops, the default)",
                                  _tfpar("--strategy=one_device", "--jit_compile=false")),
            "kerashub": KERASHUB,
            "kerashub_fusible": System(
                "keras-hub GPT2Backbone (model.fit, jit_compile=False, XLA auto-clustering of "
                "the fusible ops as tfpar's bf16 default)",
                lambda shape, precision, steps: KerasHubSystem(shape, precision, steps,
                                                               jit_compile=False)),
            "tfpar_onednn": System("tfpar --nojit_compile --xla_auto_clustering=none "
                                   "(TensorFlow's kernels only)",
                                   _tfpar("--strategy=one_device", "--jit_compile=false",
                                          "--xla_auto_clustering=none")),
        }),
    "model_parallel": Section(
        title="model-parallel overhead on 2 logical CPUs of the same cores (gpt_tiny shapes)",
        shape=TINY, reference="one_device",
        systems={
            "one_device": System("one_device", _tfpar("--strategy=one_device")),
            "pipeline": System("pipeline 2 stages x 4 micro-batches", _tfpar(*PIPELINE)),
            "pipeline_across": System("pipeline 2 x 4, one stage per worker process",
                                      _across(*ACROSS)),
            "pipeline_1f1b": System("pipeline 2 x 4, 1F1B", _tfpar(*PIPELINE, ONE_F_ONE_B)),
            "pipeline_across_1f1b": System("pipeline 2 x 4, 1F1B, one stage per worker process",
                                           _across(*ACROSS, ONE_F_ONE_B)),
            "pipeline_across_split": System(
                "pipeline 2 x 4 across 2 worker processes, 1 intra-op thread each",
                _across(*ACROSS), env={"TF_NUM_INTRAOP_THREADS": "1"}),
            "tensor": System("tensor parallel 2", _tfpar(*TENSOR)),
            "one_device_noxla": System("one_device, --nojit_compile",
                                       _tfpar("--strategy=one_device", "--jit_compile=false")),
            "pipeline_noxla": System("pipeline 2 x 4, --nojit_compile",
                                     _tfpar(*PIPELINE, "--jit_compile=false")),
            "pipeline_across_noxla": System("pipeline 2 x 4 across 2 workers, --nojit_compile",
                                            _across(*ACROSS, "--jit_compile=false")),
            "tensor_noxla": System("tensor parallel 2, --nojit_compile",
                                   _tfpar(*TENSOR, "--jit_compile=false")),
        }),
}


def _find(name: str):
  """The first section holding system `name` (tfpar, in two, is built alike in both)."""
  for section_name, section in SECTIONS.items():
    if name in section.systems:
      return section_name, section
  raise app.UsageError(f"--only={name}: unknown system; known: "
                       f"{', '.join(n for s in SECTIONS.values() for n in s.systems)}")


def measure(name: str, precision: str) -> dict:
  """Child: builds system `name`, warms it up, times it, measures the peak around the timing."""
  _, section = _find(name)
  shape = QUICK if FLAGS.quick else section.shape
  total = FLAGS.warmup + FLAGS.steps + 1
  system = section.systems[name].build(shape, precision, total)
  if FLAGS.peer:  # Worker 1 of a job whose worker 0 measures: the same steps, untimed.
    try:
      system.run(FLAGS.warmup)
      system.run(FLAGS.steps)
    finally:
      system.close()
    return {"system": name, "peer": True}
  try:
    system.run(FLAGS.warmup)  # Compiles, then runs a few steps untimed.
    n = QUICK_MATMUL if FLAGS.quick else MATMUL
    peak_before = matmul_peak(n)
    seconds = system.run(FLAGS.steps)
    peak_after = matmul_peak(n)
  finally:
    system.close()
  tokens = shape["batch"] * shape["seq_len"] * FLAGS.steps
  fpt = flops_per_token(system.params, shape)
  executed = flops_per_token(system.params, shape, system.attention_share)
  peak = max(peak_before, peak_after)
  return {"system": name, "precision": precision, "pid": os.getpid(), "params": system.params,
          "flops_per_token": fpt, "steps": FLAGS.steps, "seconds": seconds,
          "tokens_per_sec": tokens / seconds, "step_ms": 1000 * seconds / FLAGS.steps,
          "peak_gflops": peak / 1e9, "peaks_gflops": [peak_before / 1e9, peak_after / 1e9],
          "mfu": tokens / seconds * fpt / peak, "executed_flops_per_token": executed,
          "executed_mfu": tokens / seconds * executed / peak, "last_loss": system.last_loss}


# --- the parent: alternate children, then tables --------------------------------------


def run_script(args: List[str], env: Optional[Dict[str, str]] = None) -> dict:
  """Runs `python ARGS` in a fresh process (the repo on its path, `env` added to its
  environment); returns its last RESULT line's JSON and the 1-minute load average around it."""
  env = dict(os.environ, **(env or {}))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  load_before = os.getloadavg()[0]
  proc = subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env,
                        check=False)
  load_after = os.getloadavg()[0]
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode != 0 or not lines:
    raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  result = json.loads(lines[-1][len(RESULT):])
  result["load_1min"] = [load_before, load_after]
  return result


def run_child(name: str, precision: str, env: Optional[Dict[str, str]] = None) -> dict:
  """Runs `bench.py --only=name` in a fresh process; returns its result and the load around it."""
  return run_script(
      [os.path.abspath(__file__), f"--only={name}", f"--precision={precision}",
       f"--steps={FLAGS.steps}", f"--warmup={FLAGS.warmup}",
       f"--steps_per_call={FLAGS.steps_per_call}",
       f"--steps_per_execution={FLAGS.steps_per_execution}"] +
      (["--quick"] if FLAGS.quick else []), env)


def summarise(runs: List[dict], section: Section, shape: dict) -> List[dict]:
  """One row per (system, precision): median/best tokens/s, spread, ratio of medians, MFU."""
  rows = []
  for precision in dict.fromkeys(r["precision"] for r in runs):
    for name, system in section.systems.items():
      mine = [r for r in runs if r["system"] == name and r["precision"] == precision]
      if not mine:
        continue
      tps = [r["tokens_per_sec"] for r in mine]
      med = statistics.median(tps)
      loads = [x for r in mine for x in r["load_1min"]]
      rows.append({
          "system": name, "label": system.label, "precision": precision, "rounds": len(mine),
          "tokens_per_sec_median": med, "tokens_per_sec_best": max(tps),
          "tokens_per_sec": tps, "spread": (max(tps) - min(tps)) / med,
          "step_ms_median": 1000 * shape["batch"] * shape["seq_len"] / med,
          "mfu_median": statistics.median(r["mfu"] for r in mine),
          "executed_mfu_median": statistics.median(r["executed_mfu"] for r in mine),
          "peak_gflops_median": statistics.median(r["peak_gflops"] for r in mine),
          "params": mine[0]["params"], "load_1min": [min(loads), max(loads)]})
    ref = [r for r in rows if r["system"] == section.reference and r["precision"] == precision]
    for r in rows:
      if ref and r["precision"] == precision:
        r["vs_reference"] = r["tokens_per_sec_median"] / ref[0]["tokens_per_sec_median"]
  return rows


def table(rows: List[dict], reference: str) -> str:
  lines = [f"| system | precision | tokens/s median | best | spread | step ms | MFU "
           f"| executed MFU | vs {reference} | load 1 min |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    ratio = f"{r['vs_reference']:.2f}x" if "vs_reference" in r else "-"
    lines.append(
        f"| {r['label']} | {r['precision']} | {r['tokens_per_sec_median']:,.0f} | "
        f"{r['tokens_per_sec_best']:,.0f} | {100 * r['spread']:.1f}% | {r['step_ms_median']:.1f} "
        f"| {100 * r['mfu_median']:.1f}% | {100 * r['executed_mfu_median']:.1f}% | {ratio} | "
        f"{r['load_1min'][0]:.2f}-{r['load_1min'][1]:.2f} |")
  return "\n".join(lines)


def run_section(name: str) -> dict:
  """Alternates the section's children for --rounds rounds; prints and returns its table."""
  section = SECTIONS[name]
  shape = QUICK if FLAGS.quick else section.shape
  names = [n for n in section.systems if FLAGS.systems is None or n in FLAGS.systems]
  if not names:
    return {}
  precisions = [p for p in FLAGS.precision if p in (section.precisions or ["float32"])]
  runs = []
  for i in range(FLAGS.rounds):
    for precision in precisions:
      for system in names:  # Alternated, so load drift hits every system alike.
        runs.append(run_child(system, precision, section.systems[system].env))
        r = runs[-1]
        print(f"  round {i + 1}: {system} {precision}: {r['tokens_per_sec']:,.0f} tokens/s, "
              f"peak {r['peak_gflops']:.0f} GFLOP/s, load {r['load_1min'][0]:.2f}"
              f"->{r['load_1min'][1]:.2f}", flush=True)
  rows = summarise(runs, section, shape)
  print(f"\n## {section.title}\nshapes {shape}, vocab {VOCAB}; {FLAGS.warmup} warmup steps, "
        f"then {FLAGS.steps} timed steps in each of {FLAGS.rounds} processes per system, "
        "alternated; MFU (model FLOPs) and executed MFU (the attention really computed) "
        "against the matmul peak measured in the same process")
  for r in rows:
    print(f"{r['system']} {r['precision']}: N = {r['params']:,} parameters, "
          f"peak {r['peak_gflops_median']:.0f} GFLOP/s (median), tokens/s per round "
          f"{', '.join(f'{t:,.0f}' for t in r['tokens_per_sec'])}")
  print()
  print(table(rows, section.reference), flush=True)
  return {"title": section.title, "shape": shape, "reference": section.reference,
          "rows": rows, "runs": runs}


def main(argv):
  del argv
  if FLAGS.warmup < 1:
    raise app.UsageError("--warmup must be at least 1 (the first step compiles)")
  if FLAGS.only:
    if len(FLAGS.precision) != 1:
      raise app.UsageError("--only measures one --precision")
    print(RESULT + json.dumps(measure(FLAGS.only, FLAGS.precision[0])), flush=True)
    return
  unknown = [s for s in FLAGS.sections if s not in SECTIONS and s != DATA_PARALLEL]
  if unknown:
    raise app.UsageError(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
  report = {"command": " ".join(["python"] + sys.argv), "vocab": VOCAB,
            "warmup": FLAGS.warmup, "steps": FLAGS.steps, "rounds": FLAGS.rounds,
            "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "sections": {}}
  for name in FLAGS.sections:
    if name == DATA_PARALLEL:
      import bench_dp  # pylint: disable=import-outside-toplevel
      png = os.path.splitext(FLAGS.out)[0] + "_data_parallel.png" if FLAGS.out else None
      report["sections"][name] = bench_dp.run(
          steps=FLAGS.steps, rounds=FLAGS.rounds, log_every=max(1, FLAGS.steps // 6),
          quick=FLAGS.quick, only=FLAGS.systems, png=png)
    else:
      report["sections"][name] = run_section(name)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  app.run(main)
