"""Prepare throughput and the cost of streaming: what docs/data.md reports.

    nice -n 10 python scripts/data_bench.py prepare [--rounds=3] [--tokenizer=SPEC] [--data=GLOB]
    nice -n 10 python scripts/data_bench.py train [--rounds=3] [--steps=60]

prepare: `python -m tfpar.data prepare` of the embedded corpus (the standard
library's top-level source) with --workers=1 and --workers=2, each run in its
own process, alternating; MB/s of text is prepare's own last progress line
(from its first file to its last, TensorFlow's import excluded; the workers'
start-up included).

train: `python -m tfpar.train --flagfile=configs/gpt_tiny.flags` on that
corpus in memory (--data=its files) and streamed (--data=its prepared set),
each run in its own process, alternating; tokens/s is the median over a run's
logged steps after the first, then the median over rounds, and the ratio.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")


def run(module, args):
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, check=False)
  if proc.returncode:
    raise SystemExit(f"{module} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  return proc


def prepare_rate(tmp, workers, tokenizer, data, i):
  out = os.path.join(tmp, f"prep-{workers}-{i}")
  proc = run("tfpar.data", ["prepare", f"--data={data}", f"--tokenizer={tokenizer}",
                            f"--out={out}", f"--workers={workers}"])
  last = [l for l in proc.stderr.splitlines() if l.startswith("prepare:")][-1]
  return float(re.search(r"([\d.,]+) MB/s", last).group(1).replace(",", ""))


def train_rate(tmp, data, steps, i):
  model_dir = os.path.join(tmp, f"run-{i}")
  run("tfpar.train", ["--flagfile=configs/gpt_tiny.flags", f"--data={data}",
                      f"--model_dir={model_dir}", f"--train_steps={steps}", "--log_every=10",
                      "--steps_per_call=10", "--eval_every=100000", "--checkpoint_every=100000"])
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(l) for l in f if l.strip()]
  rates = [r["tokens_per_sec"] for r in records if r["kind"] == "train"][1:]
  return statistics.median(rates)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("what", choices=["prepare", "train"])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--tokenizer", default="bytes")
  parser.add_argument("--data", default=TEXT, help="What prepare reads (default: the embedded "
                      "corpus)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    if args.what == "prepare":
      systems = {"workers=1": 1, "workers=2": 2}
      measure = lambda name, i: prepare_rate(tmp, systems[name], args.tokenizer, args.data,
                                                i)
      unit = "MB/s of text"
    else:
      prepared = os.path.join(tmp, "prepared")
      run("tfpar.data", ["prepare", f"--data={TEXT}", f"--out={prepared}"])
      systems = {"in memory": TEXT, "streamed": prepared}
      measure = lambda name, i: train_rate(tmp, systems[name], args.steps, f"{name[:2]}{i}")
      unit = "tokens/s"
    results = {name: [] for name in systems}
    for i in range(args.rounds):
      for name in (systems if i % 2 == 0 else reversed(list(systems))):
        results[name].append(measure(name, i))
        print(f"round {i}: {name}: {results[name][-1]:,.2f} {unit}", flush=True)
  medians = {name: statistics.median(v) for name, v in results.items()}
  first = next(iter(medians.values()))
  for name, value in medians.items():
    print(f"{name}: median {value:,.2f} {unit} over {args.rounds} rounds, "
          f"ratio {value / first:.3f}")


if __name__ == "__main__":
  main()
