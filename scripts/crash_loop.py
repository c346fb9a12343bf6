"""Runs one tfpar command N times and keeps what every native crash left (issue 33).

    nice -n 15 python scripts/crash_loop.py --repeats=50 --out=/tmp/crash_loop
    nice -n 15 python scripts/crash_loop.py --mode=gpipe4 --repeats=20 --out=/tmp/crash_loop4

--mode=xla_pipeline (default): configs/gpt_tiny.flags with --num_cpu_devices=2
--pipeline_stages=2 --microbatches=4 --jit_compile=true, 5 steps, in one process
(--small swaps in a 2-layer, d_model 64 model for a loaded machine).
--mode=gpipe4: the same model as a 4-worker GPipe launch (python -m tfpar.launch
--num_workers=4, one stage per worker).

Each run has its own --model_dir and PYTHONFAULTHANDLER=1, so a SIGSEGV or an
abort prints the Python stack of every thread to stderr; a run that ends by a
signal (or prints "Fatal Python error") keeps its whole stderr as
OUT/run_K.stderr. The summary counts exit statuses and names each crash's
innermost tfpar/TensorFlow frame of the crashing thread.
"""

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--num_layers=2", "--d_model=64", "--num_heads=4", "--seq_len=64",
         "--global_batch_size=8"]


def command(mode: str, small: bool, model_dir: str):
  model = ["--flagfile=configs/gpt_tiny.flags"] + (SMALL if small else [])
  run = ["--train_steps=5", "--steps_per_call=1", "--log_every=1", "--eval_every=0",
         "--checkpoint_every=5", f"--model_dir={model_dir}"]
  if mode == "xla_pipeline":
    return [sys.executable, "-m", "tfpar.train", *model, *run, "--num_cpu_devices=2",
            "--pipeline_stages=2", "--microbatches=4", "--jit_compile=true"]
  return [sys.executable, "-m", "tfpar.launch", "--num_workers=4", "--", *model, *run,
          "--strategy=multi_worker_mirrored", "--pipeline_stages=4", "--microbatches=4",
          "--pipeline_schedule=gpipe", "--num_layers=4", "--jit_compile=false"]


def crash_frame(stderr: str) -> str:
  """The innermost frame of the thread faulthandler names as crashing ('Current thread')."""
  block = stderr.split("Current thread", 1)[-1] if "Current thread" in stderr else stderr
  frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
  return f"{frames[0][0]}:{frames[0][1]} in {frames[0][2]}" if frames else "(no Python frame)"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", choices=["xla_pipeline", "gpipe4"], default="xla_pipeline")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--out", default="/tmp/crash_loop")
  parser.add_argument("--timeout", type=int, default=900)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=REPO)
  statuses, crashes = collections.Counter(), []
  for k in range(args.repeats):
    model_dir = os.path.join(args.out, f"run_{k}")
    shutil.rmtree(model_dir, ignore_errors=True)
    start = time.monotonic()
    try:
      proc = subprocess.run(command(args.mode, args.small, model_dir), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=args.timeout)
      code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
      code, stderr = "timeout", (e.stderr or b"").decode("utf-8", "replace")
    shutil.rmtree(model_dir, ignore_errors=True)
    crashed = (isinstance(code, int) and (code < 0 or code > 128)) or \
        "Fatal Python error" in stderr or code == "timeout"
    name = signal.Signals(-code).name if isinstance(code, int) and code < 0 else str(code)
    statuses[name] += 1
    if crashed:
      with open(os.path.join(args.out, f"run_{k}.stderr"), "w") as f:
        f.write(stderr)
      crashes.append((k, name, crash_frame(stderr)))
    print(f"run {k + 1}/{args.repeats}: exit {name} in {time.monotonic() - start:.0f} s"
          + (f"  CRASH at {crashes[-1][2]}" if crashed else ""), flush=True)
  print(f"{args.mode}{' --small' if args.small else ''}: {args.repeats} runs, exit statuses "
        f"{dict(statuses)}; {len(crashes)} crash(es)")
  for k, name, frame in crashes:
    print(f"  run {k}: {name} at {frame} (stderr: {args.out}/run_{k}.stderr)")
  return 1 if crashes else 0


if __name__ == "__main__":
  sys.exit(main())
