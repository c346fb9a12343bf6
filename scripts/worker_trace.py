"""Each worker's first-step trace under one program per worker.

    python scripts/worker_trace.py [--workers=2,4,8] [--num_layers=8]

For N worker processes on 127.0.0.1 holding one pipeline stage each (D=1,
K=N, the same --num_layers-block model, GPipe, XLA off), every worker builds
its engine (tfpar.engines.stage_worker) and traces one training step of its
own stage (`tf.function`'s get_concrete_function of the step loop, nothing
run); prints, per N, the seconds that trace took and the ops of its graph
(every function in its library counted), each the largest over the workers;
the trace's seconds are given as wall time and as the CPU time of the thread
that traced (N processes on fewer cores wait for each other; the CPU time
does not).

Numbers depend on the machine's load: say so beside them.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar.cli.launch import free_ports  # pylint: disable=wrong-import-position


def flags(num_layers: int, workers: int):
  return ["--num_layers=%d" % num_layers, "--d_model=32", "--num_heads=4", "--d_ff=64",
          "--seq_len=32", "--global_batch_size=8", "--strategy=multi_worker_mirrored",
          f"--pipeline_stages={workers}", "--microbatches=2", "--pipeline_schedule=gpipe",
          "--jit_compile=false", "--model_dir=/tmp/tfpar_worker_trace"]


def op_count(graph) -> int:
  """Ops of a graph and of every function in its library."""
  functions = graph._functions.values()  # pylint: disable=protected-access
  return len(graph.get_operations()) + sum(
      len(f.graph.get_operations()) if hasattr(f, "graph") else len(f.definition.node_def)
      for f in functions)


def child(args):
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfpar import engines, strategies, tasks  # pylint: disable=import-outside-toplevel
  from tfpar.config import config  # pylint: disable=import-outside-toplevel
  from tfpar.config import flags as flags_lib  # pylint: disable=import-outside-toplevel
  from tfpar.config.cluster import from_env  # pylint: disable=import-outside-toplevel
  from tfpar.data.pipeline import Corpus  # pylint: disable=import-outside-toplevel
  os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": json.loads(args.spec)},
                                        "task": {"type": "worker", "index": args.role}})
  cfg = config.from_flags(flags_lib.parse(flags(args.num_layers, args.workers)))
  tokens = np.arange(4096, dtype=np.uint8)
  corpus = Corpus(train=tokens, eval=tokens[:512], files=())
  strategy = strategies.make_strategy(cfg.dist, from_env())
  engine = engines.make(cfg, strategy, corpus, task=tasks.make(cfg))
  iterator = engine.train_iterator(0)
  start, cpu = time.perf_counter(), time.thread_time()
  traced = engine._train_fn.get_concrete_function(iterator, tf.constant(1), False)  # pylint: disable=protected-access
  seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
  print("RESULT " + json.dumps({"seconds": seconds, "cpu": cpu, "ops": op_count(traced.graph)}),
        flush=True)
  time.sleep(float(args.linger))  # Peers may still be tracing: the strategy's server stays up.


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", default="2,4,8")
  parser.add_argument("--num_layers", type=int, default=8)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--role", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--linger", default="30", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    args.workers = len(json.loads(args.spec))
    return child(args)
  print("| workers | trace s, wall (worst worker) | trace s, CPU of the tracing thread "
        "(worst worker) | graph ops (worst worker) |")
  print("|---|---|---|---|")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  for n in [int(x) for x in args.workers.split(",")]:
    spec = json.dumps([f"127.0.0.1:{p}" for p in free_ports(n)])
    procs = [subprocess.Popen([sys.executable, __file__, "--child", f"--role={r}",
                               f"--spec={spec}", f"--num_layers={args.num_layers}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    results = []
    try:
      for proc in procs:
        out, err = proc.communicate(timeout=900)
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if not lines:
          print(f"| {n} | failed: {err.strip().splitlines()[-1:]} | | |", flush=True)
          break
        results.append(json.loads(lines[0][7:]))
    finally:
      for proc in procs:
        proc.kill()
        proc.wait()
    if results:
      print(f"| {n} | {max(r['seconds'] for r in results):.2f} | "
            f"{max(r['cpu'] for r in results):.2f} | {max(r['ops'] for r in results):,} |",
            flush=True)


if __name__ == "__main__":
  main()
