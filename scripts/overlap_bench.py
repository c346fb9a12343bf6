"""The bucketed sum among a stage's copies, overlapped with the backward or after it.

    python scripts/overlap_bench.py --rounds=3 --steps=30 --out=overlap.json

One job, D=2 copies x K=2 stages, one program per worker on 4 local worker
processes (`python -m tfpar.launch --num_workers=4`, 127.0.0.1), 1F1B over 4
micro-batches, on configs/gpt_tiny.flags' shapes (4 layers, d_model 128, seq
128, global batch 16), in two configurations that differ in one flag:

  * overlap: --all_reduce_pack_mb=0, one bucket per block, each summed with
    the stage's other copy as soon as the backward has finished it
    (tfpar.parallel.stage_program.StageProgram.buckets, p2p.Among);
  * after:   --all_reduce_pack_mb=1000000, one bucket: the whole gradient
    summed after the whole backward (what every step did before buckets).

Each run is a fresh job; rounds alternate the two (the order rotated each
round) so load drift hits both alike. A run's step time is the median of
its metrics.jsonl `step_time` over the log windows after the first (which
holds the trace); reported: each configuration's median over rounds, every
round's, their ratio, and each run's last loss (the same sums: the two must
agree). `--jit_compile` (default false) picks XLA's per-chunk programs,
whose backward finishes a chunk's blocks at once; `--extra` adds flags to
both (e.g. --extra=--optimizer_sharding=zero1: ZeRO-1's sum, bucketed too).

    python scripts/overlap_bench.py --network

runs nothing: what the overlap would hide on a network, from the planner's
figures (tfpar.planner: clusters' inter-node links, cost.all_reduce_seconds,
layer_flops, efficiency) for a 1.3B GPT (24 blocks of d_model 2048, d_ff
8192, seq 2048) as K=4 stages of 6 blocks, D=8 copies across nodes, a
micro-batch of 1 or 8, bfloat16 compute, float32 gradients. Per block: r, the ring
all-reduce of its gradient over the D copies, and t, its backward of one
micro-batch. A block's gradient is final only after the last micro-batch's
backward, so the backward of that one micro-batch (the stage's n blocks, last
to first) is what the n bucket sums can hide behind, on one link in turn:
after the backward, the stage exposes n r; overlapped, r + (n - 1) max(0, r - t)
(the first block's sum cannot start before its backward ends). The tied
embedding's sum comes after the whole backward either way and is left out.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from bench_dp import _load  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "Jobs per configuration, alternated.")
flags.DEFINE_integer("steps", 30, "Training steps per job.")
flags.DEFINE_integer("log_every", 5, "Steps per timed window (and per tf.function call).")
flags.DEFINE_bool("jit_compile", False, "tfpar's --jit_compile.")
flags.DEFINE_list("extra", [], "More tfpar flags for both configurations, e.g. "
                  "--extra=--optimizer_sharding=zero1.")
flags.DEFINE_string("out", None, "Also write the runs and the summary here as JSON.")
flags.DEFINE_bool("network", False, "Print what the overlap would hide on the planner's "
                  "clusters' links instead of measuring (the module docstring).")

SHAPE = ["--num_layers=4", "--d_model=128", "--num_heads=4", "--d_ff=512", "--seq_len=128",
         "--global_batch_size=16"]
JOB = ["--strategy=multi_worker_mirrored", "--pipeline_stages=2", "--microbatches=4",
       "--pipeline_schedule=1f1b", "--dropout=0"]
CONFIGS = {"overlap": ["--all_reduce_pack_mb=0"], "after": ["--all_reduce_pack_mb=1000000"]}


def run_one(extra, model_dir: str) -> dict:
  """One 4-worker job to the end: its step times (s) per window after the first, last loss."""
  shutil.rmtree(model_dir, ignore_errors=True)
  args = SHAPE + JOB + FLAGS.extra + extra + [
      f"--train_steps={FLAGS.steps}", f"--log_every={FLAGS.log_every}",
      f"--steps_per_call={FLAGS.log_every}", "--eval_steps=0",
      f"--checkpoint_every={10 * FLAGS.steps}", "--seed=0",
      f"--jit_compile={str(FLAGS.jit_compile).lower()}", f"--model_dir={model_dir}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", "tfpar.launch", "--num_workers=4", "--", *args],
                        capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
  if proc.returncode != 0:
    raise RuntimeError(f"job {extra} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    train = [r for r in map(json.loads, filter(str.strip, f)) if r["kind"] == "train"]
  times = [r["step_time"] for r in train[1:]]
  return {"step_time_median": statistics.median(times), "step_times": times,
          "last_loss": train[-1]["loss"]}


def network() -> None:
  """The module docstring's table from the planner's figures."""
  from tfpar.config.schema import ModelConfig  # pylint: disable=import-outside-toplevel
  from tfpar.layout import placement  # pylint: disable=import-outside-toplevel
  from tfpar.planner import clusters, cost  # pylint: disable=import-outside-toplevel
  m = ModelConfig(num_layers=24, d_model=2048, num_heads=16, d_ff=8192, seq_len=2048)
  n, d = m.num_layers // 4, 8
  nbytes = 4 * placement.rules_of(m).block_matmul_params(m)
  print(f"block gradient {nbytes / 2**20:.0f} MiB, {n} blocks per stage, D={d}")
  print("| cluster | inter-node link | micro-batch | r: a block's sum | t: its backward "
        "| after: n r | overlapped | hidden |\n|---|---:|---:|---:|---:|---:|---:|---:|")
  for name in ("a100-80gb", "h100-80gb", "tpu-v4"):
    for b in (1, 8):
      c = clusters.parse(f"{name}:{4 * d}")
      r = float(cost.all_reduce_seconds(nbytes, d, c.inter_bandwidth, c.inter_latency))
      t = float(2 * b * cost.layer_flops(m) /
                (c.peak_flops["bfloat16"] * cost.efficiency(c, m.d_model, b * m.seq_len)))
      after, overlapped = n * r, r + (n - 1) * max(0.0, r - t)
      print(f"| {name} | {c.inter_bandwidth / 1e9:g} GB/s | {b} | {1e3 * r:.1f} ms "
            f"| {1e3 * t:.1f} ms | {1e3 * after:.1f} ms | {1e3 * overlapped:.1f} ms "
            f"| {1 - overlapped / after:.0%} |")


def main(argv):
  del argv
  if FLAGS.network:
    network()
    return
  names = list(CONFIGS)
  runs = {n: [] for n in names}
  work = tempfile.mkdtemp(prefix="tfpar_overlap_")
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  try:
    for r in range(FLAGS.rounds):
      for name in names[r % 2:] + names[:r % 2]:
        load = os.getloadavg()[0]
        result = run_one(CONFIGS[name], os.path.join(work, name))
        result["load_1min"] = [load, os.getloadavg()[0]]
        runs[name].append(result)
        print(f"round {r + 1}/{FLAGS.rounds} {name}: {1000 * result['step_time_median']:.1f} "
              f"ms/step, loss {result['last_loss']:.6f}, load {load:.1f}", flush=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  medians = {n: statistics.median(x["step_time_median"] for x in runs[n]) for n in names}
  summary = {"command": " ".join(["python"] + sys.argv), "started": started, "load": _load(),
             "step_ms_median": {n: 1000 * m for n, m in medians.items()},
             "overlap_over_after": medians["overlap"] / medians["after"], "runs": runs}
  for n in names:
    rounds = ", ".join(f"{1000 * x['step_time_median']:.1f}" for x in runs[n])
    print(f"{n}: median {1000 * medians[n]:.1f} ms/step; rounds {rounds}")
  print(f"overlap / after: {summary['overlap_over_after']:.3f}; {summary['load']}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(summary, f, indent=2)


if __name__ == "__main__":
  app.run(main)
