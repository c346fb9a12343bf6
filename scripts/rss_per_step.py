"""How a multi-worker job's resident memory moves step after step, once it is running.

Runs `python -m tfpar.train` as --workers processes on loopback (TF_CONFIG each), a tiny GPT
(--num_layers blocks of d_model 32) for --steps steps, no checkpoint until the end, data
parallel or --optimizer_sharding=zero3. Each time the chief logs a step (--log_every=10),
the chief's VmRSS is read from /proc. Prints one JSON object: the samples, and the growth
from the sample at --steps/5 (after tracing and warm-up) to the last, in KiB per step.

  python scripts/rss_per_step.py --layout=zero3 --steps=1000
  python scripts/rss_per_step.py --layout=data --steps=1000

docs/failures.md has today's figures: TensorFlow keeps a record of every collective instance
key for the life of the process, so a job whose collectives took fresh keys at each call
grew by about half a KiB per collective (tfpar.strategies.fixed_instance_keys).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharded_state_rss import REPO, TINY, free_ports  # pylint: disable=wrong-import-position
from tfpar.config.cluster import tf_config  # pylint: disable=wrong-import-position  # REPO on sys.path.


def vm_rss_kib(pid: int) -> int:
  with open(f"/proc/{pid}/status", encoding="utf-8") as f:
    return int(f.read().split("VmRSS:")[1].split()[0])


def run(layout: str, steps: int, workers: int, num_layers: int, model_dir: str) -> list:
  """[(step, chief's VmRSS in KiB)] at each step the chief logs."""
  flags = ["--dropout=0", "--seq_len=32", "--global_batch_size=8", "--steps_per_call=1",
           "--log_every=10", "--eval_every=0", "--eval_steps=0", f"--train_steps={steps}",
           f"--checkpoint_every={steps}", "--jit_compile=false", *TINY,
           f"--num_layers={num_layers}", "--strategy=multi_worker_mirrored",
           f"--model_dir={model_dir}"]
  if layout == "zero3":
    flags.append("--optimizer_sharding=zero3")
  spec = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
  procs = []
  for i in range(workers):
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1",
               TF_CONFIG=tf_config(spec, "worker", i))
    procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "tfpar.train", *flags], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT))
  samples, tail = [], []

  def read_chief():
    for line in procs[0].stdout:
      tail.append(line)
      match = re.match(r"step\s+(\d+)/", line)
      if match:
        samples.append((int(match.group(1)), vm_rss_kib(procs[0].pid)))

  reader = threading.Thread(target=read_chief, daemon=True)
  reader.start()
  codes = [p.wait() for p in procs]
  reader.join()
  if any(codes):
    raise SystemExit(f"exit statuses {codes}\n" + "".join(tail[-30:]))
  return samples


def growth_kib_per_step(samples: list) -> float:
  """KiB per step from the first sample at or after a fifth of the run to the last."""
  last_step = samples[-1][0]
  first = next(s for s in samples if s[0] >= last_step // 5)
  return (samples[-1][1] - first[1]) / max(1, samples[-1][0] - first[0])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--layout", choices=("data", "zero3"), default="zero3")
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--out", default=None)
  a = parser.parse_args(argv)
  if a.steps < 50:
    parser.error("--steps must be at least 50: the first fifth is warm-up")
  work = tempfile.mkdtemp(prefix="rss_per_step_")
  try:
    samples = run(a.layout, a.steps, a.workers, a.num_layers, os.path.join(work, "model"))
  finally:
    shutil.rmtree(work, ignore_errors=True)
  report = {"layout": a.layout, "workers": a.workers, "num_layers": a.num_layers,
            "steps": a.steps, "rss_kib": samples,
            "growth_kib_per_step": round(growth_kib_per_step(samples), 3)}
  text = json.dumps(report)
  print(text)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return report


if __name__ == "__main__":
  main()
