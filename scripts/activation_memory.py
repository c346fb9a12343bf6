"""What the forward keeps for the backward, per device, measured from the allocator, beside plan.json.

    python scripts/activation_memory.py    # every layout below x --remat=none|selective|full
    python scripts/activation_memory.py --cases=tensor_2/full,llama_sequence_2/none

One child process (TensorFlow's BFC allocator on the CPU, so every allocation
and free is an event of a tf.profiler trace naming the op that made it:
xplane.run_child) builds tfpar's model-parallel engine for each layout and
remat (a GPT or Llama of --num_layers blocks, d_model --d_model, seq
--seq_len, batch --global_batch_size, float32, --dropout=0, no XLA), traces
one `loss_and_grads` step (forward and backward, no optimizer) after an
untraced one, and counts, per device (the device of the op that allocated;
a gradient op's is its forward op's, by colocation), the bytes allocated
during the step and still alive when the backward starts: the activations
the forward left for the backward. The backward starts at the first
allocation by a gradient op after the bytes allocated by forward ops peak
(gradient ops that read only forward values, e.g. x^2 for x^3's gradient,
can run during the forward; TensorFlow's recompute_grad puts the recomputed
forward under the gradient's name scope, so it counts as backward). Bytes
are the tensors' requested bytes; ops run one at a time (one inter-op
thread), so the order is TensorFlow's own and the count repeats.

Beside it: plan.json's predicted activations for the device (the plan's
prediction is for each stage's first device, the busiest: tfpar.layout.placement
`tfpar_kept_per_position` and `head_activation_bytes`). The measurement is
of the ops Grappler left, so it shows what the prediction must model: the
buffers TensorFlow forwards in place, the gradients of constants Grappler
prunes, and whether the recomputation really stayed in the backward.
"""

import collections
import json
import os
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xplane  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
# {layout: its flags}; each runs on 2 logical CPUs.
LAYOUTS = {
    "tensor_2": ["--tensor_parallel=2"],
    "sequence_2": ["--tensor_parallel=2", "--sequence_parallel"],
    "llama_tensor_2": ["--architecture=llama", "--num_kv_heads=2", "--tensor_parallel=2"],
    "llama_sequence_2": ["--architecture=llama", "--num_kv_heads=2", "--tensor_parallel=2",
                         "--sequence_parallel"],
}
REMATS = ("none", "selective", "full")
flags.DEFINE_list("cases", [f"{layout}/{remat}" for layout in LAYOUTS for remat in REMATS],
                  f"LAYOUT/REMAT pairs: a layout of {', '.join(LAYOUTS)}; --remat of "
                  f"{', '.join(REMATS)}.")
flags.DEFINE_bool("only", False, "Measure in this process (the child).")
flags.DEFINE_integer("num_layers", 2, "Blocks.")
flags.DEFINE_integer("d_model", 32, "Width.")
flags.DEFINE_integer("seq_len", 16, "Sequence length.")
flags.DEFINE_integer("global_batch_size", 8, "Sequences per step.")
flags.DEFINE_string("out", None, "Also write the rows as JSON here.")

KIB = 1024


def backward(op_name: str) -> bool:
  """A gradient op (tf.GradientTape's, or the inner tape of a recompute_grad) by its scope."""
  return op_name.startswith(("gradients", "gradient_tape"))


def kept_at_backward(events, devices):
  """{device: bytes allocated during the trace and alive when its backward starts} (module
  docstring), from allocator events and the {op name: device} of the traced graph."""
  allocations = [(name == "MemoryAllocation", stats.get("tf_op", ""), stats["addr"],
                  stats["requested_bytes"])  # A free has no op.
                 for _, name, stats in sorted(events, key=lambda e: e[0])]

  def replay(stop):
    """Live bytes per device before the first event `stop(i, allocation, op)` is true for,
    and the forward ops' live bytes after each event before it."""
    live, owner, forward, after = collections.Counter(), {}, 0, []
    for i, (allocation, op, addr, nbytes) in enumerate(allocations):
      if stop(i, allocation, op):
        break
      if allocation:
        owner[addr] = (devices.get(xplane.op_of(op, devices), "other"), nbytes, backward(op))
        live[owner[addr][0]] += nbytes
        forward += 0 if backward(op) else nbytes
      elif addr in owner:  # A free of an allocation made during the trace.
        device, nbytes, by_gradient = owner.pop(addr)
        live[device] -= nbytes
        forward -= 0 if by_gradient else nbytes
      after.append(forward)
    return live, after

  _, forward = replay(lambda *_: False)
  peak = forward.index(max(forward))
  live, _ = replay(lambda i, allocation, op: i > peak and allocation and backward(op))
  return {d: n for d, n in sorted(live.items()) if n}


def train_flags(layout: str, remat: str, model_dir: str):
  f = FLAGS
  return [f"--num_layers={f.num_layers}", f"--d_model={f.d_model}", "--num_heads=4",
          f"--d_ff={2 * f.d_model}", f"--seq_len={f.seq_len}",
          f"--global_batch_size={f.global_batch_size}", "--train_steps=2", "--warmup_steps=1",
          "--steps_per_call=1", "--num_cpu_devices=2", "--jit_compile=false", "--dropout=0",
          f"--remat={remat}", f"--model_dir={model_dir}"] + LAYOUTS[layout]


def measure() -> list:
  """This process's rows, one per case (module docstring)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar.config import config, flags as tfpar_flags  # pylint: disable=import-outside-toplevel
  from tfpar import engines, storage, strategies  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import Cluster  # pylint: disable=import-outside-toplevel
  from tfpar.data.pipeline import Corpus  # pylint: disable=import-outside-toplevel
  from tfpar.layout import placement as plan_lib  # pylint: disable=import-outside-toplevel
  tf.config.threading.set_inter_op_parallelism_threads(1)
  strategies.setup_devices(2)
  tokens = np.random.default_rng(0).integers(0, 256, 1 << 14).astype(np.uint8)
  rows, tmp = [], tempfile.TemporaryDirectory(prefix="tfpar_activation_memory_")
  for i, (layout, remat) in enumerate(case.split("/") for case in FLAGS.cases):
    workdir = os.path.join(tmp.name, str(i))
    cfg = config.from_flags(tfpar_flags.parse(train_flags(layout, remat, workdir)))
    engine = engines.make(cfg, strategies.make_strategy(cfg.dist, Cluster()),
                          Corpus(train=tokens, eval=tokens[:4096], files=()))
    step = tf.function(engine.copies[0].pipeline.loss_and_grads)
    batch = next(engine.train_iterator(0))
    devices = {name: plan_lib.device_key(d) for name, d in
               xplane.op_devices(step.get_concrete_function(*batch).graph).items() if d}
    step(*batch)  # Warm: the first call allocates what later ones reuse.
    trace = os.path.join(workdir, "trace")
    tf.profiler.experimental.start(trace)
    step(*batch)
    tf.profiler.experimental.stop()
    plan = json.loads(storage.read_text(os.path.join(workdir, "plan.json")))
    rows.append({"layout": layout, "remat": remat,
                 "predicted": plan["activation_bytes_per_device"],
                 "measured": kept_at_backward(xplane.memory_events(trace), devices)})
  tmp.cleanup()
  return rows


def main(_):
  for case in FLAGS.cases:
    layout, _, remat = case.partition("/")
    if layout not in LAYOUTS or remat not in REMATS:
      print(f"--cases: {case!r} is not LAYOUT/REMAT with LAYOUT one of {', '.join(LAYOUTS)} "
            f"and REMAT one of {', '.join(REMATS)}", file=sys.stderr)
      sys.exit(2)
  if FLAGS.only:
    print(json.dumps(measure()), flush=True)
    return
  rows = xplane.run_child(__file__, sys.argv[1:] + ["--only"])
  print(f"KiB kept for the backward, measured (plan.json's prediction), per device; "
        f"1-minute load {os.getloadavg()[0]:.1f}")
  devices = sorted({d for row in rows for d in row["measured"]})
  print("| layout | remat | " + " | ".join(devices) + " | predicted / measured |")
  print("|---" * (len(devices) + 3) + "|")
  for row in rows:
    cells = [f"{row['measured'].get(d, 0) / KIB:.1f}" + (
        f" ({row['predicted'][d] / KIB:.1f})" if d in row["predicted"] else "") for d in devices]
    ratios = ", ".join(f"{row['predicted'][d] / row['measured'][d]:.3f}"
                       for d in row["predicted"])
    print(f"| {row['layout']} | {row['remat']} | " + " | ".join(cells) + f" | {ratios} |")
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
