"""Where a data-parallel step's wall time goes: one traced run per configuration, its own process.

    python scripts/dp_profile.py --configs=one_device/none,mirrored/none,multi_worker/none

Each configuration of scripts/bench_dp.py (the benchmark GPT: 4 layers,
d_model 256, seq 256, global batch 16) trains with the real CLI for
`--steps` steps and traces the last `--traced` of them with tfpar's own
`--profile_steps` (tf.profiler, op names on: host_tracer_level 3; under
multi_worker the chief's trace). The trace's events are sorted into
  compiled  the replicas' forward and backward (XLA programs: CpuExecutable),
  exchange  the gradient all-reduce: every op under the exchange's
            `grad_exchange` scope (tfpar.parallel.exchange: PowerSGD's
            matmuls and QR, the casts, ReductionToOneDevice's AddN), the
            copies between devices, CollectiveReduceV2 across workers,
  update    clipping and AdamW (per-variable ops outside XLA once the
            replicas are several, unless --jit_compile compiles each
            replica's update apart: then the XLA programs of a step beyond
            its first one per local replica, which run after the exchange;
            inside the one-device program otherwise),
  other ops everything else the executor ran,
and each step's wall time (the `_train_steps` calls) is split by which of
them was running, in that order of precedence: an exchange that runs while
a replica still computes is hidden and not counted; `idle` is wall time
when none ran (the Python loop, waiting). Both replicas' programs run at
the same time on the machine's two cores, so `compiled` is the time either
one ran.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_dp  # pylint: disable=wrong-import-position
import xplane  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["one_device/none", "mirrored/none", "multi_worker/none"],
                  "Configurations of scripts/bench_dp.py to profile.")
flags.DEFINE_integer("steps", 12, "Steps per run.")
flags.DEFINE_integer("traced", 4, "The last this many steps are traced.")
flags.DEFINE_bool("quick", False, "Tiny shapes: a smoke test.")

OP = re.compile(r"^([^\s:]+):(\w+)$")
PARTS = ("compiled", "exchange", "update", "other ops")
EXCHANGE = re.compile(r"(^|/)(grad_exchange|_Recv|_Send|_HostRecv|_HostSend|Collective\w*|"
                      r"Nccl\w*)(_\d+)?(/|$)")
UPDATE = re.compile(r"(^|/)(adam_?w|clip\w*|global_norm|update_\d+|apply\w*)(_\d+)?(/|:|$)", re.I)


def part_of(name: str):
  """The part of a trace event, or None for events that are not work (threads, regions)."""
  if name == "CpuExecutable::ExecuteAsyncOnStream":
    return "compiled"
  traced_op = OP.match(name)  # TF ops are traced as "op_name:OpType".
  if not traced_op:
    return None
  op, kind = traced_op.groups()
  if kind in ("StatefulPartitionedCall", "PartitionedCall", "XlaLaunch", "_XlaRun", "While"):
    return None  # Containers: their work is traced inside them.
  if EXCHANGE.search(op) or EXCHANGE.search(kind):
    return "exchange"
  if UPDATE.search(op):
    return "update"
  return "other ops"


def _union(intervals):
  merged = []
  for a, b in sorted(intervals):
    if merged and a <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], b)
    else:
      merged.append([a, b])
  return merged


def _subtract(intervals, taken):
  """Parts of `intervals` (merged) not covered by `taken` (merged)."""
  out, j = [], 0
  for a, b in intervals:
    while j < len(taken) and taken[j][1] <= a:
      j += 1
    k, start = j, a
    while k < len(taken) and taken[k][0] < b:
      if taken[k][0] > start:
        out.append([start, taken[k][0]])
      start = max(start, taken[k][1])
      k += 1
    if start < b:
      out.append([start, b])
  return out


def breakdown(model_dir: str, steps: int, replicas: int = 1) -> dict:
  """Seconds per traced step of wall time in each part, idle, and the step itself.

  `replicas`: the traced process's replicas; the first that many XLA programs of each
  step are their forward and backward, any later ones their compiled updates.
  """
  spans = {p: [] for p in PARTS}
  calls, programs = [], []
  for name, start, duration in xplane.events(model_dir):
    span = (start, start + duration)
    if name == "_train_steps":
      calls.append(span)
    part = part_of(name)
    if part == "compiled":
      programs.append(span)
    elif part:
      spans[part].append(span)
  for a, b in calls:  # One step per call (--steps_per_call=1).
    mine = sorted(p for p in programs if a <= p[0] < b)
    spans["compiled"] += mine[:replicas]
    spans["update"] += mine[replicas:]
  length = lambda intervals: sum(b - a for a, b in intervals) * 1e-12 / steps
  free = _union(calls)  # The steps' wall time not yet given to a part.
  out = {"step": length(free)}
  for part in PARTS:  # Precedence: what a part overlaps with an earlier one is not its time.
    rest = _subtract(free, _union(spans[part]))
    out[part] = length(free) - length(rest)
    free = rest
  out["idle"] = length(free)
  return out


def main(argv):
  del argv
  configs = bench_dp.configurations()
  unknown = [c for c in FLAGS.configs if c not in configs]
  if unknown:
    sys.exit(f"dp_profile: unknown --configs {unknown}: pick from {', '.join(configs)}")
  if not 1 <= FLAGS.traced < FLAGS.steps:
    sys.exit("dp_profile: --traced must be at least 1 and below --steps (the first step compiles)")
  first = FLAGS.steps - FLAGS.traced + 1
  shared = (bench_dp.QUICK if FLAGS.quick else bench_dp.FULL) + [
      f"--train_steps={FLAGS.steps}", "--log_every=1", "--steps_per_call=1", "--eval_steps=0",
      f"--checkpoint_every={FLAGS.steps}", "--input_sharding=data", "--seed=0",
      f"--profile_steps={first},{FLAGS.steps}"]
  work = tempfile.mkdtemp(prefix="tfpar_dp_profile_")
  rows = {}
  try:
    for name in FLAGS.configs:
      model_dir = os.path.join(work, name.replace("/", "_"))
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=bench_dp.REPO)
      proc = subprocess.run([sys.executable, "-m", *configs[name], *shared,
                             f"--model_dir={model_dir}"], capture_output=True, text=True,
                            env=env, cwd=bench_dp.REPO, timeout=3600)
      if proc.returncode != 0:
        sys.exit(f"dp_profile: {name} failed:\n{proc.stderr[-3000:]}")
      rows[name] = breakdown(model_dir, FLAGS.traced, 2 if name.startswith("mirrored") else 1)
      print(f"{name}: " + json.dumps({k: round(v * 1e3, 1) for k, v in rows[name].items()}),
            flush=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print(f"\nms per step, steps {first}-{FLAGS.steps} traced ({bench_dp._load()})")  # pylint: disable=protected-access
  print("| configuration | step | " + " | ".join(PARTS) + " | idle |")
  print("|---|---:|" + "---:|" * (len(PARTS) + 1))
  for name, r in rows.items():
    print(f"| {name} | {r['step'] * 1e3:.1f} | " +
          " | ".join(f"{r[p] * 1e3:.1f}" for p in PARTS + ("idle",)) + " |")


if __name__ == "__main__":
  app.run(main)
