"""Step time while a checkpoint is written in the background, against no save and a blocking save.

Each configuration trains in a fresh process of its own (`python -m tfpar.train`,
one device, one step per call, a train record per step), the rounds alternate
the configurations, and the medians over rounds are printed with their ratios
to `none`:

  none    --checkpoint_every larger than the run: no save at all;
  async   a checkpoint every --every steps, written in the background
          (--async_checkpoint, the default);
  sync    the same checkpoints written before the next step (--async_checkpoint=false).

Per run: the mean step time over the steady steps (the first two left out), the
steps of `async` during a background write included (metrics.jsonl's step_time:
the time of the step's call), and the wall seconds the whole process took.

  nice -n 10 python scripts/async_save_bench.py --rounds=3 --out=async_save.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num_layers=4", "--d_model=256", "--num_heads=4", "--d_ff=1024", "--seq_len=128",
         "--global_batch_size=8", "--steps_per_call=1", "--log_every=1", "--eval_every=0",
         "--eval_steps=0", "--strategy=one_device", "--keep_checkpoints=2"]
CONFIGS = {"none": ["--checkpoint_every=100000"],
           "async": ["--async_checkpoint=true"],
           "sync": ["--async_checkpoint=false"]}


def run(name, args, work):
  model_dir = tempfile.mkdtemp(prefix=f"{name}_", dir=work)
  every = [] if name == "none" else [f"--checkpoint_every={args.every}"]
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "tfpar.train", *MODEL, *CONFIGS[name], *every,
                  f"--train_steps={args.steps}", f"--model_dir={model_dir}"], cwd=REPO,
                 env=dict(os.environ, PYTHONPATH=REPO), check=True, capture_output=True)
  wall = time.perf_counter() - start
  with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
    times = [r["step_time"] for r in map(json.loads, f) if r.get("kind") == "train"]
  return {"step_time": statistics.mean(times[2:]), "wall": wall}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--every", type=int, default=5)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  work = tempfile.mkdtemp(prefix="async_save_bench_")
  results = {name: [] for name in CONFIGS}
  for _ in range(args.rounds):
    for name in CONFIGS:
      results[name].append(run(name, args, work))
  medians = {name: {k: statistics.median(r[k] for r in runs) for k in ("step_time", "wall")}
             for name, runs in results.items()}
  for name, m in medians.items():
    print(f"{name:6} step {m['step_time'] * 1000:7.2f} ms ({m['step_time'] / medians['none']['step_time']:.3f}x none)"
          f" | process {m['wall']:6.1f} s ({m['wall'] / medians['none']['wall']:.3f}x none)")
  report = {"model": MODEL, "steps": args.steps, "every": args.every, "rounds": args.rounds,
            "medians": medians, "runs": results}
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  main()
