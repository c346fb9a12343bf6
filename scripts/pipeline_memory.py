"""Activations per pipeline stage against the plan's, peaks and tokens/s; a process per schedule.

    python scripts/pipeline_memory.py                     # GPipe, 1F1B: K=2 stages, M=8, 3 rounds
    python scripts/pipeline_memory.py --schedules=gpipe,1f1b,interleaved --rounds=3

Every measurement is a child (`--only=SCHEDULE`, one JSON line) that builds
tfpar's model-parallel engine for the plan (a GPT of --num_layers blocks,
d_model --d_model, seq --seq_len, batch --global_batch_size, K=--stages on
K logical CPUs, M=--microbatches, float32, XLA off unless --jit_compile),
and measures, in this order:

  * per stage: TensorFlow's CPU allocator is one for all logical CPU devices,
    so `get_memory_info` cannot tell stages apart. The child runs with TF's
    BFC allocator on the CPU (TF_CPU_ALLOCATOR_USE_BFC=true), whose every
    allocation and free is an event of a tf.profiler trace naming the TF op
    that allocated it. One traced pipeline step (the replica's forward and
    backward, `loss_and_grads`, no optimizer) counts each allocation on the
    stage whose device runs its op (a gradient op: its forward op's, by
    colocation; an op Grappler renamed: the op it came from; "other": an op
    of no stage, e.g. the input split). Two readings per stage:
      held: the most bytes that forward ops requested during the step and
        that are still alive when a backward op (of `gradients/`, or of a
        1F1B unit "B{c}_{m}") allocates: the activations kept for the
        backwards, what the plan predicts. scripts/activation_memory.py's
        reading (alive when the backward starts) at every backward, since a
        pipeline's backwards start M times (with 1F1B the most is held when a
        backward follows the last warm-up forward); the tensors' requested
        bytes, as there (the BFC allocator rounds them up: 1F1B's stage 0 by 21% here).
      peak: the most bytes the allocator handed out in the step and alive at
        once: the activations, the gradients (GPipe's one tf.gradients keeps
        all M of each weight's until their AddN) and the temporaries, not the
        weights and optimizer slots (allocated before the step).
  * all stages: the allocator's peak during one untraced step above its
    level before it (`tf.config.experimental.get_memory_info`).
  * the plan's prediction beside it (tfpar.layout.placement.activation_bytes:
    tfpar's bytes per block of one micro-batch, plus the head's, from
    tfpar.layout.placement.tfpar_kept_per_position, measured by
    scripts/activation_memory.py, replayed in each device's order of
    forwards and backwards; GPipe's order is the executor's, so for it the
    plan gives a bound, all M micro-batches, printed "<=").
  * tokens/s: --steps timed training steps (optimizer included) after
    --warmup untimed ones, without the profiler (--steps=0: not measured).

The parent alternates the schedules for --rounds rounds and prints medians;
the logical devices share the host's cores, so tokens/s compares the
schedules' overheads here, not a pipeline's speed-up, and on a loaded machine
only the ratio of two medians means anything.
"""

import collections
import json
import os
import re
import statistics
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xplane  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "Schedules to compare (gpipe, 1f1b, interleaved).")
flags.DEFINE_string("only", None, "Measure this one schedule in this process (the children).")
flags.DEFINE_integer("stages", 2, "Pipeline stages K (logical CPUs).")
flags.DEFINE_integer("microbatches", 8, "Micro-batches M.")
flags.DEFINE_integer("virtual_stages", 2, "Chunks per stage under interleaved.")
flags.DEFINE_integer("num_layers", 4, "Blocks.")
flags.DEFINE_integer("d_model", 64, "Width.")
flags.DEFINE_integer("seq_len", 64, "Sequence length.")
flags.DEFINE_integer("global_batch_size", 16, "Sequences per step.")
flags.DEFINE_bool("jit_compile", False, "Each stage's forward and backward under XLA.")
flags.DEFINE_integer("rounds", 3, "Rounds; the schedules alternate within each.")
flags.DEFINE_integer("steps", 10, "Timed training steps per child.")
flags.DEFINE_integer("warmup", 2, "Untimed training steps first (the first traces).")
flags.DEFINE_string("out", None, "Also write the runs and medians here as JSON.")

MIB = 2 ** 20


def train_flags(schedule: str, model_dir: str):
  f = FLAGS
  return [f"--num_layers={f.num_layers}", f"--d_model={f.d_model}", "--num_heads=4",
          f"--d_ff={4 * f.d_model}", f"--seq_len={f.seq_len}",
          f"--global_batch_size={f.global_batch_size}", f"--train_steps={f.warmup + f.steps + 1}",
          "--warmup_steps=1", "--steps_per_call=1", f"--num_cpu_devices={f.stages}",
          f"--pipeline_stages={f.stages}", f"--microbatches={f.microbatches}",
          f"--pipeline_schedule={schedule}", f"--jit_compile={str(f.jit_compile).lower()}",
          f"--model_dir={model_dir}"] + (
              [f"--virtual_stages={f.virtual_stages}"] if schedule == "interleaved" else [])


def backward(op_name: str) -> bool:
  """A gradient op, or (1F1B, interleaved) an op of a backward unit's name scope "B{c}_{m}"."""
  return bool(re.search(r"(^|/)gradients(_\d+)?/", op_name) or re.match(r"B\d+_\d+/", op_name))


def peaks_per_stage(events, devices, stage_by_device):
  """({stage: the most bytes allocated during the trace and alive at once},
  {stage: the most bytes requested by forward ops and alive when a backward op allocates})."""
  live, forward, peak, held, owner = (collections.Counter(), collections.Counter(),
                                      collections.Counter(), collections.Counter(), {})
  for _, name, stats in sorted(events, key=lambda e: e[0]):
    if name == "MemoryAllocation":
      op = stats.get("tf_op", "")
      stage = stage_by_device.get(devices.get(xplane.op_of(op, devices)), "other")
      kept = 0 if backward(op) else stats["requested_bytes"]
      owner[stats["addr"]] = (stage, stats["allocation_bytes"], kept)
      live[stage] += stats["allocation_bytes"]
      peak[stage] = max(peak[stage], live[stage])
      held[stage] = max(held[stage], forward[stage] if backward(op) else 0)
      forward[stage] += kept
    elif stats.get("addr") in owner:  # A free of an allocation made during the trace.
      stage, nbytes, kept = owner.pop(stats["addr"])
      live[stage] -= nbytes
      forward[stage] -= kept
  return dict(peak), dict(held)


def measure(schedule: str) -> dict:
  """This process's measurements of one schedule (module docstring)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.config import config, flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  from tfpar import engines, strategies  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  from tfpar.data.pipeline import Corpus  # pylint: disable=import-outside-toplevel
  from tfpar.layout import placement as plan_lib  # pylint: disable=import-outside-toplevel
  from tfpar.layout import schedule as schedule_lib  # pylint: disable=import-outside-toplevel
  workdir = tempfile.mkdtemp(prefix="tfpar_pipeline_memory_")
  cfg = config.from_flags(tfpar_flags.parse(train_flags(schedule, workdir)))
  strategies.setup_devices(cfg.dist.num_cpu_devices)
  tokens = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
  engine = engines.make(cfg, strategies.make_strategy(cfg.dist, Cluster()),
                        Corpus(train=tokens, eval=tokens[:4096], files=()))
  plan = engine.plan
  stage_by_device = {plan_lib.device_key(row[k][0]): f"stage {k}"
                     for row in plan.devices for k in range(plan.pipeline_stages)}
  step = tf.function(engine.copies[0].pipeline.loss_and_grads)
  batch = next(engine.train_iterator(0))
  devices = {name: plan_lib.device_key(d) if d else "" for name, d in
             xplane.op_devices(step.get_concrete_function(*batch).graph).items()}
  step(*batch)  # Warm: the first call allocates what later ones reuse.
  before = tf.config.experimental.get_memory_info("CPU:0")["current"]
  tf.config.experimental.reset_memory_stats("CPU:0")
  step(*batch)
  all_stages = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
  tf.profiler.experimental.start(os.path.join(workdir, "trace"))
  step(*batch)
  tf.profiler.experimental.stop()
  events = list(xplane.memory_events(os.path.join(workdir, "trace")))
  peaks, held = peaks_per_stage(events, devices, stage_by_device)
  tokens_per_sec = None
  if FLAGS.steps:
    iterator = engine.train_iterator(0)
    engine.train(iterator, FLAGS.warmup)
    start = time.perf_counter()
    engine.train(iterator, FLAGS.steps)
    tokens_per_sec = (FLAGS.steps * cfg.train.global_batch_size * cfg.model.seq_len /
                      (time.perf_counter() - start))
  predicted = plan.activation_bytes()
  return {"schedule": schedule, "pid": os.getpid(), "bubble": plan.bubble,
          "prediction_is_bound": schedule in schedule_lib.BOUND,
          "in_flight": plan.in_flight,
          "held_bytes_per_stage": {s: held.get(s, 0) for s in sorted(stage_by_device.values())},
          "peak_bytes_per_stage": {s: peaks.get(s, 0) for s in sorted(stage_by_device.values())},
          "other_bytes": peaks.get("other", 0), "all_stages_bytes": int(all_stages),
          "predicted_bytes_per_stage": {f"stage {k}": predicted[plan_lib.device_key(row[k][0])]
                                        for row in plan.devices[:1] for k in range(len(row))},
          "tokens_per_sec": tokens_per_sec}


def main(_):
  if FLAGS.only:
    print(json.dumps(measure(FLAGS.only)), flush=True)
    return
  runs = []
  for r in range(FLAGS.rounds):
    for schedule in FLAGS.schedules[::1 if r % 2 == 0 else -1]:
      runs.append(xplane.run_child(__file__, [a for a in sys.argv[1:] if not a.startswith("--only")]
                                   + [f"--only={schedule}"]))
  med = lambda values: statistics.median(values)
  rows = {}
  for schedule in FLAGS.schedules:
    mine = [run for run in runs if run["schedule"] == schedule]
    stages = sorted(mine[0]["held_bytes_per_stage"])
    rows[schedule] = {
        "held": {s: med([run["held_bytes_per_stage"][s] for run in mine]) for s in stages},
        "peak": {s: med([run["peak_bytes_per_stage"][s] for run in mine]) for s in stages},
        "predicted": mine[0]["predicted_bytes_per_stage"], "in_flight": mine[0]["in_flight"],
        "bound": mine[0]["prediction_is_bound"],
        "other": med([run["other_bytes"] for run in mine]),
        "all_stages": med([run["all_stages_bytes"] for run in mine]),
        "tokens_per_sec": med([run["tokens_per_sec"] or 0 for run in mine]),
        "bubble": mine[0]["bubble"]}
  reference = rows[FLAGS.schedules[0]]["tokens_per_sec"] or 1
  stages = list(rows[FLAGS.schedules[0]]["held"])
  print(f"K={FLAGS.stages} stages, M={FLAGS.microbatches} micro-batches, {FLAGS.rounds} rounds "
        f"(medians), 1-minute load {os.getloadavg()[0]:.1f}; MiB per stage: the activations held, "
        f"measured (predicted), and the peak of all the step allocates")
  print("| schedule | in flight | " + " | ".join(f"{s} held" for s in stages) + " | " +
        " | ".join(f"{s} peak" for s in stages) + " | other | all stages | tokens/s | vs " +
        FLAGS.schedules[0] + " |")
  print("|---" * (2 * len(stages) + 6) + "|")
  for schedule, row in rows.items():
    bound = "<= " if row["bound"] else ""
    cells = [f"{row['held'][s] / MIB:.2f} ({bound}{row['predicted'][s] / MIB:.2f})"
             for s in stages] + [
        f"{row['peak'][s] / MIB:.2f}" for s in stages]
    print(f"| {schedule} | {', '.join(f'{n:g}' for n in row['in_flight'])} | " +
          " | ".join(cells) + f" | {row['other'] / MIB:.2f} | {row['all_stages'] / MIB:.2f} | "
          f"{row['tokens_per_sec']:,.0f} | {row['tokens_per_sec'] / reference:.2f}x |")
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump({"runs": runs, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
