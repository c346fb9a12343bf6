"""The multi-replica update alone: op by op, or one XLA program per replica. ms per update.

    python scripts/update_bench.py --rounds=3

Builds the data-parallel engine of the benchmark GPT (scripts/bench_dp.py's
shapes) on 2 mirrored logical CPUs and times `--updates` calls of the
replicas' update on fixed gradients, as the engine's step runs it after the
gradients: unsharded, Keras AdamW's clip and update (after the gradient
exchange, which is left out), and zero1, tfpar.parallel.zero.ZeroUpdate (its
sum included). Each variant (`--jit_compile` off: the ops one by one; on: one
XLA program per replica, AdamW.compile_update / ZeroUpdate's jit_compile)
runs in its own process per round; rounds alternate the order. Prints the
median ms per update of each variant over the rounds, and compiled / op by op.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_dp  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "Rounds; each runs every variant once, in its own process.")
flags.DEFINE_integer("updates", 20, "Timed updates per process (after 3 untimed).")
flags.DEFINE_string("variant", None, "Internal: run this one variant (mode/jit) and print JSON.")
flags.DEFINE_bool("quick", False, "Tiny shapes: a smoke test.")

VARIANTS = ("none/false", "none/true", "zero1/false", "zero1/true")


def _time_one(variant: str) -> dict:
  """ms per update of one variant, in this process."""
  mode, jit = variant.split("/")
  from tfpar.config import config, flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  from tfpar import strategies  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
  from tfpar.engines.data_parallel import DataParallelEngine  # pylint: disable=import-outside-toplevel
  from tfpar.layout import placement as plan_lib  # pylint: disable=import-outside-toplevel
  from tfpar.training.step import apply_gradients  # pylint: disable=import-outside-toplevel
  cfg = config.from_flags(tfpar_flags.parse(
      (bench_dp.QUICK if FLAGS.quick else bench_dp.FULL) +
      ["--strategy=mirrored", "--num_cpu_devices=2", f"--optimizer_sharding={mode}",
       f"--jit_compile={jit}", f"--model_dir={tempfile.mkdtemp(prefix='tfpar_update_bench_')}"]))
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  strategy = strategies.make_strategy(cfg.dist, Cluster())
  corpus = pipeline.load_corpus(cfg.data.data, seq_len=cfg.model.seq_len,
                                eval_fraction=cfg.data.eval_fraction)
  engine = DataParallelEngine(cfg, strategy, corpus)
  variables = engine.model.trainable_variables
  grads = [tf.random.stateless_normal(v.shape, [i, 0]) * 1e-3 for i, v in enumerate(variables)]

  def replica_update():
    device = tf.nest.flatten(tf.distribute.get_replica_context().devices)[0]
    replica = engine._replica_of_device[plan_lib.device_key(device)]  # pylint: disable=protected-access
    if engine.zero:
      return engine.zero.apply(grads, replica, exchange=engine.exchange)
    return apply_gradients(engine.optimizer, grads, variables)

  update = tf.function(lambda: strategy.run(replica_update))
  for _ in range(3):
    update()
  start = time.perf_counter()
  for _ in range(FLAGS.updates):
    norm = update()
  float(strategy.experimental_local_results(norm)[0])
  return {"variant": variant, "ms": (time.perf_counter() - start) / FLAGS.updates * 1e3}


def main(argv):
  del argv
  if FLAGS.variant:
    print(json.dumps(_time_one(FLAGS.variant)), flush=True)
    return
  times = {v: [] for v in VARIANTS}
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=bench_dp.REPO)
  for r in range(FLAGS.rounds):
    for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--variant={variant}",
                             f"--updates={FLAGS.updates}", f"--quick={FLAGS.quick}"],
                            capture_output=True, text=True, env=env, cwd=bench_dp.REPO,
                            timeout=1800)
      if proc.returncode != 0:
        sys.exit(f"update_bench: {variant} failed:\n{proc.stderr[-3000:]}")
      ms = json.loads(proc.stdout.strip().splitlines()[-1])["ms"]
      times[variant].append(ms)
      print(f"round {r + 1} {variant}: {ms:.1f} ms", flush=True)
  median = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
  print(f"\nms per update, median (best) of {FLAGS.rounds} rounds ({bench_dp._load()})")  # pylint: disable=protected-access
  print("| optimizer sharding | op by op | one XLA program per replica | ratio of medians |")
  print("|---|---:|---:|---:|")
  for mode in ("none", "zero1"):
    slow, fast = (f"{mode}/{jit}" for jit in ("false", "true"))
    print(f"| {mode} | {median[slow]:.1f} ({min(times[slow]):.1f}) | "
          f"{median[fast]:.1f} ({min(times[fast]):.1f}) | {median[fast] / median[slow]:.2f}x |")


if __name__ == "__main__":
  app.run(main)
