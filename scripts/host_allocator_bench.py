"""Step time and peak resident memory under each --host_allocator, rounds alternated.

Each allocator trains in a fresh process of its own (`python -m tfpar.train`, one
device, a GPT of --num_layers blocks of --d_model, 8 sequences of 32 tokens a step,
one step a call, XLA off, no checkpoint), the rounds alternate the allocators, and
the medians over rounds are printed with their ratios to bfc:

  bfc     TensorFlow's default: oneDNN's pool, which keeps freed blocks for reuse;
  system  malloc, each block of 256 KiB or more mapped on its own and unmapped when
          freed (tfpar.console.set_host_allocator; docs/sharded_state.md).

Per run: the mean step time over the steps after the first two (metrics.jsonl's
step_time) and the process's peak RSS (`os.wait4`'s ru_maxrss).

  python scripts/host_allocator_bench.py --rounds=3 --out=host_allocator.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOCATORS = ("bfc", "system")


def run(allocator, a, work):
  model_dir = tempfile.mkdtemp(prefix=f"{allocator}_", dir=work)
  flags = [f"--num_layers={a.num_layers}", f"--d_model={a.d_model}",
           f"--num_heads={max(1, a.d_model // 64)}", f"--d_ff={4 * a.d_model}", "--seq_len=32",
           "--global_batch_size=8", "--dropout=0", "--steps_per_call=1", "--log_every=1",
           "--eval_every=0", "--eval_steps=0", "--jit_compile=false", "--strategy=one_device",
           f"--train_steps={a.steps}", f"--checkpoint_every={a.steps + 1}",
           f"--host_allocator={allocator}", f"--model_dir={model_dir}"]
  proc = subprocess.Popen([sys.executable, "-m", "tfpar.train", *flags], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  _, status, usage = os.wait4(proc.pid, 0)
  if os.waitstatus_to_exitcode(status):
    raise SystemExit(f"{allocator}: exit status {os.waitstatus_to_exitcode(status)}")
  with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
    times = [r["step_time"] for r in map(json.loads, f) if r.get("kind") == "train"]
  shutil.rmtree(model_dir, ignore_errors=True)
  return {"step_ms": 1000 * statistics.mean(times[2:]), "peak_rss_mib": usage.ru_maxrss / 1024}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--num_layers", type=int, default=2)
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--out", default="")
  a = parser.parse_args()
  work = tempfile.mkdtemp(prefix="host_allocator_bench_")
  runs = {name: [] for name in ALLOCATORS}
  for _ in range(a.rounds):
    for name in ALLOCATORS:
      runs[name].append(run(name, a, work))
  shutil.rmtree(work, ignore_errors=True)
  median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for name, rs in runs.items()}
  report = {"model": f"{a.num_layers} x d_model {a.d_model}", "rounds": runs, "median": median,
            "ratio_to_bfc": {name: {k: m[k] / median["bfc"][k] for k in m}
                             for name, m in median.items()}}
  text = json.dumps(report, indent=2)
  print(text)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(text)


if __name__ == "__main__":
  main()
