"""Where a training step's time goes: a tf.profiler trace of a few steps, per XLA op.

    python scripts/step_profile.py --only=tfpar --steps=5
    python scripts/step_profile.py --only=kerashub --steps=5

Builds one system of scripts/bench.py (the same model, data and optimizer)
in this process, runs `--warmup` steps, then traces `--steps` steps with
`tf.profiler`. XLA's CPU backend is asked to mark every HLO instruction in
the trace (`--xla_cpu_enable_xprof_traceme`) and to dump the optimised HLO
(`--xla_dump_to`), whose metadata names the TensorFlow op each instruction
(or fusion) came from. Each traced instruction is then put in one bucket by
that op name: the attention core (scores, mask, softmax, weighted sum), the
Q/K/V/output projections, the MLP, LayerNorm, the embedding, the head and
loss, the AdamW update (with clipping) or other, and split into forward and
backward (gradient op names start with `gradient_tape/` or `gradients/`),
and into matmuls (dot, convolution and GEMM custom calls) and the rest.
Host time is the step's wall time minus the time inside the compiled
program: the executor, the input pipeline, the Python loop.

XLA may run independent instructions on several threads at once, so bucket
times are CPU time inside instructions; their shares, not their sum against
the wall clock, are what to read.
"""

import collections
import glob
import os
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="tfpar_hlo_")
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true",
    f"--xla_dump_to={DUMP}", "--xla_dump_hlo_as_text"]).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # pylint: disable=wrong-import-position

import bench  # pylint: disable=wrong-import-position
import xplane  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("logdir", None, "Keep the trace here (default: a temporary directory).")

# (bucket, pattern over the TF op name with gradient prefixes and _N suffixes removed), first
# match wins; tfpar's names (gpt/block_0/attn/query/...) and keras-hub's
# (functional/transformer_layer_0/self_attention/query/...).
BUCKETS = [
    ("AdamW update + clipping", r"^(adam_?w|global_norm|clip)|/adam_?w/"),
    ("LayerNorm", r"(^|/)(ln_\d|ln_f|layer_norm|\w+_layer_norm)(/|$)"),
    ("head + loss", r"sparsesoftmaxcrossentropy|compile_loss|cross_entropy|^gpt/(matmul|einsum)|"
                    r"token_embedding/(matmul|einsum|transpose)"),
    ("attention Q/K/V/output projections", r"/(query|key|value|output|attention_output)(/|$)"),
    ("attention core (scores, mask, softmax, x V)", r"/attn/|self_attention"),
    ("MLP (matmuls, GELU)", r"/mlp/|feedforward|fc_in|fc_out"),
    ("embedding", r"wte|wpe|token_embedding|position_embedding|embeddings_add|^gpt/add|"
                  r"unsortedsegmentsum"),
]
MATMUL = re.compile(r"^(dot|convolution|custom-call|__onednn|ynn_fusion|MatMul|BatchMatMul)", re.I)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^%?([\w.\-]+) \(.*\{$")


def hlo_op_names(dump_dir: str) -> dict:
  """{module: {instruction: TF op name}} from the optimised HLO dumps.

  A fusion without metadata of its own gets the most common op name of the
  computation it calls.
  """
  modules = {}
  for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
    names, calls, inside = {}, {}, collections.defaultdict(collections.Counter)
    computation = None
    with open(path) as f:
      for line in f:
        c = _COMPUTATION.match(line)
        if c:
          computation = c.group(1)
          continue
        m = _INSTRUCTION.match(line)
        if not m:
          continue
        op = re.search(r'op_name="([^"]*)"', line)
        names[m.group(1)] = op.group(1) if op else ""
        if op and computation:
          inside[computation][op.group(1)] += 1
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
          calls[m.group(1)] = called.group(1)
    for instruction, computation in calls.items():
      if not names[instruction] and inside[computation]:
        names[instruction] = inside[computation].most_common(1)[0][0]
    modules[os.path.basename(path)] = names
  return modules


def bucket_of(op_name: str) -> str:
  low = re.sub(r"^(gradient_tape|gradients)/", "", op_name)
  low = re.sub(r"_\d+(?=/|$)", "", low).lower()
  for bucket, pattern in BUCKETS:
    if re.search(pattern, low):
      return bucket
  return "other (residual adds, gradient sums, copies)"


def trace_events(logdir: str):
  """(name, duration in seconds) of every event in the trace."""
  for name, _, duration in xplane.events(logdir):
    yield name, duration * 1e-12


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  name = FLAGS.only or "tfpar"
  _, section = bench._find(name)  # pylint: disable=protected-access
  shape = bench.QUICK if FLAGS.quick else section.shape
  precision = FLAGS.precision[0]
  system = section.systems[name].build(shape, precision, FLAGS.warmup + 2 * FLAGS.steps + 1)
  system.run(FLAGS.warmup)
  untraced = system.run(FLAGS.steps)
  logdir = FLAGS.logdir or tempfile.mkdtemp(prefix="tfpar_trace_")
  tf.profiler.experimental.start(logdir)
  traced = system.run(FLAGS.steps)
  tf.profiler.experimental.stop()

  modules = hlo_op_names(DUMP)
  events = list(trace_events(logdir))
  event_names = {n for n, _ in events}
  # The step's program: the dumped module whose instructions the trace ran most of.
  module = max(modules, key=lambda m: len(event_names & set(modules[m])))
  op_of = modules[module]
  seconds = collections.defaultdict(float)
  for event, dur in events:
    if event in op_of:
      op = op_of[event]
      direction = "backward" if re.match(r"(gradient_tape|gradients)/", op) else "forward"
      kind = "matmul" if MATMUL.match(event) else "other"
      seconds[(bucket_of(op), direction, kind)] += dur
  executed = sum(d for n, d in events if n == "CpuExecutable::ExecuteAsyncOnStream")
  inside = sum(seconds.values())
  per_step = lambda s: 1000 * s / FLAGS.steps
  print(f"{name} {precision}, shapes {shape}: {per_step(untraced):.1f} ms/step untraced, "
        f"{per_step(traced):.1f} traced; compiled program {per_step(executed):.1f} ms/step of "
        f"wall time; host (executor, input, loop) {per_step(traced - executed):.1f} ms/step")
  print(f"XLA module: {module}\n")
  print("| part | forward ms | backward ms | of which matmul ms | share |")
  print("|---|---:|---:|---:|---:|")
  buckets = [b for b, _ in BUCKETS] + [bucket_of("")]
  for b in sorted(buckets, key=lambda b: -sum(v for k, v in seconds.items() if k[0] == b)):
    fwd = sum(v for k, v in seconds.items() if k[0] == b and k[1] == "forward")
    bwd = sum(v for k, v in seconds.items() if k[0] == b and k[1] == "backward")
    mm = sum(v for k, v in seconds.items() if k[0] == b and k[2] == "matmul")
    if fwd + bwd:
      print(f"| {b} | {per_step(fwd):.1f} | {per_step(bwd):.1f} | {per_step(mm):.1f} | "
            f"{100 * (fwd + bwd) / inside:.1f}% |")
  print(f"\n(CPU time inside XLA instructions: {per_step(inside):.1f} ms/step; trace in {logdir}, "
        f"HLO in {DUMP})")


if __name__ == "__main__":
  app.run(main)
