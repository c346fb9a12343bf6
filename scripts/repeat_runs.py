"""Run one training job several times, each in its own process, and compare the losses.

    python scripts/repeat_runs.py                                # PowerSGD, default threads
    TF_NUM_INTEROP_THREADS=1 python scripts/repeat_runs.py       # one inter-op thread
    python scripts/repeat_runs.py --runs=3 -- --grad_compression=none

The default job is the 80-step TINY run of tests/test_compression.py on 4
mirrored CPU replicas with PowerSGD. Prints, for each later run against the
first, the largest relative loss difference and the first step that differs
(docs/compression.md, "Reproducibility on CPU").
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--num_layers=2", "--d_model=32", "--num_heads=4", "--d_ff=64", "--seq_len=32",
       "--global_batch_size=8", "--learning_rate=3e-3", "--warmup_steps=1", "--jit_compile=false",
       "--min_lr_ratio=1.0", "--eval_steps=0", "--checkpoint_every=1000", "--strategy=mirrored",
       "--num_cpu_devices=4", "--powersgd_min_size=0", "--steps_per_call=1", "--log_every=1",
       "--train_steps=80", "--grad_compression=powersgd"]


def losses(model_dir):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return np.array([r["loss"] for r in records if r["kind"] == "train"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("extra", nargs="*", help="train flags added after the default job's")
  args = parser.parse_args()
  env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
  print(f"TF_NUM_INTEROP_THREADS={os.environ.get('TF_NUM_INTEROP_THREADS', '(unset)')}")
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(args.runs):
      model_dir = os.path.join(tmp, f"run{i}")
      subprocess.run([sys.executable, "-m", "tfpar.train", *JOB, *args.extra,
                      f"--model_dir={model_dir}"], env=env, cwd=REPO, check=True,
                     stdout=subprocess.DEVNULL)
      results.append(losses(model_dir))
  for i, other in enumerate(results[1:], start=1):
    rel = np.abs(other - results[0]) / np.abs(results[0])
    differ = np.nonzero(rel)[0]
    first = f"from step {differ[0] + 1}" if len(differ) else "none differ"
    print(f"run {i} vs run 0: max relative loss difference {rel.max():.2e} ({first})")


if __name__ == "__main__":
  main()
