"""What a tf.distribute input iterator does to XLA's CPU matmuls, in one process.

    python scripts/input_iterator_peak.py

Measures the best XLA-compiled 2048x2048 float32 matmul (scripts/bench.py's
peak) fresh, then with tfpar's input pipeline (the embedded corpus, batch
16 x 256) behind a plain `iter(dataset)` that has run 20 batches, then behind
a `OneDeviceStrategy.distribute_datasets_from_function` iterator, created and
after 20 batches. Each case runs in its own process (the slowdown outlives
the iterator). On 3 December 2026 (idle machine) the distributed iterator
took the peak from about 183 to 164-168 GFLOP/s and the plain one left it
at 183: why tfpar's one-replica CPU engine reads a plain iterator
(tfpar/engines/data_parallel.py).
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))


def child(mode: str) -> None:
  sys.path.insert(0, HERE)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import bench  # pylint: disable=import-outside-toplevel
  from tfpar.data import pipeline  # pylint: disable=import-outside-toplevel
  peak = lambda: f"{bench.matmul_peak(bench.MATMUL) / 1e9:.1f}"
  fresh = peak()
  corpus = pipeline.load_corpus(None, seq_len=256, eval_fraction=0.05)
  make = lambda ctx=None: pipeline.window_dataset(corpus.train, 256, pipeline.Shard(16), seed=0)
  if mode == "plain":
    iterator = iter(make())
  else:
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    iterator = iter(strategy.distribute_datasets_from_function(make))
  created = peak()
  for _ in range(20):
    next(iterator)
  print(f"| {mode} | {fresh} | {created} | {peak()} |", flush=True)


def main(argv):
  if len(argv) > 1:
    child(argv[1])
    return
  print("GFLOP/s of the 2048^2 XLA matmul in one process, each row its own process:")
  print("| iterator | fresh | iterator created | after 20 batches |\n|---|---:|---:|---:|")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE),
                                                     os.environ.get("PYTHONPATH", "")]))
  for mode in ("plain", "distributed", "plain", "distributed"):
    proc = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True,
                          env=env, check=True)
    print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
  main(sys.argv)
