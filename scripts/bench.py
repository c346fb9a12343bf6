"""Training throughput of tfpar beside keras-hub's GPT2Backbone, in one process.

    python scripts/bench.py --steps=20 --rounds=3 --warmup=10 --out=bench.json
    python scripts/bench.py --section=data_parallel --steps=60 --rounds=2 --out=bench_dp.json

The data_parallel section (scaling and gradient compression) is
scripts/bench_dp.py; the rest of this docstring is about the default section.

Both systems train the same GPT (4 layers, d_model 256, 4 heads, d_ff 1024,
seq 256, batch 16, byte vocabulary of 256, learned positions, output logits
through the tied token embedding, no dropout) in float32 with the same AdamW
(warmup + cosine schedule, weight decay 0.1 on matrices and embeddings,
global-norm clip 1.0) on the same packed byte windows of tfpar's embedded
corpus:

  * tfpar: the real code path, `DataParallelEngine` on `one_device` with its
    own tf.data pipeline, `--steps_per_call` steps per tf.function call.
  * keras-hub: `GPT2Backbone` + `token_embedding(h, reverse=True)` (the tied
    head GPT2CausalLM uses), trained with `model.fit(jit_compile=True)`.

FLOPs per token are 6N + 12*L*d*T (Kaplan et al. 2020 / PaLM appendix B):
N counts every trainable parameter, embeddings included (the token table is
also the output projection; the position table is counted too), the same
rule for both models. MFU is the achieved FLOP/s over a peak measured in
this run: the best of several XLA-compiled 2048x2048 float32 matmuls.

Compilation and the first `--warmup` steps are excluded from the timing;
then `--rounds` rounds of `--steps` steps run for each system in turn, and
each system's best round counts. Timings are only meaningful on an
otherwise idle machine; interleaving keeps the comparison fair when it is not.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 20, "Timed training steps per system and round.")
flags.DEFINE_integer("rounds", 3, "Timed rounds per system, interleaved; the best round counts.")
flags.DEFINE_integer("warmup", 10, "Untimed steps first (the first one compiles).")
flags.DEFINE_enum("only", None, ["tfpar", "kerashub"], "Run one system only.")
flags.DEFINE_bool("quick", False, "Tiny shapes and a small matmul: a smoke test, not a benchmark.")
flags.DEFINE_integer("steps_per_call", 10, "tfpar's --steps_per_call.")
flags.DEFINE_integer("steps_per_execution", 1, "keras-hub's compile(steps_per_execution=...).")
flags.DEFINE_string("out", None, "Also write the results here as JSON.")
flags.DEFINE_enum("section", "systems", ["systems", "data_parallel"],
                  "systems: tfpar beside keras-hub (this file); data_parallel: mirrored and "
                  "multi_worker_mirrored against one device, per gradient compression "
                  "(scripts/bench_dp.py; --steps, --rounds, --quick, --out apply).")
flags.DEFINE_string("dp_only", None, "data_parallel: only these configurations, comma-separated "
                    "(e.g. mirrored/none,mirrored/powersgd4), besides one_device/none.")

# The benchmark shapes (issue 2), and tiny ones for --quick.
FULL = dict(num_layers=4, d_model=256, num_heads=4, d_ff=1024, seq_len=256, batch=16,
            matmul=2048)
QUICK = dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, seq_len=32, batch=4, matmul=256)
VOCAB = 256


def matmul_peak(n: int, repeats: int = 10) -> float:
  """Best FLOP/s of an XLA-compiled n x n float32 matmul."""
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


def flops_per_token(params: int, shape: dict) -> float:
  return 6 * params + 12 * shape["num_layers"] * shape["d_model"] * shape["seq_len"]


def tfpar_args(shape: dict, model_dir: str, steps: int) -> list:
  return [f"--model_dir={model_dir}", "--strategy=one_device", "--precision=float32",
          f"--num_layers={shape['num_layers']}", f"--d_model={shape['d_model']}",
          f"--num_heads={shape['num_heads']}", f"--d_ff={shape['d_ff']}",
          f"--seq_len={shape['seq_len']}", f"--global_batch_size={shape['batch']}",
          f"--train_steps={steps}", f"--steps_per_call={FLAGS.steps_per_call}",
          "--dropout=0", "--positions=learned", "--jit_compile=true"]


class TfparSystem:
  """tfpar's DataParallelEngine on one_device, fed by its own pipeline."""

  def __init__(self, shape: dict, total_steps: int):
    from tfpar import config, strategies  # pylint: disable=import-outside-toplevel
    from tfpar import flags as tfpar_flags  # pylint: disable=import-outside-toplevel
    from tfpar.cluster import Cluster  # pylint: disable=import-outside-toplevel
    from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
    from tfpar.training.engine import DataParallelEngine  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory() as model_dir:
      cfg = config.from_flags(tfpar_flags.parse(tfpar_args(shape, model_dir, total_steps)))
    strategy = strategies.make_strategy(cfg.dist, Cluster())
    corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                  eval_fraction=cfg.data.eval_fraction)
    self.engine = DataParallelEngine(cfg, strategy, corpus)
    self.iterator = self.engine.train_iterator(0)
    self.steps_per_call = cfg.train.steps_per_call
    self.name = f"tfpar (one_device, steps_per_call={self.steps_per_call})"
    self.params = self.engine.describe()["parameters"]
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


class KerasHubSystem:
  """keras-hub GPT2Backbone with its tied reverse-embedding head, model.fit(jit_compile=True)."""

  def __init__(self, shape: dict, total_steps: int):
    import keras  # pylint: disable=import-outside-toplevel
    import keras_hub  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar import config  # pylint: disable=import-outside-toplevel
    from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
    from tfpar.training import optimizer as tfpar_optimizer  # pylint: disable=import-outside-toplevel

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=shape["num_layers"], num_heads=shape["num_heads"],
        hidden_dim=shape["d_model"], intermediate_dim=shape["d_ff"], dropout=0.0,
        max_sequence_length=shape["seq_len"])
    logits = backbone.token_embedding(backbone.output, reverse=True)  # Tied, as GPT2CausalLM.
    self.model = keras.Model(backbone.input, logits)
    # The same AdamW settings as tfpar's defaults (keras' own class: no tfpar override).
    optim = config.OptimConfig()
    opt = keras.optimizers.AdamW(
        learning_rate=tfpar_optimizer.learning_rate_schedule(optim, total_steps),
        weight_decay=optim.weight_decay, beta_1=0.9, beta_2=0.95, epsilon=1e-8,
        global_clipnorm=optim.clip_norm)
    opt.exclude_from_weight_decay(var_names=tfpar_optimizer.NO_DECAY)
    self.spe = FLAGS.steps_per_execution
    self.model.compile(optimizer=opt,
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       jit_compile=True, steps_per_execution=self.spe)
    corpus = pipeline.load_corpus(None, seq_len=shape["seq_len"], eval_fraction=0.05)
    windows = pipeline.window_dataset(corpus.train, shape["seq_len"],
                                      pipeline.Shard(shape["batch"]), seed=0)
    self.data = windows.map(lambda x, y: ({"token_ids": x, "padding_mask": tf.ones_like(x)}, y))
    self.name = "keras-hub GPT2Backbone (model.fit, jit_compile=True)"
    self.params = int(sum(v.numpy().size for v in self.model.trainable_variables))
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


def table(rows: list) -> str:
  lines = ["| system | tokens/s | step ms | GFLOP/s | MFU | vs keras-hub |",
           "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    ratio = f"{r['vs_kerashub']:.2f}x" if r.get("vs_kerashub") else "-"
    lines.append(f"| {r['system']} | {r['tokens_per_sec']:,.0f} | {r['step_ms']:.1f} | "
                 f"{r['gflops']:.1f} | {100 * r['mfu']:.1f}% | {ratio} |")
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.section == "data_parallel":
    import bench_dp  # pylint: disable=import-outside-toplevel
    bench_dp.run(steps=FLAGS.steps, rounds=FLAGS.rounds, log_every=max(1, FLAGS.steps // 6),
                 quick=FLAGS.quick, out=FLAGS.out, only=FLAGS.dp_only)
    return
  if FLAGS.warmup < 1:
    raise app.UsageError("--warmup must be at least 1 (the first step compiles)")
  shape = QUICK if FLAGS.quick else FULL
  tokens_per_step = shape["batch"] * shape["seq_len"]
  peaks = [matmul_peak(shape["matmul"])]
  systems = {"tfpar": TfparSystem, "kerashub": KerasHubSystem}
  if FLAGS.only:
    systems = {FLAGS.only: systems[FLAGS.only]}
  total = FLAGS.warmup + (FLAGS.rounds + 1) * FLAGS.steps
  built = {name: system(shape, total) for name, system in systems.items()}
  for system in built.values():
    system.run(FLAGS.warmup)  # Compiles, then runs a few steps untimed.
  seconds = {name: [] for name in built}
  for _ in range(FLAGS.rounds):  # Interleaved, so load drift hits every system alike.
    for name, system in built.items():
      seconds[name].append(system.run(FLAGS.steps))
    peaks.append(matmul_peak(shape["matmul"]))  # The peak, too, under the same load.
  peak = max(peaks)
  rows = []
  for name, system in built.items():
    best = min(seconds[name])
    r = {"key": name, "system": system.name, "params": system.params, "steps": FLAGS.steps,
         "seconds": best, "seconds_per_round": seconds[name], "last_loss": system.last_loss}
    r["flops_per_token"] = flops_per_token(r["params"], shape)
    r["tokens_per_sec"] = tokens_per_step * r["steps"] / r["seconds"]
    r["step_ms"] = 1000 * r["seconds"] / r["steps"]
    r["gflops"] = r["tokens_per_sec"] * r["flops_per_token"] / 1e9
    r["mfu"] = r["gflops"] * 1e9 / peak
    rows.append(r)
  by_key = {r["key"]: r for r in rows}
  if "kerashub" in by_key:
    for r in rows:
      r["vs_kerashub"] = r["tokens_per_sec"] / by_key["kerashub"]["tokens_per_sec"]
  print(f"shapes: {shape}, vocab {VOCAB}, float32; {FLAGS.warmup} warmup steps, then the best "
        f"of {FLAGS.rounds} interleaved rounds of {FLAGS.steps} timed steps")
  print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (best XLA {shape['matmul']}^2 float32 matmul, "
        f"measured before and after each round)")
  for r in rows:
    print(f"{r['key']}: N = {r['params']:,} parameters, {r['flops_per_token'] / 1e6:.2f} "
          f"MFLOP/token, last loss {r['last_loss']:.3f}")
  print()
  print(table(rows))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"shape": shape, "vocab": VOCAB, "warmup": FLAGS.warmup, "steps": FLAGS.steps,
                 "rounds": FLAGS.rounds,
                 "peak_gflops": peak / 1e9, "peaks_gflops": [p / 1e9 for p in peaks],
                 "command": " ".join(["python"] + sys.argv),
                 "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
